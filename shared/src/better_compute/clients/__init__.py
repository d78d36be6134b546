"""A typed client per service: keyword arguments only, Structs of ``better_compute.wire`` back.

Each is built on ``service.client.ApiClient`` (``Client(api, timeout=…)``) and raises the
service's ``BcError``s. The one positional argument is ``CommandQueueClient.enqueue(command)``,
which takes the request Struct itself. ``StepPki`` and ``StepSecrets`` are what a step sees as
``ctx.pki`` and ``ctx.secrets`` (the ``Pki`` and ``Secrets`` protocols of ``provision``).
"""

from ._base import ServiceClient
from .cmdq import CommandQueueClient
from .engine import EngineClient
from .pki import PkiClient, StepPki
from .secrets import SecretsClient, StepSecrets

__all__ = [
    "CommandQueueClient",
    "EngineClient",
    "PkiClient",
    "SecretsClient",
    "ServiceClient",
    "StepPki",
    "StepSecrets",
]
