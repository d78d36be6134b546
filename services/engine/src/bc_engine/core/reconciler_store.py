"""The reconciler's store seam: every statement the pass runs, as a named method returning row
Structs (``ReconcilerStore``), so the state machine (``engine``, ``attempts``) can be run against
an in-memory store in a unit test (``tests/support/reconciler_memory.py``) as well as against
PostgreSQL (``PgReconcilerStore``: one statement of ``bc_engine.store`` per method, as before, so
a pass costs the same round trips; ``settle_ok`` shares its statement with the other passes'
settles of the moment, ``GroupCommit``).

``fence`` is (shard, owner, epoch): a write that carries it commits only while this process still
holds the key's shard under that epoch (``HOLDS_SHARD``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import msgspec

from better_compute.service.groups import GroupCommit

from .. import store
from ..store import StepRow, WorkflowRow
from . import queue

__all__ = ["Fence", "PgReconcilerStore", "ReconcilerStore", "SettledOk"]

Fence = tuple[int, str, int]  # shard, owner (this process life), epoch


class SettledOk(msgspec.Struct, frozen=True):
    """What ``settle_ok`` did: nothing (``settled`` False: fenced, or moved by a verb), started
    the next step (``next``), finished the workflow (``finished``), or neither (the next step needs
    more care first)."""

    settled: bool
    finished: bool = False
    next: StepRow | None = None


class ReconcilerStore(Protocol):
    # -- the work queue
    async def queue_seq(self, rkey: str) -> int | None: ...
    async def queue_at(self, rkey: str, at: float, seen_seq: int | None) -> None: ...
    async def queue_done(self, rkey: str, seen_seq: int | None) -> None: ...

    # -- a pass
    async def pass_workflows(self, rkey: str) -> tuple[int | None, list[tuple[WorkflowRow, Any]]]:
        """The key's work-queue seq and its workflows to look at (running, or with an abort's
        clean-up to do), oldest first, each with its record (what the pass read along)."""

    async def workflow(self, workflow_id: str) -> WorkflowRow: ...
    async def holds_shard(self, fence: Fence) -> bool: ...
    async def start_first(self, workflow_id: str, fence: Fence) -> StepRow | None: ...
    async def next_step(self, workflow_id: str) -> StepRow | None: ...
    async def mark_running(
        self, workflow_id: str, idx: int, attempt: int, sent: bool, minted: list[str], fence: Fence
    ) -> StepRow | None: ...
    async def settle_ok(
        self, workflow_id: str, idx: int, attempt: int, result_json: str, fence: Fence, owner_rkey: str | None
    ) -> SettledOk: ...
    async def settle_failed(
        self, workflow_id: str, idx: int, attempt: int, error_json: str, fence: Fence, owner_rkey: str | None
    ) -> bool:
        """The attempt failed and its workflow with it (one transaction); False when fenced."""

    async def settle_retry(
        self, workflow_id: str, idx: int, attempt: int, error_json: str, fence: Fence, delay_s: float
    ) -> float | None:
        """Back to pending, the next attempt not before ``delay_s``; that moment, None when fenced."""

    async def finish(
        self, workflow_id: str, state: str, error_json: str | None, fence: Fence, owner_rkey: str | None
    ) -> bool:
        """End the workflow (and queue its owner); False when this process lost the shard."""

    # -- what an attempt did
    async def mark_sent(self, workflow_id: str, idx: int, attempt: int) -> bool: ...
    async def mark_minted(
        self, workflow_id: str, idx: int, attempt: int, service: str, secret: bytes
    ) -> bytes | None: ...
    async def set_waiting(self, workflow_id: str, idx: int, attempt: int, what_json: str | None) -> None: ...
    async def stored_profile(self, tenant_id: str, profile_id: str, version: int) -> Any: ...

    # -- after an abort (attempts)
    async def cancelled_step(self, workflow_id: str) -> StepRow | None: ...
    async def any_sent(self, workflow_id: str) -> bool: ...
    async def minted_steps(self, workflow_id: str) -> list[StepRow]: ...
    async def cleaned_up(self, workflow_id: str) -> None: ...


class PgReconcilerStore:
    """``ReconcilerStore`` on the engine's PostgreSQL database (``bc_engine.store``)."""

    def __init__(self, db: Any) -> None:
        self.db = db
        self.settles: GroupCommit[tuple[Any, ...], Any] = GroupCommit(
            self._settle_many, key=lambda row: row[0], row_by_row=lambda _exc: False, keep_abandoned=True
        )
        """The successes this process's passes settle at the same time go to PostgreSQL together,
        as one ``SETTLE_OK`` statement (one round trip, one commit): what costs most per step on
        both sides is the statement and its commit, not the rows. Each row is settled on its own
        terms (attempt, fence), so a group is as safe as its rows one by one; a settle whose pass
        was cancelled still goes (its step's work is done), and a group that fails fails each of
        its passes (each runs again). A row: one element of each of ``SETTLE_OK``'s arrays."""

    async def _settle_many(self, rows: Sequence[tuple[Any, ...]]) -> list[Any]:
        columns = [list(col) for col in zip(*rows, strict=True)]
        by_workflow = {r["workflow_id"]: r for r in await self.db.fetch(store.SETTLE_OK, *columns)}
        return [by_workflow[row[0]] for row in rows]

    async def queue_seq(self, rkey: str) -> int | None:
        return await queue.read_seq(self.db.pool, rkey)

    async def queue_at(self, rkey: str, at: float, seen_seq: int | None) -> None:
        await queue.queue_at(self.db.pool, rkey, at, seen_seq)

    async def queue_done(self, rkey: str, seen_seq: int | None) -> None:
        await queue.done(self.db.pool, rkey, seen_seq)

    async def pass_workflows(self, rkey: str) -> tuple[int | None, list[tuple[WorkflowRow, Any]]]:
        # the queue entry's seq comes along with the workflows: one round trip
        rows = await self.db.fetch(store.PASS_WORKFLOWS, rkey)
        seen = rows[0]["queue_seq"] if rows else await queue.read_seq(self.db.pool, rkey)
        return seen, [(store.workflow_row(row), row) for row in rows]

    async def workflow(self, workflow_id: str) -> WorkflowRow:
        return store.workflow_row(await self.db.fetchrow(store.WORKFLOW, workflow_id))

    async def holds_shard(self, fence: Fence) -> bool:
        return bool(await self.db.fetchval(store.HOLDS_SHARD, *fence))

    async def start_first(self, workflow_id: str, fence: Fence) -> StepRow | None:
        row = await self.db.fetchrow(store.START_FIRST, workflow_id, *fence)
        return store.step_row(row) if row is not None else None

    async def next_step(self, workflow_id: str) -> StepRow | None:
        row = await self.db.fetchrow(store.NEXT_STEP, workflow_id)
        return store.step_row(row) if row is not None else None

    async def mark_running(
        self, workflow_id: str, idx: int, attempt: int, sent: bool, minted: list[str], fence: Fence
    ) -> StepRow | None:
        row = await self.db.fetchrow(store.MARK_RUNNING, workflow_id, idx, attempt, sent, minted, *fence)
        return store.step_row(row) if row is not None else None

    async def settle_ok(
        self, workflow_id: str, idx: int, attempt: int, result_json: str, fence: Fence, owner_rkey: str | None
    ) -> SettledOk:
        row = await self.settles(
            (workflow_id, idx, attempt, result_json, *fence,
             owner_rkey, queue.shard_of(owner_rkey) if owner_rkey else None)
        )  # fmt: skip
        if not row["settled"]:
            return SettledOk(settled=False)
        started = store.step_row(row["next"]) if row["next"] is not None else None
        return SettledOk(settled=True, finished=bool(row["finished"]), next=started)

    async def settle_failed(
        self, workflow_id: str, idx: int, attempt: int, error_json: str, fence: Fence, owner_rkey: str | None
    ) -> bool:
        async with self.db.transaction() as conn:
            done = await conn.fetchval(store.SETTLE_FAILED, workflow_id, idx, attempt, error_json, *fence)
            if not done:
                return False
            await _finish_in(conn, workflow_id, "failed", error_json, owner_rkey)
        return True

    async def settle_retry(
        self, workflow_id: str, idx: int, attempt: int, error_json: str, fence: Fence, delay_s: float
    ) -> float | None:
        at = await self.db.fetchval(
            store.SETTLE_RETRY, workflow_id, idx, attempt, error_json, *fence, delay_s
        )
        return float(at.timestamp()) if at is not None else None

    async def finish(
        self, workflow_id: str, state: str, error_json: str | None, fence: Fence, owner_rkey: str | None
    ) -> bool:
        async with self.db.transaction() as conn:
            if not await conn.fetchval(store.HOLDS_SHARD, *fence):
                return False
            await _finish_in(conn, workflow_id, state, error_json, owner_rkey)
        return True

    async def mark_sent(self, workflow_id: str, idx: int, attempt: int) -> bool:
        return bool(await self.db.fetchval(store.MARK_SENT, workflow_id, idx, attempt))

    async def mark_minted(
        self, workflow_id: str, idx: int, attempt: int, service: str, secret: bytes
    ) -> bytes | None:
        found: bytes | None = await self.db.fetchval(
            store.MARK_MINTED, workflow_id, idx, attempt, service, secret
        )
        return found

    async def set_waiting(self, workflow_id: str, idx: int, attempt: int, what_json: str | None) -> None:
        await self.db.execute(store.SET_WAITING, workflow_id, idx, attempt, what_json)

    async def stored_profile(self, tenant_id: str, profile_id: str, version: int) -> Any:
        return await self.db.fetchval(store.STORED_PROFILE, tenant_id, profile_id, version)

    async def cancelled_step(self, workflow_id: str) -> StepRow | None:
        row = await self.db.fetchrow(store.CANCELLED_STEP, workflow_id)
        return store.step_row(row) if row is not None else None

    async def any_sent(self, workflow_id: str) -> bool:
        return bool(await self.db.fetchval(store.ANY_SENT, workflow_id))

    async def minted_steps(self, workflow_id: str) -> list[StepRow]:
        return [store.step_row(r) for r in await self.db.fetch(store.MINTED_STEPS, workflow_id)]

    async def cleaned_up(self, workflow_id: str) -> None:
        await self.db.execute(store.CLEANED_UP, workflow_id)


async def _finish_in(
    conn: Any, workflow_id: str, state: str, error_json: str | None, owner_rkey: str | None
) -> None:
    updated = await conn.fetchval(store.FINISH_WORKFLOW, workflow_id, state, error_json)
    if updated and owner_rkey:
        await queue.queue_now(conn, owner_rkey)
