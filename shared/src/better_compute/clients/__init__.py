"""A typed client per service: keyword-only options, Structs of ``better_compute.wire`` back.

Each is built on ``service.client.ApiClient`` (``Client(api, timeout=…)``) and raises the
service's ``BcError``s.
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
