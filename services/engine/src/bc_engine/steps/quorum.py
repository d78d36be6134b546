"""The destructive batch of a workflow under the quorum.

When the command-queue has approvers configured, a workflow that can send destructive commands
gets its batch before it sends anything: scope = its destructive kinds (and, for a profile that
writes disks, every boot command it sends: ``batch_kinds``) and its node, found by the
workflow's key, so creating it again after a crash finds the same batch.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from better_compute.app import App
from better_compute.clients.cmdq import CommandQueueClient
from better_compute.core.errors import BcError
from better_compute.core.keys import workflow_command_prefix
from better_compute.wire import engine as m

from .. import store
from ..core.outcomes import QUEUE_RETRY_S
from ..store import WorkflowRow

__all__ = ["BATCH_TTL_S", "QUORUM_CACHE_S", "QuorumBatches", "batch_kinds", "in_batch"]

BATCH_TTL_S = 24 * 3600  # how long approvers have for a workflow's destructive batch
QUORUM_CACHE_S = 60.0  # whether approvers are configured is asked at most this often


def in_batch(app: App, kind_name: str, *, writes_disk: bool | None) -> bool:
    """Whether a workflow's command of this kind goes inside its batch: a destructive kind
    always; a boot command (power, boot device, media, boot entries) when the workflow's
    profile writes disks, since it leads to the disk being written (an installer it boots, the
    power cycle into it, the ramdisk about to wipe)."""
    kind = app.command_kinds.get(kind_name)
    if kind is None:
        return False
    return kind.destructive or (writes_disk is True and kind.boot is not None)


def batch_kinds(app: App, kinds: list[str], *, writes_disk: bool | None) -> list[str]:
    """The batch scope of a workflow that can send ``kinds``: those ``in_batch``."""
    return [k for k in kinds if in_batch(app, k, writes_disk=writes_disk)]


class QuorumBatches:
    def __init__(
        self,
        *,
        app: App,
        db: Any,
        cmdq: CommandQueueClient,
        publish: Callable[[str, str, Any], Awaitable[None]],
        log: Any,
        writes_disk: Callable[[WorkflowRow], Awaitable[bool | None]],
    ) -> None:
        self.writes_disk = writes_disk
        self.app = app
        self.db = db
        self.cmdq = cmdq
        self.publish = publish
        self.log = log
        self._enabled: tuple[bool, float] | None = None

    async def enabled(self) -> bool:
        """Whether the command-queue has approvers configured (asked at most once a minute)."""
        now = time.time()
        if self._enabled is None or now - self._enabled[1] > QUORUM_CACHE_S:
            self._enabled = ((await self.cmdq.quorum()).enabled, now)
        return self._enabled[0]

    async def ensure(self, wf: WorkflowRow) -> float | None:
        """Give ``wf`` its batch if it needs one; returns when to try again, or None (done, or
        not needed). Sets ``wf.batch_id``."""
        if wf.batch_id is not None or wf.state != "running":
            return None
        kinds = batch_kinds(self.app, wf.command_kinds, writes_disk=await self.writes_disk(wf))
        if not kinds:
            return None
        try:
            if not await self.enabled():
                return None
            batch = await self.cmdq.create_batch(
                tenant_id=wf.tenant_id,
                kinds=kinds,
                nodes=[wf.node_id] if wf.node_id else [],
                ttl_seconds=BATCH_TTL_S,
                workflow_id=wf.id,
                idempotency_key=workflow_command_prefix(wf.id),
                note=f"workflow {wf.id} ({wf.profile_id}@{wf.profile_version})",
            )
        except BcError as err:
            self.log.warning("batch_create_failed", workflow_id=wf.id, code=err.code.value)
            return time.time() + QUEUE_RETRY_S
        await self.db.execute(store.SET_BATCH, wf.id, batch.id)
        wf.batch_id = batch.id
        await self.publish(
            m.EVENTS, wf.id, m.BatchCreated(workflow_id=wf.id, batch_id=batch.id, at=time.time())
        )
        return None
