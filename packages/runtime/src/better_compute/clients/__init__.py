"""A typed client per service: keyword arguments only, Structs of ``better_compute.wire`` back.

Each is built on ``service.client.ApiClient`` (``Client(api, timeout=…)``) and raises the
service's ``BcError``s. The one positional argument is ``CommandQueueClient.enqueue(command)``,
which takes the request Struct itself. ``StepPki`` and ``StepSecrets`` are what a step sees as
``ctx.pki`` and ``ctx.secrets`` (the ``Pki`` and ``Secrets`` protocols of ``provision``).

Each name loads its module on first use (PEP 562): a caller of the engine's client does not load
the secrets client's cryptography.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._imports import lazy_attributes

if TYPE_CHECKING:
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

_HOME = {
    "ServiceClient": "_base",
    "CommandQueueClient": "cmdq",
    "EngineClient": "engine",
    "PkiClient": "pki",
    "StepPki": "pki",
    "SecretsClient": "secrets",
    "StepSecrets": "secrets",
}

__getattr__ = lazy_attributes(__name__, _HOME)
