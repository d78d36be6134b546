"""``MemoryStore``'s tables, clock and helpers, and its batches and approvals."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Literal, Self

from better_compute.wire.cmdq import CommandState

from ..rows import (
    ApprovalRow,
    BatchRow,
    BatchSizeRow,
    CommandRow,
)
from ..storage import NewBatch

__all__ = ["Tables"]

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
    claim_id: str | None = None
    version: int = 0

    def row(self) -> CommandRow:
        return CommandRow(
            id=self.id, node_id=self.node_id, site_id=self.site_id, tenant_id=self.tenant_id,
            key=self.key, kind=self.kind, destructive=self.destructive, target=self.target,
            payload=self.payload, agent_id=self.agent_id, state=self.state, reason=self.reason,
            progress=self.progress, batch_id=self.batch_id, workflow_id=self.workflow_id,
            step=self.step, result=self.result, attested=self.attested, created_at=self.created_at,
            updated_at=self.updated_at, not_after=self.not_after, dispatched_at=self.dispatched_at,
            publishes=self.publishes, version=self.version,
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
    tenant_id: str = "root"
    cert_id: str = "cert_x"
    incarnation: str | None = None
    version: str | None = None
    connected_at: float = 0.0
    last_signed_ms: int = 0
    status: str | None = None
    beat_gap_ms: int = 0

    def quiet(self, ms: int) -> float:
        """``store._QUIET``: seconds it may go unheard before the rule of ``ms`` counts it."""
        return max(ms, 3 * self.beat_gap_ms) / 1000


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
    fences: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    revoked: set[str] = dataclasses.field(default_factory=set)


class Tables:
    """The tables, the clock and what a test does by hand; batches and approvals."""

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
        self,
        agent_id: str,
        *,
        site_id: str,
        role: str = "site",
        kinds: list[str] | None = None,
        hello: bool = True,
    ) -> None:
        """An agent was heard from now, without a signed event (``agent_hello`` is the real one):
        a hello (a new connection, ``connected_at`` now) or, ``hello=False``, a heartbeat on the
        same connection."""
        now = self.now()
        a = self._t.agents.get(agent_id)
        if a is None:
            self._t.agents[agent_id] = _Agent(
                site_id=site_id, role=role, kinds=kinds, last_seen=now, connected_at=now
            )
        else:
            a.site_id, a.role, a.kinds, a.last_seen = site_id, role, kinds, now
            if hello:
                a.connected_at = now

    def lease(self, site_id: str, agent_id: str, *, ttl_s: float) -> None:
        """``agent_id`` holds its site's boot lease for ``ttl_s`` (``LEASE_RENEW``)."""
        self._t.leases[site_id] = (agent_id, self.now() + ttl_s)

    # -- the Store -------------------------------------------------------------------
    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Self]:
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
        if "state" in changes and changes["state"] != c.state:
            c.version += 1  # the trigger of migration 0013
        for name, value in changes.items():
            setattr(c, name, value)
        c.updated_at = self.now()
        return c.row()

    def _connected(self, agent_id: str | None, silent_after_ms: int) -> bool:
        a = self._t.agents.get(agent_id) if agent_id is not None else None
        return a is not None and a.last_seen > self.now() - a.quiet(silent_after_ms)

    def _pick(self, site_id: str, kind: str | None, silent_after_ms: int) -> str | None:
        """``PICK_SITE_AGENT``: connected, implementing the kind, the boot-lease holder first."""
        now = self.now()
        holder, until = self._t.leases.get(site_id, (None, 0.0))
        found = [
            (agent_id == holder and until > now, a.last_seen, agent_id)
            for agent_id, a in self._t.agents.items()
            if a.site_id == site_id
            and a.role == "site"
            and a.last_seen > now - a.quiet(silent_after_ms)
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
