"""The command-queue's contract with its callers (engine, secrets, bcx, agents' SDK): its
requests, replies, events and routes. The client is ``better_compute.clients.CommandQueueClient``;
what agents and the queue say to each other is ``wire.agent``.

Events go on ``bc.events.command.<id>``; field names are camelCase on the wire. Every route is
``bc.api.command-queue.<resource>.<verb>`` (``SERVICE``):

========================  ========================  ====================================
route                     request                   result
========================  ========================  ====================================
``commands.enqueue``      ``EnqueueCommand``        ``CommandView`` (``created`` says if new)
``commands.get``          ``CommandIdRequest``      ``CommandView``
``commands.list``         ``ListCommands``          ``CommandList`` (newest first, no results)
``commands.cancel``       ``CancelCommands``        ``CancelReply``
``commands.live_with_ref````LiveWithRef``           ``LiveWithRefReply``
``agents.list``           ``ListAgents``            ``AgentList``
``agents.site_agent_for`` ``SiteAgentRequest``      ``SiteAgentReply``
``batches.create``        ``CreateBatch``           ``BatchView``
``batches.get``           ``BatchIdRequest``        ``BatchView``
``batches.list``          ``ListBatches``           ``BatchList``
``batches.approve``       ``ApproveBatch``          ``BatchView``
``batches.close``         ``CloseBatch``            ``BatchView`` (``closed``; again: the same)
``batches.reopen``        ``BatchIdRequest``        ``BatchView`` (its workflow runs again)
``quorum.get``            ``{}``                    ``QuorumView``
========================  ========================  ====================================
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Final, Literal, Protocol

import msgspec

from ..core.names import Name
from .paging import DEFAULT_LIMIT, Cursor

__all__ = [
    "BATCH_EVENTS",
    "BATCH_PURPOSE",
    "DEFAULT_COMMAND_TIMEOUT_MS",
    "ENGINE_PROOF_MAX_AGE_MS",
    "EVENTS",
    "LIVE_STATES",
    "MAX_STATE_QUERY",
    "MAX_STATUS_DRIVERS",
    "MAX_STATUS_DRIVER_CHARS",
    "MAX_STATUS_ERROR_CHARS",
    "SERVICE",
    "TERMINAL_STATES",
    "AgentList",
    "AgentStatus",
    "AgentView",
    "AnyBatchEvent",
    "AnyCommandEvent",
    "ApprovalView",
    "ApproveBatch",
    "ApproverView",
    "BatchEvent",
    "BatchIdRequest",
    "BatchList",
    "BatchState",
    "BatchView",
    "CancelCommands",
    "CancelReply",
    "CloseBatch",
    "CommandEvent",
    "CommandIdRequest",
    "CommandList",
    "CommandState",
    "CommandStates",
    "CommandStatesReply",
    "CommandView",
    "CreateBatch",
    "EnqueueCommand",
    "ListAgents",
    "ListBatches",
    "ListCommands",
    "LiveWithRef",
    "LiveWithRefReply",
    "Mac",
    "QuorumView",
    "RunningAt",
    "SiteAgentReply",
    "SiteAgentRequest",
    "decode_batch_event",
    "decode_command_event",
    "engine_proof",
    "enqueue_proof_document",
]

CommandState = Literal[
    "pending", "dispatched", "acked", "running", "cancelling", "succeeded", "failed", "rejected",
    "expired", "cancelled",
]  # fmt: skip
LIVE_STATES: frozenset[str] = frozenset({"pending", "dispatched", "acked", "running", "cancelling"})
"""``cancelling``: cancelled after its agent claimed it, and the agent has not yet said that it
stopped it (or never started it); it may still reach the machine until then."""
TERMINAL_STATES: frozenset[str] = frozenset({"succeeded", "failed", "rejected", "expired", "cancelled"})
DEFAULT_COMMAND_TIMEOUT_MS = 600_000
SERVICE: Final = "command-queue"
"""The service token of every route: ``bc.api.command-queue.<resource>.<verb>``."""
EVENTS: Final = "command"
"""The kind of the queue's events: ``bc.events.command.<command id>`` (``AnyCommandEvent``)."""
BATCH_EVENTS: Final = "batch"
"""The kind of a batch's events: ``bc.events.batch.<batch id>`` (``AnyBatchEvent``)."""


class _Msg(msgspec.Struct, frozen=True, kw_only=True, rename="camel", forbid_unknown_fields=False):
    pass


class EnqueueCommand(_Msg, frozen=True, kw_only=True):
    """``commands.enqueue``: find-before-create by (node, key).

    ``target`` says which agent runs it: ``site`` (a connected agent of ``site_id``, the
    boot-lease holder first) or ``node`` (the node's own bcd, agent id = node id).
    ``sends`` is the declaring step's ``sends`` list when the command comes from a
    control-plane step; a kind outside it is ``INVALID_CONFIG``.
    """

    node_id: str
    site_id: str
    kind: str
    payload: Any = msgspec.field(default_factory=dict)
    key: str
    target: Literal["site", "node"] = "site"
    workflow_id: str | None = None
    step: Annotated[int, msgspec.Meta(ge=0, le=511)] | None = None
    batch_id: str | None = None
    timeout_ms: int = DEFAULT_COMMAND_TIMEOUT_MS
    sends: list[str] | None = None
    tenant_id: str = "root"
    in_batch: bool = False
    """The workflow's batch covers this command although its kind is not destructive (a boot
    command of a profile that writes disks): it is held, checked at its claim and expired with
    its batch exactly like a destructive command, and shown ``destructive``."""
    engine_proof: str | None = None
    """In a stack without NATS accounts, that the engine sent it: ``<unix ms>:<key id>:<mac>``,
    an HMAC-SHA256 of ``enqueue_proof_document`` under the key the engine and the command queue
    both read from ``cmdq.engine_key_file`` (``engine_proof``). Only the engine may enqueue a
    command naming a workflow (docs/command-queue.md, *Who may send under a workflow*)."""


ENGINE_PROOF_MAX_AGE_MS: Final = 300_000
"""An engine proof older than this (or this far in the future) proves nothing: a copy of an
enqueue seen on the bus cannot be sent again later, after the command it made is gone."""


class Mac(Protocol):
    """A key that MACs bytes (``better_compute.keyring.Keyring``)."""

    def mac(self, data: bytes) -> str: ...


def enqueue_proof_document(cmd: EnqueueCommand, at_ms: int) -> bytes:
    """What an engine proof covers: the whole request but the proof, canonical, and its time."""
    body = msgspec.json.encode(msgspec.structs.replace(cmd, engine_proof=None), order="sorted")
    return b"bc-engine-enqueue\x00" + str(at_ms).encode() + b"\x00" + body


def engine_proof(cmd: EnqueueCommand, key: Mac, *, at_ms: int | None = None) -> EnqueueCommand:
    """``cmd`` with the engine's proof under ``key`` (the stack's ``cmdq.engine_key_file``)."""
    at = time.time_ns() // 1_000_000 if at_ms is None else at_ms
    return msgspec.structs.replace(cmd, engine_proof=f"{at}:{key.mac(enqueue_proof_document(cmd, at))}")


class CommandView(_Msg, frozen=True, kw_only=True):
    """``commands.enqueue`` / ``commands.get`` reply. ``result`` is the agent's raw bytes,
    base64 in JSON (msgspec encodes ``bytes`` that way)."""

    id: str
    node_id: str
    site_id: str
    agent_id: str | None = None
    kind: str
    key: str
    state: CommandState
    reason: str | None = None
    destructive: bool = False
    batch_id: str | None = None
    workflow_id: str | None = None
    step: int | None = None
    result: bytes | None = None
    attested: bool = False
    created: bool = False  # true when this enqueue created it, false when it was found
    created_at: float = 0.0
    updated_at: float = 0.0
    not_after: float = 0.0
    # Added with the command-queue service (issue 4); defaults keep older readers working.
    target: Literal["site", "node"] = "site"
    tenant_id: str = "root"
    payload: Any = None
    """The validated payload as stored (SecretRefs as ``sec_…``); absent from list pages."""
    progress: str | None = None
    """The agent's last progress message."""


class CancelCommands(_Msg, frozen=True, kw_only=True):
    """``commands.cancel``: one command by id, or every live command whose key is under
    ``key_prefix`` (``wf:<id>:<step>#<attempt>``: the prefix, then end, ``:`` or ``#``) on
    ``node_id`` and/or of ``workflow_id`` (every node the workflow sent to).

    ``fence`` (with ``workflow_id``, and a prefix under ``wf:<workflow_id>:``): also refuse
    every later enqueue under the prefix (reason ``attempt-superseded``), for a step attempt
    that was superseded and may still run in an engine that lost its shard."""

    id: str | None = None
    node_id: str | None = None
    key_prefix: str | None = None
    reason: str = "cancelled"
    workflow_id: str | None = None
    fence: bool = False


class CommandEvent(_Msg, frozen=True, kw_only=True, tag_field="event", tag="command"):
    """Published on ``bc.events.command.<id>`` at every state change: a wake-up, never the
    truth. It is the one member of ``AnyCommandEvent`` today; another kind of command event
    joins that union with its own ``event`` tag, and readers ``match`` on what they decode."""

    id: str
    key: str
    node_id: str
    workflow_id: str | None = None
    step: int | None = None
    state: CommandState
    reason: str | None = None
    kind: str | None = None
    """The command's kind (``power.setPower``); None from a queue older than the event feed."""
    site_id: str | None = None
    at: float | None = None
    """When the state changed (epoch seconds); None from a queue older than the event feed."""


AnyCommandEvent = CommandEvent
"""Every event on ``bc.events.command.*`` (one kind so far)."""

_command_events = msgspec.json.Decoder(AnyCommandEvent)


def decode_command_event(data: bytes) -> AnyCommandEvent | None:
    """The event in ``data``, or None for anything that is not one (a wake-up is never trusted
    for more than waking)."""
    try:
        return _command_events.decode(data)
    except msgspec.MsgspecError:
        return None


class BatchEvent(_Msg, frozen=True, kw_only=True, tag_field="event", tag="batch"):
    """Published on ``bc.events.batch.<id>`` when a destructive batch is created, gets an
    approval, is approved (its quorum reached), expires or is closed (its workflow failed or was
    aborted): ``state`` is ``awaiting``, ``approved``, ``expired`` or ``closed``;
    ``approver_id`` names whose approval this one is, when it is."""

    id: str
    state: str
    approvals: int
    threshold: int
    workflow_id: str | None = None
    approver_id: str | None = None
    at: float


AnyBatchEvent = BatchEvent
"""Every event on ``bc.events.batch.*`` (one kind so far)."""

_batch_events = msgspec.json.Decoder(AnyBatchEvent)


def decode_batch_event(data: bytes) -> AnyBatchEvent | None:
    """The event in ``data``, or None for anything that is not one."""
    try:
        return _batch_events.decode(data)
    except msgspec.MsgspecError:
        return None


class LiveWithRef(_Msg, frozen=True, kw_only=True):
    """``commands.live_with_ref``, asked by bc-secrets before an agent may fetch a value:
    is there a command delivered to ``agent_id`` and not finished (dispatched, acked or
    running, and before its ``notAfter``) whose key starts with ``key_prefix``
    (``wf:<workflow>:<step>``, followed by end, ``#`` or ``:``) and whose payload carries
    ``ref``? A pending command (not yet delivered, or waiting for its quorum) opens nothing.
    With ``node_id`` (a node's standing secret, such as its BMC credential) the command must
    also be for that node; its ``key_prefix`` is then ``wf``: any workflow's command."""

    agent_id: str
    ref: str
    key_prefix: str
    node_id: str | None = None


class LiveWithRefReply(_Msg, frozen=True, kw_only=True):
    live: bool
    command_id: str | None = None


MAX_STATE_QUERY = 5000


class CommandStates(_Msg, frozen=True, kw_only=True):
    """``commands.states``: the states of many commands at once (at most 5000 ids).

    The engine's safety net: one request every poll interval for every command its waiting
    steps wait on, instead of one request per workflow.
    """

    ids: list[str]


class CommandStatesReply(_Msg, frozen=True, kw_only=True):
    """``id -> state`` of the commands that exist; unknown ids are left out."""

    states: dict[str, str]


class AgentStatus(_Msg, frozen=True, kw_only=True):
    """What an agent says of itself in its hello and heartbeats, shown by ``bcx agents list``:
    its drivers (a site agent's BMC drivers), its cache use, its last error. Bounded by the
    command-queue (``MAX_STATUS_*``); a longer error is cut."""

    drivers: list[str] = []
    cache_used_bytes: int | None = None
    cache_max_bytes: int | None = None
    cache_objects: int | None = None
    cache_pinned: int | None = None
    """Objects in a site agent's cache, and those held by a boot entry or a virtual medium (no
    longer on its unauthenticated ``/healthz``)."""
    last_error: str | None = None
    last_error_at_ms: int | None = None


MAX_STATUS_DRIVERS = 16
MAX_STATUS_DRIVER_CHARS = 32
MAX_STATUS_ERROR_CHARS = 300


BATCH_PURPOSE: Final = "cmdq.batch"
BatchState = Literal["open", "approved", "expired", "closed"]

Limit = Annotated[int, msgspec.Meta(ge=1, le=1000)]
Text = Annotated[str, msgspec.Meta(max_length=200)]
KindName = Annotated[str, msgspec.Meta(max_length=128)]
NodeIdText = Annotated[str, msgspec.Meta(max_length=64)]


class _Req(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    pass


# -- commands -----------------------------------------------------------------------


class CommandIdRequest(_Req, frozen=True, kw_only=True):
    id: str


class ListCommands(_Req, frozen=True, kw_only=True):
    """Filters combine with AND; ``before`` is the ``next`` of the previous page."""

    node_id: str | None = None
    workflow_id: str | None = None
    state: CommandState | None = None
    kind: KindName | None = None
    site_id: str | None = None
    agent_id: str | None = None
    batch_id: str | None = None
    before: str | None = None
    limit: Limit = 100


class CommandList(_Msg, frozen=True, kw_only=True):
    commands: list[CommandView]
    next: str | None = None


class RunningAt(_Msg, frozen=True, kw_only=True):
    """Where a claimed command may still run: its agent and the journal that claimed it."""

    command_id: str
    agent_id: str | None = None
    journal_id: str | None = None


class CancelReply(_Msg, frozen=True, kw_only=True):
    cancelled: list[str]
    running: list[str] = []
    """Commands under the prefix an agent claimed and may still be running: cancelling does
    not recall them, nor does another journal's claim (``failed``, ``interrupted``). One leaves
    this list with the result of the journal that claimed it (even a late one, which no longer
    counts), or when that journal is lost (silent for ``cmdq.lost_after``)."""
    running_at: list[RunningAt] = []
    """``running`` with the agent and journal each waits on, in the same order."""


# -- agents -------------------------------------------------------------------------


class ListAgents(_Req, frozen=True, kw_only=True):
    site_id: str | None = None
    role: str | None = None
    connected: bool | None = None
    """True: connected only; False: silent only; unset: every agent."""
    limit: Limit = DEFAULT_LIMIT
    cursor: Cursor | None = None
    """The ``next`` of the page before (by site, then id)."""


class AgentView(_Msg, frozen=True, kw_only=True):
    id: str
    site_id: str
    tenant_id: str
    role: str
    cert_id: str
    version: str | None = None
    kinds: list[str] | None = None
    connected: bool
    boot_lease: bool = False
    live_commands: int = 0
    connected_at: float
    last_seen: float
    status: AgentStatus | None = None
    """What the agent last said of itself (drivers, cache use, last error)."""


class AgentList(_Msg, frozen=True, kw_only=True):
    agents: list[AgentView]
    next: str | None = None
    """The cursor of the next page; None after the last."""


class SiteAgentRequest(_Req, frozen=True, kw_only=True):
    """The site is ``site_id``; without it, the site the node is known in here (its own
    agent's certificate, else its latest command). Give ``site_id`` when you know it."""

    site_id: str | None = None
    node_id: str | None = None


class SiteAgentReply(_Msg, frozen=True, kw_only=True):
    agent_id: str | None = None


# -- batches and the quorum -------------------------------------------------------


class CreateBatch(_Req, frozen=True, kw_only=True):
    """A destructive batch's scope: the command kinds and nodes it covers, until it expires."""

    tenant_id: Name = "root"
    kinds: Annotated[list[KindName], msgspec.Meta(min_length=1, max_length=64)]
    nodes: Annotated[list[NodeIdText], msgspec.Meta(min_length=1, max_length=10_000)]
    ttl_seconds: Annotated[int, msgspec.Meta(ge=60, le=30 * 24 * 3600)] = 24 * 3600
    workflow_id: str | None = None
    workflow_ids: Annotated[list[str], msgspec.Meta(max_length=10_000)] = []
    """A bulk verb's batch (``metal.bulk``): the workflows it admits, instead of ``workflow_id``."""
    note: Text | None = None
    idempotency_key: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    """The same key returns the first batch (``CONFLICT`` with another scope)."""


class BatchIdRequest(_Req, frozen=True, kw_only=True):
    id: str


class CloseBatch(_Req, frozen=True, kw_only=True):
    """Close a batch whose workflow failed or was aborted (its engine does): it takes no more
    approvals and no longer counts as open."""

    id: str
    reason: Text | None = None


class ListBatches(_Req, frozen=True, kw_only=True):
    workflow_id: str | None = None
    state: BatchState | None = None
    limit: Limit = DEFAULT_LIMIT
    cursor: Cursor | None = None
    """The ``next`` of the page before (newest first)."""


class ApprovalView(_Msg, frozen=True, kw_only=True):
    approver_id: str
    at: float
    counted: bool
    """False when the approver is no longer configured (the signature is kept, not counted)."""


class BatchView(_Msg, frozen=True, kw_only=True):
    id: str
    tenant_id: str
    kinds: list[str]
    nodes: list[str]
    workflow_id: str | None = None
    workflow_ids: list[str] = []
    """A bulk verb's batch: the workflows it admits (signed, like ``workflow_id``)."""
    note: str | None = None
    state: BatchState
    threshold: int
    """Approvals needed (M), as configured now."""
    approvals: list[ApprovalView] = []
    created_at: float
    expires_at_ms: int
    document: bytes
    """What approvers sign; ``batch_document`` rebuilds it from the fields above."""
    created: bool = False
    closed_reason: str | None = None
    """Why a ``closed`` batch was closed (its workflow failed or was aborted)."""


class BatchList(_Msg, frozen=True, kw_only=True):
    batches: list[BatchView]
    next: str | None = None
    """The cursor of the next page; None after the last. A page of big batches (many
    nodes) holds fewer than ``limit``."""


class ApproveBatch(_Req, frozen=True, kw_only=True):
    batch_id: str
    approver_id: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    signature: Annotated[bytes, msgspec.Meta(max_length=512)]
    """Ed25519 over ``batch_document(...)`` of the batch."""


class ApproverView(_Msg, frozen=True, kw_only=True):
    id: str
    public_key: str


class QuorumView(_Msg, frozen=True, kw_only=True):
    enabled: bool
    threshold: int = 0
    approvers: list[ApproverView] = []
