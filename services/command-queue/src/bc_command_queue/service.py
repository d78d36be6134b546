"""The bc-command-queue service process."""

from __future__ import annotations

from typing import ClassVar

from better_compute.service import Service

__all__ = ["CommandQueueService"]


class CommandQueueService(Service):
    """Command queue: commands, per-site streams, agents, destructive-batch quorum"""

    name: ClassVar[str] = "bc-command-queue"
    api_name: ClassVar[str] = "command-queue"
    schema: ClassVar[str | None] = "cmdq"
    migrations_package: ClassVar[str | None] = "bc_command_queue.migrations"
    description: ClassVar[str] = (
        "Command queue: commands, per-site streams, agents, destructive-batch quorum"
    )
