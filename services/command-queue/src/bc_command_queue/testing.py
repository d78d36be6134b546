"""``MemoryStore``: the command queue's ``Store`` in memory, for unit tests.

The same operations as ``storage.PgStore``, each written after its statement in ``store`` (the
statement's name is in each method's docstring), on dicts, under a clock a test moves
(``advance``). No PostgreSQL, no NATS: a state machine of the queue (claims, runs, batches and
the quorum, the sweeper's expiry and dispatch) runs against it in milliseconds. The SQL stays the
truth; ``tests/integration/test_cmdq_store_contract.py`` runs one script against both stores.

Agents and boot leases are seeded by hand (``agent_seen``, ``lease``): their own statements are
not behind the ``Store`` yet.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Literal, cast

from better_compute.wire.cmdq import TERMINAL_STATES, CommandState

from .rows import (
    ApprovalRow,
    BatchRow,
    BatchSizeRow,
    ClaimStateRow,
    CommandRow,
    CommandStateRow,
    JournalRow,
    ProgressRow,
)
from .storage import NewBatch, NewCommand

__all__ = ["MemoryStore"]

_LIVE = ("pending", "dispatched", "acked", "running")
_CLAIMED = ("acked", "running")


@dataclasses.dataclass
class _Command:
    id: str
    node_id: str
    site_id: str
    tenant_id: str
    key: str
    kind: str
    destructive: bool
    target: Literal["site", "node"]
    payload: str
    digest: bytes
    agent_id: str | None
    state: CommandState
    batch_id: str | None
    workflow_id: str | None
    step: int | None
    created_at: float
    updated_at: float
    not_after: float
    reason: str | None = None
    progress: str | None = None
    result: bytes | None = None
    result_signature: bytes | None = None
    attested: bool = False
    dispatched_at: float | None = None
    published_at: float | None = None
    acked_at: float | None = None
    finished_at: float | None = None
    ended_at: float | None = None
    publishes: int = 0
    stream_seq: int | None = None
    claim_journal: str | None = None
    claim_signed_ms: int | None = None

    def row(self) -> CommandRow:
        return CommandRow(
            id=self.id, node_id=self.node_id, site_id=self.site_id, tenant_id=self.tenant_id,
            key=self.key, kind=self.kind, destructive=self.destructive, target=self.target,
            payload=self.payload, agent_id=self.agent_id, state=self.state, reason=self.reason,
            progress=self.progress, batch_id=self.batch_id, workflow_id=self.workflow_id,
            step=self.step, result=self.result, attested=self.attested, created_at=self.created_at,
            updated_at=self.updated_at, not_after=self.not_after, dispatched_at=self.dispatched_at,
            publishes=self.publishes,
        )  # fmt: skip


@dataclasses.dataclass
class _Batch:
    new: NewBatch
    created_at: float
    approved_at: float | None = None
    closed_at: float | None = None
    closed_reason: str | None = None
    expiry_published_at: float | None = None

    @property
    def expires_at(self) -> float:
        return self.new.expires_at_ms / 1000


@dataclasses.dataclass
class _Agent:
    site_id: str
    role: str
    kinds: list[str] | None
    last_seen: float


@dataclasses.dataclass
class _Journal:
    generation: int
    last_seen: float
    present: bool


@dataclasses.dataclass
class _Tables:
    commands: dict[str, _Command] = dataclasses.field(default_factory=dict)
    batches: dict[str, _Batch] = dataclasses.field(default_factory=dict)
    approvals: dict[tuple[str, str], ApprovalRow] = dataclasses.field(default_factory=dict)
    agents: dict[str, _Agent] = dataclasses.field(default_factory=dict)
    leases: dict[str, tuple[str, float]] = dataclasses.field(default_factory=dict)
    journals: dict[tuple[str, str], _Journal] = dataclasses.field(default_factory=dict)


class MemoryStore:
    """``Store`` in memory. Its clock is the wall clock moved by ``advance`` (the service's parts
    stamp deadlines from the wall clock, as they do against PostgreSQL)."""

    def __init__(self) -> None:
        self._t = _Tables()
        self._offset = 0.0
        self._generations = itertools.count(1)

    # -- what a test does by hand ----------------------------------------------------
    def now(self) -> float:
        return time.time() + self._offset

    def advance(self, seconds: float) -> None:
        """Move the store's clock on: deadlines, batch expiries and agents' silence come due."""
        self._offset += seconds

    def agent_seen(
        self, agent_id: str, *, site_id: str, role: str = "site", kinds: list[str] | None = None
    ) -> None:
        """An agent said hello or heartbeat now (``AGENT_UPSERT``, ``AGENT_HEARTBEAT``)."""
        self._t.agents[agent_id] = _Agent(site_id=site_id, role=role, kinds=kinds, last_seen=self.now())

    def lease(self, site_id: str, agent_id: str, *, ttl_s: float) -> None:
        """``agent_id`` holds its site's boot lease for ``ttl_s`` (``LEASE_RENEW``)."""
        self._t.leases[site_id] = (agent_id, self.now() + ttl_s)

    # -- the Store -------------------------------------------------------------------
    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[MemoryStore]:
        """All or nothing: an exception puts every table back as it was."""
        saved = copy.deepcopy(self._t)
        try:
            yield self
        except BaseException:
            self._t = saved
            raise

    def _cmd(self, command_id: str, agent_id: str | None = None) -> _Command | None:
        c = self._t.commands.get(command_id)
        if c is None or (agent_id is not None and c.agent_id != agent_id):
            return None
        return c

    def _touch(self, c: _Command, **changes: object) -> CommandRow:
        for name, value in changes.items():
            setattr(c, name, value)
        c.updated_at = self.now()
        return c.row()

    def _connected(self, agent_id: str | None, silent_after_ms: int) -> bool:
        a = self._t.agents.get(agent_id) if agent_id is not None else None
        return a is not None and a.last_seen > self.now() - silent_after_ms / 1000

    def _pick(self, site_id: str, kind: str | None, silent_after_ms: int) -> str | None:
        """``PICK_SITE_AGENT``: connected, implementing the kind, the boot-lease holder first."""
        now = self.now()
        holder, until = self._t.leases.get(site_id, (None, 0.0))
        found = [
            (agent_id == holder and until > now, a.last_seen, agent_id)
            for agent_id, a in self._t.agents.items()
            if a.site_id == site_id
            and a.role == "site"
            and a.last_seen > now - silent_after_ms / 1000
            and (kind is None or a.kinds is None or kind in a.kinds)
        ]
        return max(found)[2] if found else None

    def _batch_row(self, b: _Batch) -> BatchRow:
        n = b.new
        return BatchRow(
            id=n.id, tenant_id=n.tenant_id, kinds=list(n.kinds), nodes=list(n.nodes),
            workflow_id=n.workflow_id, workflow_ids=list(n.workflow_ids), note=n.note,
            idempotency_key=n.idempotency_key, document=n.document, threshold=n.threshold,
            created_at=b.created_at, expires_at=b.expires_at, expires_at_ms=n.expires_at_ms,
            approved_at=b.approved_at, expired=b.expires_at <= self.now(), closed_at=b.closed_at,
            closed_reason=b.closed_reason,
        )  # fmt: skip

    def _batch_of(self, c: _Command) -> _Batch | None:
        return self._t.batches.get(c.batch_id) if c.batch_id is not None else None

    # -- commands --------------------------------------------------------------------
    async def insert_command(self, new: NewCommand, *, silent_after_ms: int) -> CommandRow | None:
        """``COMMAND_INSERT``"""
        if any(c.node_id == new.node_id and c.key == new.key for c in self._t.commands.values()):
            return None
        now = self.now()
        pick = new.node_id if new.target == "node" else self._pick(new.site_id, new.kind, silent_after_ms)
        dispatched = new.may_dispatch and pick is not None
        target = cast(Literal["site", "node"], new.target)
        c = _Command(
            id=new.id, node_id=new.node_id, site_id=new.site_id, tenant_id=new.tenant_id, key=new.key,
            kind=new.kind, destructive=new.destructive, target=target, payload=new.payload,
            digest=new.digest, batch_id=new.batch_id, workflow_id=new.workflow_id, step=new.step,
            not_after=new.not_after_ms / 1000, created_at=now, updated_at=now,
            agent_id=pick if new.may_dispatch or new.target == "node" else None,
            state="dispatched" if dispatched else "pending", dispatched_at=now if dispatched else None,
        )  # fmt: skip
        self._t.commands[c.id] = c
        return c.row()

    async def command_by_id(self, command_id: str) -> CommandRow | None:
        """``COMMAND_BY_ID``"""
        c = self._cmd(command_id)
        return None if c is None else c.row()

    async def command_state(self, command_id: str) -> CommandStateRow | None:
        """``COMMAND_STATE``"""
        c = self._cmd(command_id)
        if c is None:
            return None
        return CommandStateRow(
            id=c.id, node_id=c.node_id, kind=c.kind, state=c.state, agent_id=c.agent_id,
            digest=c.digest, live=c.not_after > self.now(),
        )  # fmt: skip

    async def mark_published(self, command_id: str, agent_id: str, stream_seq: int) -> None:
        """``PUBLISHED``"""
        c = self._cmd(command_id, agent_id)
        if c is not None and c.state in ("dispatched", "acked"):
            c.published_at, c.publishes, c.stream_seq = self.now(), c.publishes + 1, stream_seq

    async def cancel(self, command_id: str, reason: str) -> list[CommandRow]:
        """``CANCEL_BY_ID``"""
        c = self._cmd(command_id)
        if c is None or c.state not in _LIVE:
            return []
        claimed = c.state in _CLAIMED
        return [
            self._touch(
                c,
                reason=reason,
                state="cancelling" if claimed else "cancelled",
                finished_at=None if claimed else self.now(),
            )
        ]

    # -- claims ----------------------------------------------------------------------
    async def journal_seen(self, agent_id: str, journal_id: str, *, present: bool) -> JournalRow:
        """``JOURNAL_SEEN``"""
        j = self._t.journals.get((agent_id, journal_id))
        if j is None:
            j = _Journal(generation=next(self._generations), last_seen=self.now(), present=present)
            self._t.journals[(agent_id, journal_id)] = j
        else:
            j.last_seen, j.present = self.now(), j.present or present
        return JournalRow(generation=j.generation, present=j.present)

    def _batch_admits(self, c: _Command, *, quorum: bool) -> bool:
        if not c.destructive:
            return True
        b = self._batch_of(c)
        if c.batch_id is None:
            return not quorum
        return b is not None and b.expires_at > self.now() and (not quorum or b.approved_at is not None)

    def _claimable(self, c: _Command, journal: str | None) -> bool:
        return c.state == "dispatched" or (
            c.state == "acked" and journal is not None and c.claim_journal == journal
        )

    async def ack(
        self,
        command_id: str,
        agent_id: str,
        digest: bytes,
        journal: str | None,
        signed_at_ms: int,
        *,
        quorum: bool,
    ) -> CommandRow | None:
        """``ACK``"""
        c = self._cmd(command_id, agent_id)
        if (
            c is None
            or c.not_after <= self.now()
            or c.digest != digest
            or not self._claimable(c, journal)
            or not self._batch_admits(c, quorum=quorum)
        ):
            return None
        signed = signed_at_ms if c.state == "dispatched" else c.claim_signed_ms
        acked_at = c.acked_at if c.acked_at is not None else self.now()
        return self._touch(c, state="acked", acked_at=acked_at, claim_journal=journal, claim_signed_ms=signed)

    async def claim_state(self, command_id: str) -> ClaimStateRow | None:
        """``CLAIM_STATE``"""
        c = self._cmd(command_id)
        if c is None:
            return None
        b = self._batch_of(c)
        return ClaimStateRow(
            id=c.id, state=c.state, kind=c.kind, payload=c.payload, agent_id=c.agent_id, digest=c.digest,
            live=c.not_after > self.now(), destructive=c.destructive, claim_journal=c.claim_journal,
            claim_signed_ms=c.claim_signed_ms, has_batch=b is not None,
            batch_expired=b is not None and b.expires_at <= self.now(),
            batch_approved=b is not None and b.approved_at is not None,
        )  # fmt: skip

    async def claim_interrupted(
        self,
        command_id: str,
        agent_id: str,
        journal: str | None,
        signed_at_ms: int,
        generation: int,
        present: bool,
    ) -> CommandRow | None:
        """``CLAIM_INTERRUPTED``"""
        c = self._cmd(command_id, agent_id)
        if c is None or c.state not in _CLAIMED or (journal is not None and c.claim_journal == journal):
            return None
        signed_before = (c.claim_signed_ms or 0) < signed_at_ms
        if journal is None:
            newer = signed_before
        else:
            claimed_by = self._t.journals.get((agent_id, c.claim_journal or ""))
            older_generation = (claimed_by.generation if claimed_by is not None else 0) < generation
            newer = older_generation and (present or signed_before)
        if not newer:
            return None
        return self._touch(c, state="failed", reason="interrupted", finished_at=self.now())

    async def claim_rerun(self, command_id: str, agent_id: str, journal: str) -> CommandRow | None:
        """``CLAIM_RERUN``"""
        c = self._cmd(command_id, agent_id)
        if c is None or c.state not in _CLAIMED or c.claim_journal != journal or c.not_after <= self.now():
            return None
        return self._touch(c)

    async def claim_back_to_pending(
        self, command_id: str, agent_id: str, journal: str | None
    ) -> CommandRow | None:
        """``CLAIM_BACK_TO_PENDING``"""
        c = self._cmd(command_id, agent_id)
        if c is None or not self._claimable(c, journal):
            return None
        return self._touch(
            c, state="pending", reason="batch-not-approved", published_at=None,
            agent_id=c.agent_id if c.target == "node" else None, claim_journal=None, claim_signed_ms=None,
        )  # fmt: skip

    async def claim_batch_expired(
        self, command_id: str, agent_id: str, journal: str | None
    ) -> CommandRow | None:
        """``CLAIM_BATCH_EXPIRED``"""
        c = self._cmd(command_id, agent_id)
        if c is None or not self._claimable(c, journal):
            return None
        return self._touch(c, state="expired", reason="batch-expired", finished_at=self.now())

    # -- runs ------------------------------------------------------------------------
    async def progress(self, command_id: str, agent_id: str, message: str | None) -> ProgressRow | None:
        """``PROGRESS``"""
        c = self._cmd(command_id, agent_id)
        if c is None or c.state not in ("acked", "running", "cancelling"):
            return None
        old = c.state
        row = self._touch(
            c,
            state="cancelling" if old == "cancelling" else "running",
            progress=message if message is not None else c.progress,
        )
        return ProgressRow(command=row, old_state=old)

    async def result(
        self,
        command_id: str,
        agent_id: str,
        *,
        status: str,
        reason: str | None,
        result: bytes,
        signature: bytes | None,
        attested: bool,
        journal: str,
    ) -> CommandRow | None:
        """``RESULT``: a cancelling command's result is its agent's word that it stopped it."""
        c = self._cmd(command_id, agent_id)
        if c is None or c.state not in ("acked", "running", "cancelling"):
            return None
        now = self.now()
        if c.state != "cancelling":
            return self._touch(
                c, state=cast(CommandState, status), reason=reason, result=result,
                result_signature=signature, attested=attested, finished_at=now,
            )  # fmt: skip
        confirmed = journal == "" or c.claim_journal is None or c.claim_journal == journal
        said = f"the agent stopped: {status}" + (f" ({reason})" if reason is not None else "")
        progress = ((c.progress + "; ") if c.progress is not None else "") + said
        return self._touch(
            c, state="cancelled" if confirmed else "failed",
            reason=c.reason if confirmed else "interrupted", progress=progress[:500], result=None,
            result_signature=None, attested=False, ended_at=now if confirmed else c.ended_at,
            finished_at=now,
        )  # fmt: skip

    async def late_end(self, command_id: str, agent_id: str) -> list[CommandRow]:
        """``LATE_END``"""
        c = self._cmd(command_id, agent_id)
        if c is None or c.acked_at is None or c.ended_at is not None:
            return []
        if not (c.state in ("cancelled", "expired") or (c.state == "failed" and c.reason == "interrupted")):
            return []
        return [self._touch(c, ended_at=self.now())]

    # -- the sweeper -----------------------------------------------------------------
    def _where(self, keep: Iterable[_Command], *, by: str = "created_at", limit: int = 500) -> list[_Command]:
        return sorted(keep, key=lambda c: (getattr(c, by) or 0.0, c.id))[:limit]

    async def expire_due(self, *, quorum: bool) -> list[CommandRow]:
        """``EXPIRE_DUE``"""
        now = self.now()
        due = self._where(
            (c for c in self._t.commands.values() if c.state in _LIVE and c.not_after <= now), by="not_after"
        )
        rows = []
        for c in due:
            if c.state == "pending":
                b = self._batch_of(c)
                unapproved = b is None or b.approved_at is None
                reason = "quorum-not-reached" if c.destructive and quorum and unapproved else "not-dispatched"
            else:
                reason = "not-claimed" if c.state == "dispatched" else "not-finished"
            rows.append(self._touch(c, state="expired", reason=reason, finished_at=now))
        return rows

    async def expire_batch_expired(self) -> list[CommandRow]:
        """``EXPIRE_BATCH_EXPIRED``"""
        now = self.now()
        due = []
        for c in self._t.commands.values():
            b = self._batch_of(c)
            if (
                c.state in ("pending", "dispatched")
                and c.destructive
                and b is not None
                and b.expires_at <= now
            ):
                due.append(c)
        return [self._touch(c, state="expired", reason="batch-expired", finished_at=now) for c in due[:500]]

    def _silent_for(self, c: _Command, ms: int) -> bool:
        a = self._t.agents.get(c.agent_id) if c.agent_id is not None else None
        return a is not None and a.last_seen < self.now() - ms / 1000

    async def reassign_silent(self, *, silent_after_ms: int) -> list[CommandRow]:
        """``REASSIGN_SILENT``"""
        due = [
            c
            for c in self._t.commands.values()
            if c.state == "dispatched"
            and c.target == "site"
            and not c.destructive
            and self._silent_for(c, silent_after_ms)
        ]
        return [
            self._touch(c, state="pending", agent_id=None, published_at=None, reason="agent-silent")
            for c in due[:500]
        ]

    async def fail_lost(self, *, lost_after_ms: int) -> list[CommandRow]:
        """``FAIL_LOST``"""
        cut = self.now() - lost_after_ms / 1000
        due = [
            c
            for c in self._t.commands.values()
            if c.state in ("acked", "running", "cancelling")
            and self._silent_for(c, lost_after_ms)
            and c.updated_at < cut
        ]
        return [
            self._touch(c, state="failed", reason="agent-lost", finished_at=self.now()) for c in due[:500]
        ]

    async def dispatch_pending(
        self,
        *,
        quorum: bool,
        site_id: str | None,
        batch_id: str | None,
        limit: int,
        silent_after_ms: int,
    ) -> list[CommandRow]:
        """``DISPATCH_PENDING``"""
        now = self.now()

        def may_go(c: _Command) -> bool:
            b = self._batch_of(c)
            approved = b is not None and b.approved_at is not None and b.expires_at > now
            has_agent = c.target == "node" or any(
                a.site_id == c.site_id and a.role == "site" and a.last_seen > now - silent_after_ms / 1000
                for a in self._t.agents.values()
            )
            return (
                c.state == "pending"
                and c.not_after > now
                and (not c.destructive or not quorum or approved)
                and (site_id is None or c.site_id == site_id)
                and (batch_id is None or c.batch_id == batch_id)
                and has_agent
            )

        rows = []
        for c in self._where(filter(may_go, self._t.commands.values()), limit=limit):
            agent = c.node_id if c.target == "node" else self._pick(c.site_id, c.kind, silent_after_ms)
            if agent is not None:
                rows.append(
                    self._touch(
                        c,
                        state="dispatched",
                        agent_id=agent,
                        dispatched_at=now,
                        published_at=None,
                        reason=None,
                    )
                )
        return rows

    async def republish_due(self, *, redeliver_after_ms: int, silent_after_ms: int) -> list[CommandRow]:
        """``REPUBLISH_DUE``"""
        now = self.now()

        def due(c: _Command) -> bool:
            if c.state != "dispatched":
                return False
            if c.published_at is None:
                return c.dispatched_at is not None and c.dispatched_at < now - 2.0
            stale = c.published_at < now - redeliver_after_ms / 1000
            return stale and self._connected(c.agent_id, silent_after_ms)

        return [
            c.row()
            for c in self._where(filter(due, self._t.commands.values()), by="dispatched_at", limit=200)
        ]

    async def purge_finished(self, *, retention_days: int) -> int:
        """``PURGE_FINISHED``"""
        cut = self.now() - retention_days * 86400
        gone = [c.id for c in self._t.commands.values() if c.state in TERMINAL_STATES and c.updated_at < cut]
        for ident in gone[:1000]:
            del self._t.commands[ident]
        return len(gone[:1000])

    # -- batches and approvals -------------------------------------------------------
    async def insert_batch(self, new: NewBatch) -> BatchRow | None:
        """``BATCH_INSERT``"""
        key = new.idempotency_key
        if key is not None and any(b.new.idempotency_key == key for b in self._t.batches.values()):
            return None
        b = _Batch(new=new, created_at=self.now())
        self._t.batches[new.id] = b
        return self._batch_row(b)

    async def batch_by_id(self, batch_id: str, *, lock: bool = False) -> BatchRow | None:
        """``BATCH_BY_ID`` (``BATCH_BY_ID_FOR_UPDATE``: one task at a time runs here anyway)"""
        b = self._t.batches.get(batch_id)
        return None if b is None else self._batch_row(b)

    async def batch_by_key(self, idempotency_key: str) -> BatchRow | None:
        """``BATCH_BY_KEY``"""
        found = [b for b in self._t.batches.values() if b.new.idempotency_key == idempotency_key]
        return self._batch_row(found[0]) if found else None

    async def batches_by_ids(self, ids: Sequence[str]) -> list[BatchRow]:
        """``BATCHES_BY_IDS``"""
        found = [self._t.batches[i] for i in set(ids) if i in self._t.batches]
        return [self._batch_row(b) for b in sorted(found, key=lambda b: b.new.id, reverse=True)]

    async def batch_sizes(
        self, *, workflow_id: str | None, state: str | None, before: str | None, limit: int
    ) -> list[BatchSizeRow]:
        """``BATCHES_LIST``"""
        now = self.now()

        def state_of(b: _Batch) -> str:
            if b.closed_at is not None:
                return "closed"
            if b.expires_at <= now:
                return "expired"
            return "approved" if b.approved_at is not None else "open"

        found = [
            b
            for b in self._t.batches.values()
            if (workflow_id is None or b.new.workflow_id == workflow_id)
            and (state is None or state_of(b) == state)
            and (before is None or b.new.id < before)
        ]
        found.sort(key=lambda b: b.new.id, reverse=True)
        return [BatchSizeRow(id=b.new.id, size=len(b.new.document)) for b in found[:limit]]

    async def unexpired_batch_ids(self) -> list[str]:
        """``BATCHES_UNEXPIRED``"""
        return [ident for ident, b in self._t.batches.items() if b.expires_at > self.now()]

    async def batches_expiry_due(self) -> list[BatchRow]:
        """``BATCHES_EXPIRY_DUE``"""
        due = [
            b
            for b in self._t.batches.values()
            if b.expiry_published_at is None and b.expires_at <= self.now() and b.closed_at is None
        ]
        return [self._batch_row(b) for b in sorted(due, key=lambda b: b.expires_at)[:100]]

    async def mark_expiry_published(self, ids: Sequence[str]) -> None:
        """``BATCHES_EXPIRY_PUBLISHED``"""
        for ident in ids:
            self._t.batches[ident].expiry_published_at = self.now()

    async def set_batch_approved(self, batch_id: str, approved: bool) -> None:
        """``BATCH_SET_APPROVED``"""
        b = self._t.batches.get(batch_id)
        if b is not None:
            b.approved_at = (b.approved_at or self.now()) if approved else None

    async def undispatch_batch(self, batch_id: str) -> list[CommandRow]:
        """``BATCH_UNDISPATCH``"""
        due = [
            c
            for c in self._t.commands.values()
            if c.batch_id == batch_id and c.state == "dispatched" and c.destructive
        ]
        return [
            self._touch(
                c,
                state="pending",
                reason="batch-not-approved",
                published_at=None,
                agent_id=c.agent_id if c.target == "node" else None,
            )
            for c in due
        ]

    async def close_batch(self, batch_id: str, reason: str | None) -> BatchRow | None:
        """``BATCH_CLOSE``: the first close's time and reason stay."""
        b = self._t.batches.get(batch_id)
        if b is None:
            return None
        if b.closed_at is None:
            b.closed_at = self.now()
        if b.closed_reason is None:
            b.closed_reason = reason
        return self._batch_row(b)

    async def reopen_batch(self, batch_id: str) -> BatchRow | None:
        """``BATCH_REOPEN``"""
        b = self._t.batches.get(batch_id)
        if b is None:
            return None
        b.closed_at = b.closed_reason = None
        return self._batch_row(b)

    async def insert_approval(self, batch_id: str, approver_id: str, signature: bytes) -> bool:
        """``APPROVAL_INSERT``"""
        if batch_id not in self._t.batches:
            raise KeyError(f"no batch {batch_id} (a foreign key in PostgreSQL)")
        if (batch_id, approver_id) in self._t.approvals:
            return False
        self._t.approvals[(batch_id, approver_id)] = ApprovalRow(
            batch_id=batch_id, approver_id=approver_id, signature=signature, created_at=self.now()
        )
        return True

    async def approvals_of(self, batch_ids: Sequence[str]) -> list[ApprovalRow]:
        """``APPROVALS_OF``, ``APPROVALS_OF_BATCHES``"""
        found = [a for (batch, _), a in self._t.approvals.items() if batch in set(batch_ids)]
        return sorted(found, key=lambda a: (a.batch_id, a.created_at, a.approver_id))
