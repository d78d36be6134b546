"""The rows the command queue's store returns, as typed Structs.

A store (``storage.PgStore`` over PostgreSQL, ``testing.MemoryStore`` in memory) hands these to
the service's parts; nothing above the store reads a database record by string key. Times are
seconds since the epoch, payloads the canonical JSON text exactly as delivered.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from better_compute.wire.cmdq import CommandState

__all__ = [
    "AgentCountRow",
    "AgentRow",
    "AgentSeenRow",
    "ApprovalRow",
    "BatchFields",
    "BatchRow",
    "BatchSizeRow",
    "Beat",
    "ClaimStateRow",
    "ClaimedRow",
    "CommandRow",
    "CommandStateRow",
    "CutOffRow",
    "JournalRow",
    "LiveCountRow",
    "ProgressRow",
    "agent_row",
    "approval_row",
    "batch_row",
    "command_row",
]


class CommandRow(msgspec.Struct, frozen=True, kw_only=True):
    """A command as the service sees it after a read or a change."""

    id: str
    node_id: str
    site_id: str
    tenant_id: str
    key: str
    kind: str
    destructive: bool
    target: Literal["site", "node"]
    payload: str
    agent_id: str | None
    state: CommandState
    reason: str | None
    progress: str | None
    batch_id: str | None
    workflow_id: str | None
    step: int | None
    result: bytes | None
    attested: bool
    created_at: float
    updated_at: float
    not_after: float
    dispatched_at: float | None
    publishes: int
    version: int
    """How many times its state changed (a trigger counts them): orders its events."""


class ProgressRow(msgspec.Struct, frozen=True, kw_only=True):
    """A command after a progress report, and the state it had before."""

    command: CommandRow
    old_state: str


class ClaimStateRow(msgspec.Struct, frozen=True, kw_only=True):
    """A command as a refused claim sees it, with its batch: why the claim was not taken."""

    id: str
    state: str
    kind: str
    payload: str
    agent_id: str | None
    digest: bytes
    live: bool
    destructive: bool
    claim_journal: str | None
    claim_signed_ms: int | None
    claim_id: str | None
    """The id named by the claim that took it (``Ack.claim_id``; None: an older agent's)."""
    has_batch: bool
    batch_expired: bool
    batch_approved: bool


class ClaimedRow(msgspec.Struct, frozen=True, kw_only=True):
    """A claimed command that may still run at its agent, and the journal that claimed it."""

    id: str
    agent_id: str
    claim_journal: str | None


class CommandStateRow(msgspec.Struct, frozen=True, kw_only=True):
    """What a result or a cancel needs to know of a command."""

    id: str
    node_id: str
    kind: str
    state: str
    agent_id: str | None
    digest: bytes
    live: bool


class JournalRow(msgspec.Struct, frozen=True, kw_only=True):
    """An agent's journal: its generation (the order the queue first heard of it) and whether
    it said hello or heartbeat itself."""

    generation: int
    present: bool


class BatchFields(msgspec.Struct, frozen=True, kw_only=True):
    """What a batch is made with and keeps: ``NewBatch`` going in, ``BatchRow`` coming out."""

    id: str
    tenant_id: str
    kinds: list[str]
    nodes: list[str]
    workflow_id: str | None
    workflow_ids: list[str]
    note: str | None
    idempotency_key: str | None
    document: bytes
    threshold: int


class BatchRow(BatchFields, frozen=True, kw_only=True):
    created_at: float
    expires_at: float
    expires_at_ms: int
    approved_at: float | None
    expired: bool
    closed_at: float | None
    closed_reason: str | None


class BatchSizeRow(msgspec.Struct, frozen=True, kw_only=True):
    """A batch's id and the size of its signed document (a page is cut by size)."""

    id: str
    size: int


class ApprovalRow(msgspec.Struct, frozen=True, kw_only=True):
    batch_id: str
    approver_id: str
    signature: bytes
    created_at: float


class AgentSeenRow(msgspec.Struct, frozen=True, kw_only=True):
    """An agent whose presence changed: where it is and what it is."""

    id: str
    site_id: str
    role: str


class Beat(msgspec.Struct, frozen=True, kw_only=True):
    """A node agent's heartbeat, checked and held in memory until the next presence write
    (``Presence``). ``age_ms``: how long ago it was heard, when it is written (its ``last_seen``
    is the database's now minus that)."""

    agent_id: str
    signed_at_ms: int
    cert_id: str
    status: str | None
    journal_id: str
    age_ms: float
    gap_ms: int = 0
    """The gap it announced until its next heartbeat, when longer than ``cmdq.heartbeat``
    (``CmdqConfig.silence_gap_ms``); 0 otherwise."""


class AgentRow(msgspec.Struct, frozen=True, kw_only=True):
    """An agent as ``agents.list`` shows it. ``status``: its own word about itself, the JSON text
    stored at its last hello or heartbeat; ``live``: commands out with it."""

    id: str
    site_id: str
    tenant_id: str
    role: str
    cert_id: str
    version: str | None
    kinds: list[str] | None
    connected_at: float
    last_seen: float
    status: str | None
    connected: bool
    boot_lease: bool
    live: int


class CutOffRow(msgspec.Struct, frozen=True, kw_only=True):
    """A revoked certificate's agents, shown disconnected, and their unclaimed site commands, back
    to pending for another agent."""

    agents: list[AgentSeenRow]
    reassigned: list[CommandRow]


class LiveCountRow(msgspec.Struct, frozen=True, kw_only=True):
    """Live commands of one kind, state and site (``bc_commands_live``)."""

    kind: str
    state: str
    site: str
    n: int


class AgentCountRow(msgspec.Struct, frozen=True, kw_only=True):
    """Connected agents of one site and role (``bc_agents_connected``)."""

    site: str
    role: str
    n: int


def _ts(value: Any) -> float | None:
    return None if value is None else float(value.timestamp())


def command_row(record: Any) -> CommandRow:
    """A ``commands`` record (``store._COLS``) as a ``CommandRow``."""
    return CommandRow(
        id=record["id"],
        node_id=record["node_id"],
        site_id=record["site_id"],
        tenant_id=record["tenant_id"],
        key=record["key"],
        kind=record["kind"],
        destructive=record["destructive"],
        target=record["target"],
        payload=record["payload"],
        agent_id=record["agent_id"],
        state=record["state"],
        reason=record["reason"],
        progress=record["progress"],
        batch_id=record["batch_id"],
        workflow_id=record["workflow_id"],
        step=record["step"],
        result=bytes(record["result"]) if record["result"] is not None else None,
        attested=record["attested"],
        created_at=record["created_at"].timestamp(),
        updated_at=record["updated_at"].timestamp(),
        not_after=record["not_after"].timestamp(),
        dispatched_at=_ts(record["dispatched_at"]),
        publishes=record["publishes"],
        version=record["version"],
    )


def batch_row(record: Any) -> BatchRow:
    """A ``batches`` record (``store._BATCH_COLS``) as a ``BatchRow``."""
    return BatchRow(
        id=record["id"],
        tenant_id=record["tenant_id"],
        kinds=list(record["kinds"]),
        nodes=list(record["nodes"]),
        workflow_id=record["workflow_id"],
        workflow_ids=list(record["workflow_ids"]),
        note=record["note"],
        idempotency_key=record["idempotency_key"],
        document=bytes(record["document"]),
        threshold=record["threshold"],
        created_at=record["created_at"].timestamp(),
        expires_at=record["expires_at"].timestamp(),
        expires_at_ms=record["expires_at_ms"],
        approved_at=_ts(record["approved_at"]),
        expired=record["expired"],
        closed_at=_ts(record["closed_at"]),
        closed_reason=record["closed_reason"],
    )


def approval_row(record: Any, batch_id: str | None = None) -> ApprovalRow:
    return ApprovalRow(
        batch_id=batch_id if batch_id is not None else record["batch_id"],
        approver_id=record["approver_id"],
        signature=bytes(record["signature"]),
        created_at=record["created_at"].timestamp(),
    )


def agent_row(record: Any) -> AgentRow:
    """An ``agents`` record (``store.AGENTS_LIST``) as an ``AgentRow``."""
    status = record["status"]
    return AgentRow(
        id=record["id"],
        site_id=record["site_id"],
        tenant_id=record["tenant_id"],
        role=record["role"],
        cert_id=record["cert_id"],
        version=record["version"],
        kinds=list(record["kinds"]) if record["kinds"] is not None else None,
        connected_at=record["connected_at"].timestamp(),
        last_seen=record["last_seen"].timestamp(),
        status=status if status is None or isinstance(status, str) else msgspec.json.encode(status).decode(),
        connected=record["connected"],
        boot_lease=record["boot_lease"],
        live=int(record["live"]),
    )
