"""The agent protocol: what travels between the command queue and its agents (signing an
event or a result is ``better_compute.crypto.sign_event`` / ``result_document``).

* Deliveries: the command queue publishes a ``CommandDelivery`` on the agent's subject
  ``bc.site.<site>.cmd.<agent>`` of the site's JetStream stream; the agent pulls it from its
  durable consumer.
* Events: the agent reports on ``bc.agent.<site>.<agent>.<kind>`` (``hello``, ``heartbeat``,
  ``ack``, ``progress``, ``result``). Each event is a JSON object signed by the agent's
  certificate key: the object's fields plus ``signature`` (base64) over
  ``signing_payload("agent.<kind>", <the object without signature>)``. The command queue
  checks that the signer's certificate belongs to the agent and site of the subject.
* ``hello``, ``heartbeat``, ``ack``, ``check`` and ``result`` are requests (the reply is an
  ``Ok``/``Err`` envelope); ``progress`` is fire-and-forget.

A cancel is a handshake: a claimed command that is cancelled is ``cancelling`` at the command
queue until its agent reports a result for it (stopped, or never started: ``rejected`` with a
reason starting ``cancelled``); only then is it ``cancelled``. The agent learns of it from its
heartbeat's reply (``cancel``) and from a ``check`` it sends before every try of a call to a
machine, and sends nothing more of the command once it knows.

An ``ack`` is a claim: the agent runs a command only after the command queue answered
``proceed``. The claim names the digest of the delivered kind and payload, so a delivery that
was forged or altered on the way is refused, and so is a command that was cancelled, expired
or handed to another agent in the meantime, or a destructive one whose batch expired or lost
its approval. It also names the agent's journal: a command claimed by another journal of the
same agent may have started and been forgotten, so it is settled ``interrupted``, never run
again.
"""

from __future__ import annotations

import base64
import hashlib
import time
from typing import Any, Final, Literal, cast

import msgspec

from ..core.errors import BcError, ErrorCode
from .cmdq import AgentStatus
from .codec import convert, decode

__all__ = [
    "EVENT_KINDS",
    "FRESHNESS_MS",
    "RESULT_PURPOSE",
    "Ack",
    "AckReply",
    "AgentEvent",
    "AnyAgentEvent",
    "CallFailure",
    "Check",
    "CheckReply",
    "CommandDelivery",
    "EventKind",
    "Heartbeat",
    "HeartbeatReply",
    "Hello",
    "HelloReply",
    "Progress",
    "Result",
    "ResultReply",
    "ResultStatus",
    "call_failure_text",
    "event_purpose",
    "is_call_failure",
    "open_event",
    "payload_digest",
    "read_event",
]

EventKind = Literal["hello", "heartbeat", "ack", "progress", "result", "check"]
EVENT_KINDS: Final[tuple[str, ...]] = ("hello", "heartbeat", "ack", "progress", "result", "check")
ResultStatus = Literal["succeeded", "failed", "rejected"]

FRESHNESS_MS: Final = 120_000
"""An event signed further than this from the command queue's clock is refused."""
RESULT_PURPOSE: Final = "command.result"
_DIGEST_DOMAIN: Final = b"bc-cmd-v1"


class _Msg(msgspec.Struct, frozen=True, kw_only=True, rename="camel", forbid_unknown_fields=False):
    pass


class CommandDelivery(_Msg, frozen=True, kw_only=True):
    """One command, as published on the agent's subject of its site's stream.

    ``payload`` is kept raw: the claim's digest is over exactly these bytes.
    """

    id: str
    kind: str
    payload: msgspec.Raw
    node_id: str
    site_id: str
    agent_id: str
    key: str
    destructive: bool = False
    not_after_ms: int
    batch_id: str | None = None
    workflow_id: str | None = None
    step: int | None = None


class AgentEvent(_Msg, frozen=True, kw_only=True, tag_field="event"):
    """Fields every event carries and signs. Its kind is the subject's last token; it travels
    in ``event`` too (the tag of ``AnyAgentEvent``), but the subject is what counts."""

    site: str
    agent: str
    signer_id: str
    """The certificate id (``cert_…``) whose key signed the event."""
    signed_at_ms: int


class Hello(AgentEvent, frozen=True, kw_only=True, tag="hello"):
    """An agent (re)connects. ``kinds`` lists the command kinds it implements."""

    version: str = ""
    kinds: list[str] | None = None
    incarnation: str = ""
    """Changes at every process start."""
    status: AgentStatus | None = None
    journal_id: str = ""
    """The agent's journal (as in ``Ack``): the queue numbers journals in the order it first
    hears of them, so a late claim from a journal that was replaced meanwhile is known as older,
    however recently it was signed."""
    next_heartbeat_ms: int = 0
    """As in ``Heartbeat``: the gap until its next heartbeat (a hello again after a reconnect
    may come in the middle of an idle agent's long gap). 0: the hello reply's ``heartbeat_ms``."""


class Heartbeat(AgentEvent, frozen=True, kw_only=True, tag="heartbeat"):
    incarnation: str = ""
    running: int = 0
    status: AgentStatus | None = None
    """What the agent says of itself now (None: unchanged since the last one)."""
    leaving: bool = False
    """The agent stops: it is shown disconnected at once and gives up its boot lease."""
    journal_id: str = ""
    """The agent's journal: what it claimed may run there while it heartbeats (a command another
    journal interrupted stays live until this one reports its end or falls silent)."""
    next_heartbeat_ms: int = 0
    """How long until its next heartbeat: a machine's agent with nothing to do heartbeats every
    ``HelloReply.idle_heartbeat_ms``, and the queue counts its silence from that gap. 0 (an older
    agent): the hello reply's ``heartbeat_ms``."""


class Ack(AgentEvent, frozen=True, kw_only=True, tag="ack"):
    """A claim on a delivered command; run it only after ``AckReply.proceed``."""

    command_id: str
    digest: str
    """``payload_digest(kind, payload)`` of the delivery, hex."""
    journal_id: str = ""
    """The id of the agent's journal (kept in it from its creation). A command already claimed
    by another journal of the same agent may have started there and been forgotten: the claim
    settles it ``failed`` (``interrupted``) instead of letting it run again. Empty: the agent
    does not say, and is treated as another journal."""
    rerun: bool = False
    """The claim of a command this very journal started and never finished (its process died):
    may it run again? Only when the command's kind is idempotent for its payload (its manifest
    says so), it is still this journal's and live, and nobody cancelled it."""
    claim_id: str = ""
    """A random id the agent journaled with the command (``claiming``) before it sent the claim,
    named again by every later claim of it (the answer was lost, or its process died before it
    journaled the start). With one, a claim taken marks the command ``running``
    (``AckReply.state``): the agent runs it on that answer and sends no ``running`` mark of its
    own. The queue takes a claim of a ``running`` command again only from the same journal with
    the same id; the same journal with another id (the entry lost with the machine's power, the
    journal restored from an older copy) is refused ``running``, and the agent treats the command
    as one an earlier process of it started. Empty (an older agent): the claim marks it
    ``acked`` and the agent's first progress marks it ``running``."""


class Progress(AgentEvent, frozen=True, kw_only=True, tag="progress"):
    command_id: str
    message: str | None = None
    percent: float | None = None


CallFailure = Literal["unreachable", "error"]
"""How a try of a call to a machine failed: nothing answered (refused, timed out), or it answered
with an error worth trying again (a 5xx)."""
_FAILURE_WORDS: Final[dict[str, str]] = {"unreachable": "unreachable", "error": "answers with errors"}


def call_failure_text(kind: CallFailure, reason: str, *, at: str, tries: int, since: float) -> str:
    """A command's progress while the tries of its calls to a machine fail: ``BMC unreachable at
    10.0.0.5:443: connection refused, 12 tries since 04:31:02`` (``since``: the first failure,
    seconds since the epoch, shown in UTC). Readers (``bcx why``, the watch line) tell it from a
    plain try with ``is_call_failure``."""
    word = _FAILURE_WORDS.get(kind, kind)
    when = time.strftime("%H:%M:%S", time.gmtime(since))
    return f"BMC {word} at {at}: {reason}, {tries} {'try' if tries == 1 else 'tries'} since {when} UTC"[:500]


def is_call_failure(progress: str | None) -> bool:
    """Whether a command's progress says its calls to the machine fail (``call_failure_text``)."""
    return bool(progress) and any(
        str(progress).startswith(f"BMC {word} at ") for word in _FAILURE_WORDS.values()
    )


class Result(AgentEvent, frozen=True, kw_only=True, tag="result"):
    command_id: str
    status: ResultStatus
    reason: str | None = None
    result: bytes = b""
    """The raw result bytes (base64 in JSON)."""
    result_signature: bytes | None = None
    """A node's signature over ``result_document(...)``: the result then counts as attested
    once the command queue checked it against the node's certificate."""
    journal_id: str = ""
    """The reporting agent's journal. A ``cancelling`` command is ``cancelled`` only on the word
    of the journal that claimed it (or an agent that does not say); another journal of the same
    agent cannot vouch for what the first one sent: the command then fails ``interrupted``."""


class Check(AgentEvent, frozen=True, kw_only=True, tag="check"):
    """Before a try of a call to a machine: which of these running commands must stop?"""

    command_ids: list[str]


AnyAgentEvent = Hello | Heartbeat | Ack | Progress | Result | Check
"""Every event an agent sends, told apart by its ``event`` tag."""


def read_event(kind: str, doc: dict[str, Any]) -> AnyAgentEvent:
    """``doc`` (an opened event) as the Struct of its ``kind``, the subject's last token: the
    subject wins over any ``event`` the document names. ``INVALID_INPUT`` with the path of a
    field that does not fit."""
    event: AnyAgentEvent = convert({**doc, "event": kind}, cast(Any, AnyAgentEvent))
    return event


class HelloReply(_Msg, frozen=True, kw_only=True):
    heartbeat_ms: int
    silent_after_ms: int
    stream: str
    consumer: str
    boot_lease: bool = False
    ack_wait_ms: int = 30_000
    """The consumer's ack wait: a running command's message is kept in progress within it."""
    results_subject: str | None = None
    """Set when the site's streams live on its leaf node (``cmdq.site_domain``): the agent
    stores each result there, on this subject of ``results_stream`` (the leaf's JetStream
    acknowledges it, link to the hub up or not), instead of asking the command queue; the
    queue reads that stream and applies what it finds. Unset: results are requests."""
    results_stream: str | None = None
    idle_heartbeat_ms: int | None = None
    """A machine's agent (role ``node`` or ``provisioned``) with nothing to do (no command
    claimed, running or being reported, nothing unreported in its journal) heartbeats this often,
    saying so in each heartbeat (``next_heartbeat_ms``), and every ``heartbeat_ms`` from the
    moment it has work. A site agent keeps ``heartbeat_ms``. None (an older queue): always
    ``heartbeat_ms``."""


class HeartbeatReply(_Msg, frozen=True, kw_only=True):
    boot_lease: bool = False
    cancel: list[str] = msgspec.field(default_factory=list)
    """This agent's commands that were cancelled after it claimed them (``cancelling``): stop
    them, or say that they never started, by reporting a result."""


class CheckReply(_Msg, frozen=True, kw_only=True):
    stop: list[str] = msgspec.field(default_factory=list)
    """The asked commands the queue no longer expects to run here (cancelled, settled, not
    this agent's): send nothing more of them."""


class AckReply(_Msg, frozen=True, kw_only=True):
    proceed: bool
    state: str | None = None
    """Taken: ``running`` when the claim marked it so (it named a ``claim_id``), else ``acked``
    (an older queue, or a claim without one): then the agent's first progress marks it."""
    reason: str | None = None
    again: bool = False
    """Not now, but not for good: the command waits (for its batch's approval) and is delivered
    again when it may run. The agent forgets this delivery instead of journaling a refusal."""
    rerun: bool = False
    """The answer to a ``rerun`` claim, from a queue that knows them: only then may the agent
    run the command again (an older queue would take it for a plain claim)."""


class ResultReply(_Msg, frozen=True, kw_only=True):
    recorded: bool
    """False when the command had already settled (a duplicate or late result)."""
    state: str | None = None
    attested: bool = False


def event_purpose(kind: str) -> str:
    """The signing purpose of an event kind: ``agent.ack`` and so on."""
    return f"agent.{kind}"


def open_event(data: bytes) -> tuple[dict[str, Any], bytes]:
    """Split a signed event into its document and signature (nothing is checked yet).

    Raises:
        BcError: ``INVALID_INPUT`` for anything but a JSON object with a base64 ``signature``.
    """
    if not data:
        raise BcError(ErrorCode.INVALID_INPUT, "event is not JSON", {"path": ""})
    # the codec's checked decode: nesting past MAX_DEPTH (which would exhaust the decoder), a NUL
    # or an integer beyond int64 is INVALID_INPUT with its path, never INTERNAL
    doc: Any = decode(data, Any)
    if not isinstance(doc, dict):
        raise BcError(ErrorCode.INVALID_INPUT, "event is not an object", {"path": ""})
    sig = doc.pop("signature", None)
    if not isinstance(sig, str):
        raise BcError(ErrorCode.INVALID_INPUT, "event is not signed", {"path": "signature"})
    try:
        signature = base64.b64decode(sig, validate=True)
    except ValueError as exc:
        raise BcError(ErrorCode.INVALID_INPUT, "signature is not base64", {"path": "signature"}) from exc
    return doc, signature


def payload_digest(kind: str, payload: bytes) -> str:
    """sha256 over a command's kind and its payload bytes as delivered, hex."""
    return hashlib.sha256(b"\x00".join((_DIGEST_DOMAIN, kind.encode(), payload))).hexdigest()
