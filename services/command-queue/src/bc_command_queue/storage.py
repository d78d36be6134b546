"""The command queue's store: named operations returning row Structs.

``Store`` is the seam between the service's state machines (claims, runs, batches and the
quorum, the sweeper's expiry and dispatch) and where their rows live. ``PgStore`` runs the named
statements of ``store`` on PostgreSQL, the truth in production; ``bc_command_queue.testing``
holds ``MemoryStore``, the same operations on dicts under an injected clock, for unit tests that
run in milliseconds. Each change is a compare-and-set: a method returns the row it changed, or
``None``/``[]`` when the row was not in a state it applies to (a duplicate or late event).

Agents' presence, boot leases and certificate revocations (``agents``) and the counts the
metrics read on scrape (``metrics``) are operations here too.

The protocol is the one place an operation is described (the stores' methods carry only their
signatures, and MemoryStore's the name of the statement each follows); mypy checks both stores
against it where they are defined (``_CHECKED``), not only where a test happens to pass one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol, TypeVar

import asyncpg
import msgspec

from . import store
from .rows import (
    AgentCountRow,
    AgentRow,
    AgentSeenRow,
    ApprovalRow,
    BatchFields,
    BatchRow,
    BatchSizeRow,
    Beat,
    ClaimedRow,
    ClaimStateRow,
    CommandRow,
    CommandStateRow,
    CutOffRow,
    JournalRow,
    LiveCountRow,
    ProgressRow,
    agent_row,
    approval_row,
    batch_row,
    command_row,
)

__all__ = [
    "AgentHello",
    "Claim",
    "ClaimAnswer",
    "NewBatch",
    "NewCommand",
    "PgStore",
    "Published",
    "Report",
    "Said",
    "Store",
    "row_may_be_at_fault",
]


class NewCommand(msgspec.Struct, frozen=True, kw_only=True):
    """A command to insert. ``may_dispatch``: it may go out at once (a site command to a
    connected agent picked for its site and kind; a node command always has its node)."""

    id: str
    node_id: str
    site_id: str
    tenant_id: str
    key: str
    kind: str
    destructive: bool
    target: str
    payload: str
    digest: bytes
    batch_id: str | None
    workflow_id: str | None
    step: int | None
    not_after_ms: int
    may_dispatch: bool


class NewBatch(BatchFields, frozen=True, kw_only=True):
    expires_at_ms: int


class AgentHello(msgspec.Struct, frozen=True, kw_only=True):
    """An agent's signed hello, as its certificate says who it is. ``status``: the agent's word
    about itself as JSON text, already bounded."""

    agent_id: str
    site_id: str
    tenant_id: str
    role: str
    cert_id: str
    incarnation: str
    version: str
    kinds: list[str] | None
    signed_at_ms: int
    status: str | None
    gap_ms: int = 0
    """The gap it announced until its next heartbeat, as kept (``CmdqConfig.silence_gap_ms``)."""


class Claim(msgspec.Struct, frozen=True, kw_only=True):
    """An agent's claim of a command (``ACK``'s parameters), one of a group."""

    command_id: str
    agent_id: str
    digest: bytes
    journal: str | None
    signed_at_ms: int
    quorum: bool
    claim_id: str | None = None
    """The id of the claim's handling at its agent (``Ack.claim_id``; None: it named none)."""


class ClaimAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """A claim of a group: the command when it was taken, and its journal as ``journal_seen``
    (not present) left it (``None``: the claim named no journal)."""

    row: CommandRow | None
    journal: JournalRow | None


class Said(msgspec.Struct, frozen=True, kw_only=True):
    """An agent's progress of a command (``PROGRESS``'s parameters), one of a group."""

    command_id: str
    agent_id: str
    message: str | None


class Report(msgspec.Struct, frozen=True, kw_only=True):
    """An agent's result of a command (``RESULT``'s parameters), one of a group."""

    command_id: str
    agent_id: str
    status: str
    reason: str | None
    result: bytes
    signature: bytes | None
    attested: bool
    journal: str


class Published(msgspec.Struct, frozen=True, kw_only=True):
    """A delivery on its site's stream (``PUBLISHED``'s parameters), one of a group."""

    command_id: str
    agent_id: str
    stream_seq: int


def row_may_be_at_fault(exc: Exception) -> bool:
    """Whether a group's statement may have failed over one of its rows (a value PostgreSQL
    refuses: ``GroupCommit`` then tries each row alone), rather than for want of the database
    (each row alone would wait out the same outage)."""
    outage = (
        OSError,
        TimeoutError,
        asyncpg.PostgresConnectionError,
        asyncpg.exceptions.OperatorInterventionError,
    )
    if isinstance(exc, outage):
        return False
    # asyncpg's own errors are about the connection, but for a parameter it cannot encode
    return not isinstance(exc, asyncpg.InterfaceError) or isinstance(exc, ValueError)


class Store(Protocol):
    """Every operation of the command queue's state machines on its rows."""

    def transaction(self) -> AbstractAsyncContextManager[Store]:
        """The same operations in one transaction (rows read with ``lock=True`` stay held)."""
        ...

    # -- commands --------------------------------------------------------------------
    async def insert_command(self, new: NewCommand, *, silent_after_ms: int) -> CommandRow | None:
        """Insert, dispatched at once when it may go; ``None`` when (node, key) exists."""
        ...

    async def insert_many(
        self, news: Sequence[NewCommand], *, silent_after_ms: int
    ) -> list[CommandRow | None]:
        """``insert_command`` of each (a (node, key) once a group), in one statement."""
        ...

    async def command_by_id(self, command_id: str) -> CommandRow | None: ...

    async def command_state(self, command_id: str) -> CommandStateRow | None: ...

    async def mark_published(self, command_id: str, agent_id: str, stream_seq: int) -> None:
        """A delivery is on the stream: record it (counts the publications)."""
        ...

    async def mark_published_many(self, marks: Sequence[Published]) -> None:
        """``mark_published`` of each (one command once a group), in one statement."""
        ...

    async def cancel(self, command_id: str, reason: str) -> list[CommandRow]:
        """Cancel a live command: ``cancelling`` when its agent claimed it (until the agent says
        it stopped), else ``cancelled``."""
        ...

    async def command_by_key(self, node_id: str, key: str) -> CommandRow | None: ...

    async def command_states(self, ids: Sequence[str]) -> dict[str, str]: ...

    async def list_commands(
        self,
        *,
        node_id: str | None,
        workflow_id: str | None,
        state: str | None,
        kind: str | None,
        site_id: str | None,
        agent_id: str | None,
        batch_id: str | None,
        before: str | None,
        limit: int,
    ) -> list[CommandRow]:
        """Newest first; ``before``: ids below it."""
        ...

    async def cancel_under(
        self, prefix: str, *, node_id: str | None, workflow_id: str | None, reason: str
    ) -> list[CommandRow]:
        """Cancel every live command whose key is ``prefix`` or goes on with ``:`` or ``#``."""
        ...

    async def claimed_under(
        self, prefix: str, *, node_id: str | None, workflow_id: str | None, lost_after_ms: int
    ) -> list[ClaimedRow]:
        """Claimed commands under ``prefix`` that may still run where they were claimed."""
        ...

    async def fence(self, prefix: str, workflow_id: str, reason: str) -> None:
        """From now on, commands under ``prefix`` are refused (a superseded step attempt)."""
        ...

    async def fenced(self, key: str) -> bool: ...

    async def cancel_superseded(self, command_id: str) -> list[CommandRow]: ...

    async def live_under(self, agent_id: str, prefix: str, node_id: str | None) -> list[tuple[str, str]]:
        """(id, payload) of the agent's live, unexpired commands under ``prefix``."""
        ...

    # -- claims ----------------------------------------------------------------------
    async def journal_seen(self, agent_id: str, journal_id: str, *, present: bool) -> JournalRow: ...

    async def ack(
        self,
        command_id: str,
        agent_id: str,
        digest: bytes,
        journal: str | None,
        signed_at_ms: int,
        *,
        quorum: bool,
        claim_id: str | None = None,
    ) -> CommandRow | None:
        """Take a claim (see ``store.ACK``)."""
        ...

    async def claim_many(self, claims: Sequence[Claim]) -> list[ClaimAnswer]:
        """``journal_seen`` (not present) of each named journal, then ``ack`` of each claim (one
        command once a group), in one statement; an answer per claim, in order."""
        ...

    async def claim_state(self, command_id: str) -> ClaimStateRow | None: ...

    async def claim_interrupted(
        self,
        command_id: str,
        agent_id: str,
        journal: str | None,
        signed_at_ms: int,
        generation: int,
        present: bool,
    ) -> CommandRow | None:
        """Another journal claims a command that may have started: failed, interrupted."""
        ...

    async def claim_rerun(self, command_id: str, agent_id: str, journal: str) -> CommandRow | None: ...

    async def claim_back_to_pending(
        self, command_id: str, agent_id: str, journal: str | None, claim_id: str | None = None
    ) -> CommandRow | None: ...

    async def claim_batch_expired(
        self, command_id: str, agent_id: str, journal: str | None, claim_id: str | None = None
    ) -> CommandRow | None: ...

    # -- runs ------------------------------------------------------------------------
    async def progress(self, command_id: str, agent_id: str, message: str | None) -> ProgressRow | None: ...

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
        """Settle a claimed command (see ``store.RESULT``)."""
        ...

    async def progress_many(self, said: Sequence[Said]) -> list[ProgressRow | None]:
        """``progress`` of each (one command once a group), in one statement; in order."""
        ...

    async def result_many(self, reports: Sequence[Report]) -> list[CommandRow | None]:
        """``result`` of each (one command once a group), in one statement; in order."""
        ...

    async def late_end(self, command_id: str, agent_id: str) -> list[CommandRow]: ...

    # -- the sweeper -----------------------------------------------------------------
    async def expire_due(self, *, quorum: bool) -> list[CommandRow]: ...

    async def expire_batch_expired(self) -> list[CommandRow]: ...

    async def reassign_silent(self, *, silent_after_ms: int) -> list[CommandRow]: ...

    async def fail_lost(self, *, lost_after_ms: int, silent_after_ms: int) -> list[CommandRow]:
        """Claimed commands of an agent silent ``lost_after_ms`` while its site was heard."""
        ...

    async def dispatch_pending(
        self,
        *,
        quorum: bool,
        site_id: str | None,
        batch_id: str | None,
        limit: int,
        silent_after_ms: int,
    ) -> list[CommandRow]: ...

    async def republish_due(self, *, redeliver_after_ms: int, silent_after_ms: int) -> list[CommandRow]: ...

    async def purge_finished(self, *, retention_days: int) -> int: ...

    # -- batches and approvals -------------------------------------------------------
    async def insert_batch(self, new: NewBatch) -> BatchRow | None:
        """``None`` when its idempotency key is taken."""
        ...

    async def batch_by_id(self, batch_id: str, *, lock: bool = False) -> BatchRow | None: ...

    async def batch_by_key(self, idempotency_key: str) -> BatchRow | None: ...

    async def batches_by_ids(self, ids: Sequence[str]) -> list[BatchRow]: ...

    async def batch_sizes(
        self, *, workflow_id: str | None, state: str | None, before: str | None, limit: int
    ) -> list[BatchSizeRow]: ...

    async def unexpired_batch_ids(self) -> list[str]: ...

    async def batches_expiry_due(self) -> list[BatchRow]:
        """Expired batches whose expiry is not published yet (held until the transaction ends)."""
        ...

    async def mark_expiry_published(self, ids: Sequence[str]) -> None: ...

    async def set_batch_approved(self, batch_id: str, approved: bool) -> None: ...

    async def undispatch_batch(self, batch_id: str) -> list[CommandRow]: ...

    async def close_batch(self, batch_id: str, reason: str | None) -> BatchRow | None: ...

    async def reopen_batch(self, batch_id: str) -> BatchRow | None: ...

    async def insert_approval(self, batch_id: str, approver_id: str, signature: bytes) -> bool:
        """True when new (an approver approves a batch once)."""
        ...

    async def approvals_of(self, batch_ids: Sequence[str]) -> list[ApprovalRow]: ...

    # -- agents: presence, boot leases, revocations -------------------------------------------
    async def agent_hello(self, hello: AgentHello) -> bool:
        """Record an agent's hello (``AGENT_UPSERT``); False when an older or equal signed event
        was applied already, or its certificate is revoked."""
        ...

    async def agent_heartbeat(
        self, agent_id: str, signed_at_ms: int, cert_id: str, status: str | None, *, silent_after_ms: int
    ) -> AgentSeenRow | None:
        """Seen now; ``None`` when the agent is unknown, the event older than one applied or its
        certificate revoked. A heartbeat after a silence of ``silent_after_ms`` starts a new
        connection (``connected_at``), as a hello does."""
        ...

    async def agent_leave(
        self, agent_id: str, signed_at_ms: int, *, silent_after_ms: int
    ) -> AgentSeenRow | None:
        """The agent says it is going: shown disconnected at once."""
        ...

    async def agents_heard(self, beats: Sequence[Beat], *, silent_after_ms: int) -> list[str]:
        """Heartbeats held in memory, written at once (``AGENTS_HEARD``): each applied as
        ``agent_heartbeat`` and ``journal_seen`` (present) would have applied it ``age_ms`` ago.
        Returns the agents applied (not: unknown, an older event, a revoked certificate)."""
        ...

    async def all_cancelling(self) -> dict[str, list[str]]:
        """Every agent's claimed commands cancelled since, by agent (at most 256 each)."""
        ...

    async def agent_by_id(self, agent_id: str) -> AgentSeenRow | None: ...

    async def renew_lease(self, site_id: str, agent_id: str, *, ttl_ms: int) -> bool:
        """Take or keep the site's boot lease; False when another agent holds it (or this one's
        certificate is revoked)."""
        ...

    async def release_lease(self, site_id: str, agent_id: str) -> None: ...

    async def cut_off(self, cert_id: str, *, silent_after_ms: int) -> CutOffRow:
        """A revoked certificate (in one transaction): remembered, its agents shown disconnected,
        their boot leases gone, their unclaimed site commands back to pending."""
        ...

    async def must_stop(self, command_ids: Sequence[str], agent_id: str) -> list[str]:
        """Of these, the commands the agent does not hold a live claim on (any more)."""
        ...

    async def cancelling(self, agent_id: str) -> list[str]:
        """The agent's claimed commands cancelled since (at most 256)."""
        ...

    async def agent_commands_to_republish(self, agent_id: str) -> list[CommandRow]:
        """Dispatched or acked commands of the agent, oldest dispatch first."""
        ...

    async def list_agents(
        self,
        *,
        site_id: str | None,
        role: str | None,
        connected: bool | None,
        silent_after_ms: int,
        limit: int,
        after: tuple[str, str] | None,
    ) -> list[AgentRow]:
        """By (site, id); ``after``: the (site, id) the page goes on after."""
        ...

    async def site_of_node(self, node_id: str) -> str | None:
        """Its own agent's site, else its latest command's."""
        ...

    async def pick_site_agent(self, site_id: str, *, silent_after_ms: int, kind: str | None) -> str | None:
        """A connected site agent of the site (implementing ``kind``), the boot-lease holder first."""
        ...

    # -- metrics ---------------------------------------------------------------------
    async def live_counts(self) -> list[LiveCountRow]: ...

    async def agents_connected(self, *, silent_after_ms: int) -> list[AgentCountRow]: ...

    async def batches_waiting(self) -> int:
        """Batches neither approved, closed nor expired."""
        ...


class PgStore:
    """``Store`` on PostgreSQL: a ``Database`` (its pool) or, inside a transaction, one connection."""

    def __init__(self, db: Any) -> None:
        self.db = db

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[PgStore]:
        if hasattr(self.db, "pool"):
            async with self.db.transaction() as conn:
                yield PgStore(conn)
        else:
            async with self.db.transaction():
                yield self

    async def _row(self, sql: str, *args: Any) -> CommandRow | None:
        record = await self.db.fetchrow(sql, *args)
        return None if record is None else command_row(record)

    async def _rows(self, sql: str, *args: Any) -> list[CommandRow]:
        return [command_row(r) for r in await self.db.fetch(sql, *args)]

    async def _batch(self, sql: str, *args: Any) -> BatchRow | None:
        record = await self.db.fetchrow(sql, *args)
        return None if record is None else batch_row(record)

    # -- commands --------------------------------------------------------------------
    async def insert_command(self, new: NewCommand, *, silent_after_ms: int) -> CommandRow | None:
        return await self._row(
            store.COMMAND_INSERT, new.id, new.node_id, new.site_id, new.tenant_id, new.key, new.kind,
            new.destructive, new.target, new.payload, new.digest, new.batch_id, new.workflow_id,
            new.step, new.not_after_ms, new.may_dispatch, silent_after_ms,
        )  # fmt: skip

    async def insert_many(
        self, news: Sequence[NewCommand], *, silent_after_ms: int
    ) -> list[CommandRow | None]:
        if len(news) == 1:
            return [await self.insert_command(news[0], silent_after_ms=silent_after_ms)]
        records = await self.db.fetch(
            store.COMMAND_INSERT_MANY,
            [n.id for n in news], [n.node_id for n in news], [n.site_id for n in news],
            [n.tenant_id for n in news], [n.key for n in news], [n.kind for n in news],
            [n.destructive for n in news], [n.target for n in news], [n.payload for n in news],
            [n.digest for n in news], [n.batch_id for n in news], [n.workflow_id for n in news],
            [n.step for n in news], [n.not_after_ms for n in news], [n.may_dispatch for n in news],
            silent_after_ms,
        )  # fmt: skip
        return [command_row(r) if r["id"] is not None else None for r in records]

    async def command_by_id(self, command_id: str) -> CommandRow | None:
        return await self._row(store.COMMAND_BY_ID, command_id)

    async def command_state(self, command_id: str) -> CommandStateRow | None:
        r = await self.db.fetchrow(store.COMMAND_STATE, command_id)
        if r is None:
            return None
        return CommandStateRow(
            id=r["id"], node_id=r["node_id"], kind=r["kind"], state=r["state"], agent_id=r["agent_id"],
            digest=bytes(r["digest"]), live=r["live"],
        )  # fmt: skip

    async def mark_published(self, command_id: str, agent_id: str, stream_seq: int) -> None:
        await self.db.execute(store.PUBLISHED, command_id, agent_id, stream_seq)

    # A group of one goes as the one-row statement: the same round trip and commit, and a plainer
    # statement than one over arrays (PostgreSQL's CPU per command unloaded, bench/README.md).

    async def mark_published_many(self, marks: Sequence[Published]) -> None:
        if len(marks) == 1:
            await self.mark_published(marks[0].command_id, marks[0].agent_id, marks[0].stream_seq)
            return
        await self.db.execute(
            store.PUBLISHED_MANY,
            [m.command_id for m in marks],
            [m.agent_id for m in marks],
            [m.stream_seq for m in marks],
        )

    async def cancel(self, command_id: str, reason: str) -> list[CommandRow]:
        return await self._rows(store.CANCEL_BY_ID, command_id, reason)

    async def command_by_key(self, node_id: str, key: str) -> CommandRow | None:
        return await self._row(store.COMMAND_BY_NODE_KEY, node_id, key)

    async def command_states(self, ids: Sequence[str]) -> dict[str, str]:
        return {r["id"]: r["state"] for r in await self.db.fetch(store.COMMAND_STATES, list(ids))}

    async def list_commands(
        self,
        *,
        node_id: str | None,
        workflow_id: str | None,
        state: str | None,
        kind: str | None,
        site_id: str | None,
        agent_id: str | None,
        batch_id: str | None,
        before: str | None,
        limit: int,
    ) -> list[CommandRow]:
        return await self._rows(
            store.LIST_COMMANDS, node_id, workflow_id, state, kind, site_id, agent_id, batch_id, before, limit
        )

    async def cancel_under(
        self, prefix: str, *, node_id: str | None, workflow_id: str | None, reason: str
    ) -> list[CommandRow]:
        return await self._rows(store.CANCEL_BY_PREFIX, node_id, prefix, reason, workflow_id)

    async def claimed_under(
        self, prefix: str, *, node_id: str | None, workflow_id: str | None, lost_after_ms: int
    ) -> list[ClaimedRow]:
        rows = await self.db.fetch(store.CLAIMED_UNDER_PREFIX, node_id, prefix, lost_after_ms, workflow_id)
        return [
            ClaimedRow(id=r["id"], agent_id=r["agent_id"], claim_journal=r["claim_journal"]) for r in rows
        ]

    async def fence(self, prefix: str, workflow_id: str, reason: str) -> None:
        await self.db.execute(store.KEY_FENCE_INSERT, prefix, workflow_id, reason)

    async def fenced(self, key: str) -> bool:
        return bool(await self.db.fetchval(store.KEY_FENCED, key))

    async def cancel_superseded(self, command_id: str) -> list[CommandRow]:
        return await self._rows(store.CANCEL_SUPERSEDED, command_id)

    async def live_under(self, agent_id: str, prefix: str, node_id: str | None) -> list[tuple[str, str]]:
        rows = await self.db.fetch(store.LIVE_WITH_PREFIX, agent_id, prefix, node_id)
        return [(r["id"], r["payload"]) for r in rows]

    # -- claims ----------------------------------------------------------------------
    async def journal_seen(self, agent_id: str, journal_id: str, *, present: bool) -> JournalRow:
        r = await self.db.fetchrow(store.JOURNAL_SEEN, agent_id, journal_id, present)
        return JournalRow(generation=int(r["generation"]), present=bool(r["present"]))

    async def ack(
        self,
        command_id: str,
        agent_id: str,
        digest: bytes,
        journal: str | None,
        signed_at_ms: int,
        *,
        quorum: bool,
        claim_id: str | None = None,
    ) -> CommandRow | None:
        return await self._row(
            store.ACK, command_id, agent_id, digest, journal, signed_at_ms, quorum, claim_id
        )

    async def claim_many(self, claims: Sequence[Claim]) -> list[ClaimAnswer]:
        records = await self.db.fetch(
            store.CLAIM_MANY,
            [c.command_id for c in claims],
            [c.agent_id for c in claims],
            [c.digest for c in claims],
            [c.journal for c in claims],
            [c.signed_at_ms for c in claims],
            [c.quorum for c in claims],
            [c.claim_id for c in claims],
        )
        return [
            ClaimAnswer(
                row=command_row(r) if r["id"] is not None else None,
                journal=None
                if r["journal_generation"] is None
                else JournalRow(generation=int(r["journal_generation"]), present=bool(r["journal_present"])),
            )
            for r in records
        ]

    async def claim_state(self, command_id: str) -> ClaimStateRow | None:
        r = await self.db.fetchrow(store.CLAIM_STATE, command_id)
        if r is None:
            return None
        return ClaimStateRow(
            id=r["id"], state=r["state"], kind=r["kind"], payload=r["payload"], agent_id=r["agent_id"],
            digest=bytes(r["digest"]), live=r["live"], destructive=r["destructive"],
            claim_journal=r["claim_journal"], claim_signed_ms=r["claim_signed_ms"], claim_id=r["claim_id"],
            has_batch=r["has_batch"], batch_expired=r["batch_expired"], batch_approved=r["batch_approved"],
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
        return await self._row(
            store.CLAIM_INTERRUPTED, command_id, agent_id, journal, signed_at_ms, generation, present
        )

    async def claim_rerun(self, command_id: str, agent_id: str, journal: str) -> CommandRow | None:
        return await self._row(store.CLAIM_RERUN, command_id, agent_id, journal)

    async def claim_back_to_pending(
        self, command_id: str, agent_id: str, journal: str | None, claim_id: str | None = None
    ) -> CommandRow | None:
        return await self._row(store.CLAIM_BACK_TO_PENDING, command_id, agent_id, journal, claim_id)

    async def claim_batch_expired(
        self, command_id: str, agent_id: str, journal: str | None, claim_id: str | None = None
    ) -> CommandRow | None:
        return await self._row(store.CLAIM_BATCH_EXPIRED, command_id, agent_id, journal, claim_id)

    # -- runs ------------------------------------------------------------------------
    async def progress(self, command_id: str, agent_id: str, message: str | None) -> ProgressRow | None:
        r = await self.db.fetchrow(store.PROGRESS, command_id, agent_id, message)
        return None if r is None else _progress_row(r)

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
        return await self._row(
            store.RESULT, command_id, agent_id, status, reason, result, signature, attested, journal
        )

    async def progress_many(self, said: Sequence[Said]) -> list[ProgressRow | None]:
        if len(said) == 1:
            return [await self.progress(said[0].command_id, said[0].agent_id, said[0].message)]
        records = await self.db.fetch(
            store.PROGRESS_MANY,
            [p.command_id for p in said],
            [p.agent_id for p in said],
            [p.message for p in said],
        )
        return _by_place(records, "said_n", len(said), _progress_row)

    async def result_many(self, reports: Sequence[Report]) -> list[CommandRow | None]:
        if len(reports) == 1:
            r = reports[0]
            row = await self.result(
                r.command_id, r.agent_id, status=r.status, reason=r.reason, result=r.result,
                signature=r.signature, attested=r.attested, journal=r.journal,
            )  # fmt: skip
            return [row]
        rs = reports
        records = await self.db.fetch(
            store.RESULT_MANY,
            [r.command_id for r in rs], [r.agent_id for r in rs], [r.status for r in rs],
            [r.reason for r in rs], [r.result for r in rs], [r.signature for r in rs],
            [r.attested for r in rs], [r.journal for r in rs],
        )  # fmt: skip
        return _by_place(records, "report_n", len(reports), command_row)

    async def late_end(self, command_id: str, agent_id: str) -> list[CommandRow]:
        return await self._rows(store.LATE_END, command_id, agent_id)

    # -- the sweeper -----------------------------------------------------------------
    async def expire_due(self, *, quorum: bool) -> list[CommandRow]:
        return await self._rows(store.EXPIRE_DUE, quorum)

    async def expire_batch_expired(self) -> list[CommandRow]:
        return await self._rows(store.EXPIRE_BATCH_EXPIRED)

    async def reassign_silent(self, *, silent_after_ms: int) -> list[CommandRow]:
        return await self._rows(store.REASSIGN_SILENT, silent_after_ms)

    async def fail_lost(self, *, lost_after_ms: int, silent_after_ms: int) -> list[CommandRow]:
        return await self._rows(store.FAIL_LOST, lost_after_ms, silent_after_ms)

    async def dispatch_pending(
        self,
        *,
        quorum: bool,
        site_id: str | None,
        batch_id: str | None,
        limit: int,
        silent_after_ms: int,
    ) -> list[CommandRow]:
        return await self._rows(store.DISPATCH_PENDING, quorum, site_id, batch_id, limit, silent_after_ms)

    async def republish_due(self, *, redeliver_after_ms: int, silent_after_ms: int) -> list[CommandRow]:
        return await self._rows(store.REPUBLISH_DUE, redeliver_after_ms, silent_after_ms)

    async def purge_finished(self, *, retention_days: int) -> int:
        return int(await self.db.fetchval(store.PURGE_FINISHED, retention_days))

    # -- batches and approvals -------------------------------------------------------
    async def insert_batch(self, new: NewBatch) -> BatchRow | None:
        return await self._batch(
            store.BATCH_INSERT, new.id, new.tenant_id, new.kinds, new.nodes, new.workflow_id, new.note,
            new.idempotency_key, new.document, new.threshold, new.expires_at_ms, new.workflow_ids,
        )  # fmt: skip

    async def batch_by_id(self, batch_id: str, *, lock: bool = False) -> BatchRow | None:
        return await self._batch(store.BATCH_BY_ID_FOR_UPDATE if lock else store.BATCH_BY_ID, batch_id)

    async def batch_by_key(self, idempotency_key: str) -> BatchRow | None:
        return await self._batch(store.BATCH_BY_KEY, idempotency_key)

    async def batches_by_ids(self, ids: Sequence[str]) -> list[BatchRow]:
        return [batch_row(r) for r in await self.db.fetch(store.BATCHES_BY_IDS, list(ids))]

    async def batch_sizes(
        self, *, workflow_id: str | None, state: str | None, before: str | None, limit: int
    ) -> list[BatchSizeRow]:
        rows = await self.db.fetch(store.BATCHES_LIST, workflow_id, state, before, limit)
        return [BatchSizeRow(id=r["id"], size=int(r["size"])) for r in rows]

    async def unexpired_batch_ids(self) -> list[str]:
        return [r["id"] for r in await self.db.fetch(store.BATCHES_UNEXPIRED)]

    async def batches_expiry_due(self) -> list[BatchRow]:
        return [batch_row(r) for r in await self.db.fetch(store.BATCHES_EXPIRY_DUE)]

    async def mark_expiry_published(self, ids: Sequence[str]) -> None:
        await self.db.execute(store.BATCHES_EXPIRY_PUBLISHED, list(ids))

    async def set_batch_approved(self, batch_id: str, approved: bool) -> None:
        await self.db.execute(store.BATCH_SET_APPROVED, batch_id, approved)

    async def undispatch_batch(self, batch_id: str) -> list[CommandRow]:
        return await self._rows(store.BATCH_UNDISPATCH, batch_id)

    async def close_batch(self, batch_id: str, reason: str | None) -> BatchRow | None:
        return await self._batch(store.BATCH_CLOSE, batch_id, reason)

    async def reopen_batch(self, batch_id: str) -> BatchRow | None:
        return await self._batch(store.BATCH_REOPEN, batch_id)

    async def insert_approval(self, batch_id: str, approver_id: str, signature: bytes) -> bool:
        return await self.db.fetchval(store.APPROVAL_INSERT, batch_id, approver_id, signature) is not None

    async def approvals_of(self, batch_ids: Sequence[str]) -> list[ApprovalRow]:
        if len(batch_ids) == 1:
            records = await self.db.fetch(store.APPROVALS_OF, batch_ids[0])
            return [approval_row(r, batch_ids[0]) for r in records]
        return [approval_row(r) for r in await self.db.fetch(store.APPROVALS_OF_BATCHES, list(batch_ids))]

    # -- agents: presence, boot leases, revocations -------------------------------------------
    async def agent_hello(self, hello: AgentHello) -> bool:
        h = hello
        applied = await self.db.fetchval(
            store.AGENT_UPSERT, h.agent_id, h.site_id, h.tenant_id, h.role, h.cert_id, h.incarnation,
            h.version, h.kinds, h.signed_at_ms, h.status, h.gap_ms,
        )  # fmt: skip
        return applied is not None

    async def _seen(self, sql: str, agent_id: str, *args: Any) -> AgentSeenRow | None:
        record = await self.db.fetchrow(sql, agent_id, *args)
        return (
            None
            if record is None
            else AgentSeenRow(id=agent_id, site_id=record["site_id"], role=record["role"])
        )

    async def agent_heartbeat(
        self, agent_id: str, signed_at_ms: int, cert_id: str, status: str | None, *, silent_after_ms: int
    ) -> AgentSeenRow | None:
        return await self._seen(
            store.AGENT_HEARTBEAT, agent_id, signed_at_ms, cert_id, status, silent_after_ms
        )

    async def agent_leave(
        self, agent_id: str, signed_at_ms: int, *, silent_after_ms: int
    ) -> AgentSeenRow | None:
        return await self._seen(store.AGENT_LEAVE, agent_id, signed_at_ms, silent_after_ms)

    async def agent_by_id(self, agent_id: str) -> AgentSeenRow | None:
        return await self._seen(store.AGENT_AGAIN, agent_id)

    async def agents_heard(self, beats: Sequence[Beat], *, silent_after_ms: int) -> list[str]:
        if not beats:
            return []
        records = await self.db.fetch(
            store.AGENTS_HEARD,
            [b.agent_id for b in beats],
            [b.signed_at_ms for b in beats],
            [b.cert_id for b in beats],
            [b.status for b in beats],
            [b.journal_id for b in beats],
            [b.age_ms for b in beats],
            silent_after_ms,
            [b.gap_ms for b in beats],
        )
        return [r["id"] for r in records]

    async def all_cancelling(self) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for r in await self.db.fetch(store.ALL_CANCELLING):
            ids = found.setdefault(r["agent_id"], [])
            if len(ids) < 256:
                ids.append(r["id"])
        return found

    async def renew_lease(self, site_id: str, agent_id: str, *, ttl_ms: int) -> bool:
        return bool(await self.db.fetchval(store.LEASE_RENEW, site_id, agent_id, ttl_ms) == agent_id)

    async def release_lease(self, site_id: str, agent_id: str) -> None:
        await self.db.execute(store.LEASE_RELEASE, site_id, agent_id)

    async def cut_off(self, cert_id: str, *, silent_after_ms: int) -> CutOffRow:
        async with self.transaction() as tx:
            db = tx.db
            await db.execute(store.CERT_REVOKED_MARK, cert_id)
            cut = await db.fetch(store.CERT_REVOKED_CUT_OFF, cert_id, silent_after_ms)
            await db.execute(store.CERT_REVOKED_LEASES, cert_id)
            back = await tx._rows(store.CERT_REVOKED_REASSIGN, cert_id)
        agents = [AgentSeenRow(id=r["id"], site_id=r["site_id"], role=r["role"]) for r in cut]
        return CutOffRow(agents=agents, reassigned=back)

    async def must_stop(self, command_ids: Sequence[str], agent_id: str) -> list[str]:
        return [r["id"] for r in await self.db.fetch(store.MUST_STOP, list(command_ids), agent_id)]

    async def cancelling(self, agent_id: str) -> list[str]:
        return [r["id"] for r in await self.db.fetch(store.AGENT_CANCELLING, agent_id)]

    async def agent_commands_to_republish(self, agent_id: str) -> list[CommandRow]:
        return await self._rows(store.AGENT_COMMANDS_TO_REPUBLISH, agent_id)

    async def list_agents(
        self,
        *,
        site_id: str | None,
        role: str | None,
        connected: bool | None,
        silent_after_ms: int,
        limit: int,
        after: tuple[str, str] | None,
    ) -> list[AgentRow]:
        site, ident = after or (None, None)
        records = await self.db.fetch(
            store.AGENTS_LIST, site_id, role, connected, silent_after_ms, limit, site, ident
        )
        return [agent_row(r) for r in records]

    async def site_of_node(self, node_id: str) -> str | None:
        site: str | None = await self.db.fetchval(store.SITE_OF_NODE, node_id)
        return site

    async def pick_site_agent(self, site_id: str, *, silent_after_ms: int, kind: str | None) -> str | None:
        agent: str | None = await self.db.fetchval(store.PICK_SITE_AGENT, site_id, silent_after_ms, kind)
        return agent

    # -- metrics ---------------------------------------------------------------------
    async def live_counts(self) -> list[LiveCountRow]:
        return [
            LiveCountRow(kind=r["kind"], state=r["state"], site=r["site"], n=int(r["n"]))
            for r in await self.db.fetch(store.LIVE_BY_STATE)
        ]

    async def agents_connected(self, *, silent_after_ms: int) -> list[AgentCountRow]:
        return [
            AgentCountRow(site=r["site"], role=r["role"], n=int(r["n"]))
            for r in await self.db.fetch(store.AGENTS_CONNECTED, silent_after_ms)
        ]

    async def batches_waiting(self) -> int:
        return int(await self.db.fetchval(store.BATCHES_WAITING))


def _progress_row(r: Any) -> ProgressRow:
    return ProgressRow(command=command_row(r), old_state=r["old_state"])


R = TypeVar("R")


def _by_place(records: list[Any], place: str, size: int, decode: Callable[[Any], R]) -> list[R | None]:
    """A group statement's answers in the order of its arrays: each record decoded at the place
    (1-based, ``WITH ORDINALITY``) its column ``place`` names, ``None`` where no row came back
    (a row its statement left alone)."""
    found: list[R | None] = [None] * size
    for r in records:
        found[r[place] - 1] = decode(r)
    return found


_CHECKED: type[Store] = PgStore  # mypy checks every operation against the protocol here
