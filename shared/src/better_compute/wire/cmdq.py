"""The command-queue's contract with its callers (engine, secrets, bcx, agents' SDK).

Subjects: ``bc.api.command-queue.<resource>.<verb>``; events on ``bc.events.command.<id>``.
Payload field names are camelCase on the wire.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

__all__ = [
    "DEFAULT_COMMAND_TIMEOUT_MS",
    "LIVE_STATES",
    "MAX_STATE_QUERY",
    "MAX_STATUS_DRIVERS",
    "MAX_STATUS_DRIVER_CHARS",
    "MAX_STATUS_ERROR_CHARS",
    "TERMINAL_STATES",
    "AgentStatus",
    "CancelCommands",
    "CommandEvent",
    "CommandState",
    "CommandStates",
    "CommandStatesReply",
    "CommandView",
    "EnqueueCommand",
    "LiveWithRef",
    "LiveWithRefReply",
]

CommandState = Literal[
    "pending", "dispatched", "acked", "running", "succeeded", "failed", "rejected", "expired",
    "cancelled",
]  # fmt: skip
LIVE_STATES: frozenset[str] = frozenset({"pending", "dispatched", "acked", "running"})
TERMINAL_STATES: frozenset[str] = frozenset({"succeeded", "failed", "rejected", "expired", "cancelled"})
DEFAULT_COMMAND_TIMEOUT_MS = 600_000


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


class CommandEvent(_Msg, frozen=True, kw_only=True):
    """Published on ``bc.events.command.<id>`` at every state change."""

    id: str
    key: str
    node_id: str
    workflow_id: str | None = None
    step: int | None = None
    state: CommandState
    reason: str | None = None


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
    last_error: str | None = None
    last_error_at_ms: int | None = None


MAX_STATUS_DRIVERS = 16
MAX_STATUS_DRIVER_CHARS = 32
MAX_STATUS_ERROR_CHARS = 300
