"""What metal uses of the engine: its owner reconcilers, event handlers and side loops are given
a ``MetalHost`` (the engine's reconciler is one), never more of the engine than this."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from better_compute.app import App
from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.pki import PkiClient
from better_compute.clients.secrets import SecretsClient
from better_compute.provision import Profile
from better_compute.service.db import Database

from ..store import WorkflowRow

__all__ = ["MetalHost"]


class MetalHost(Protocol):
    app: App
    db: Database
    cmdq: CommandQueueClient
    pki: PkiClient
    secrets: SecretsClient
    log: Any
    publish: Callable[[str, str, Any], Awaitable[None]]
    wake: Callable[[str], Awaitable[None]] | None

    async def profile(self, wf: WorkflowRow) -> Profile | None:
        """The workflow's pinned profile version (None when it is gone)."""
