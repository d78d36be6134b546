"""The agent runtime: connect, announce, pull commands, run each at most once, report, sign.

>>> agent = Agent(enrollment=enrollment, handlers={"power.setPower": set_power},
...               journal="/var/lib/bc-site-agent/journal.db", nats_url=url)
>>> async with agent:
...     await agent.run()

A handler is ``async def handler(cmd: Command) -> bytes | str | dict | list | None``. Its return
value becomes the result bytes (``str`` as UTF-8, ``dict``/``list`` as JSON). Raise
``CommandRejected(reason)`` to refuse a command (state ``rejected``); any other exception fails
it (state ``failed``, reason ``<ExceptionType>: <message>``).

A handler that talks to a machine (a BMC) awaits ``before_call(call)`` before every try and
every retry of each request: once a cancel of the command reached the agent it raises
``CommandCancelled`` (let it through), so nothing more is sent after the cancel. A client
library that sends several requests in one call runs in a worker thread and calls
``before_call_blocking`` before each request; its tries then pass ``requests_checked=True``, and
only a request that changes the machine asks the command queue.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg

from ..backoff import Backoff
from ..core import __version__
from ..core.errors import BcError, ErrorCode
from ..crypto import result_document, sign_bytes, sign_event
from ..logging import get_logger
from ..service.client import connect, when_reconnected
from ..service.killpoints import declare, kill_point
from ..wire import Subjects, unwrap
from ..wire.agent import (
    Ack,
    AckReply,
    AgentEvent,
    CallFailure,
    Check,
    CheckReply,
    CommandDelivery,
    Heartbeat,
    HeartbeatReply,
    Hello,
    HelloReply,
    Progress,
    Result,
    ResultReply,
    call_failure_text,
    payload_digest,
)
from ..wire.cmdq import AgentStatus
from ..wire.codec import encode
from .identity import Enrollment
from .journal import Journal, JournalEntry

__all__ = [
    "MAX_RESULT_BYTES",
    "Agent",
    "Command",
    "CommandCancelled",
    "CommandHandler",
    "CommandRejected",
    "before_call",
    "before_call_blocking",
    "call_answered",
    "call_failed",
    "connect_waiting",
]

MAX_RESULT_BYTES: Final = 512 * 1024
"""A larger result fails the command with reason ``result-too-large``."""

_WAIT_FOR: Final = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT})
"""The command queue is not there now: ask again until it is (or the agent stops)."""
_INTERNAL_TRIES: Final = 5
_PENDING_FIRST_S: Final = 0.5
_PENDING_PAUSE_S: Final = 10.0
"""Hellos while the certificate is ``pending`` (docs/security.md) come 0.5 s apart at first,
doubling (jittered) to at most this: the agent connects within about 10 s of the site agent's
confirm, as bcd's connection does where the auth callout refuses a pending certificate. Once a
second, a machine held for a production quiet period (120 s) said 120 hellos a boot, each a
certificate read at bc-pki; now about 20."""
FETCH_TIMEOUT_S: Final = 20.0
"""How long one pull of an idle agent waits for a command (``Agent._fetch``): a command arrives
at once whatever it is; each pull is two JetStream requests, so 1 s cost a thousand idle machines
two thousand requests a second."""
PROGRESS_INTERVAL: Final = 1.0
"""At most one progress event per command this often (seconds): the latest word waits its turn
and goes out then, the ones before it are dropped."""
TRY_WORD_INTERVAL: Final = 3.0
"""A word that only names the try under way (``try 3: POST …``) waits this long after the last
one; news (a call failing, answering again) waits ``PROGRESS_INTERVAL``. At 1,000 machines a
site agent's commands last seconds under load, and their try words were the largest kind of
agent event (13.5 a machine in a commission, bench_fleet --agent-events)."""
_NOT_FINAL: Final = frozenset({"not-yours", "digest-mismatch"})
"""Claim refusals that hold for this delivery only, whatever the queue's ``again`` says: the
command is another agent's now (it may be handed to this one later: journaled, that delivery
would be dropped unrun), or this delivery is not what the queue sent (a genuine one may follow).
Every other refusal (a settled or expired command, an unknown one, another journal's claim) holds
for the command and is journaled."""


# Where a chaos test may SIGKILL an agent (site agent or bcd; docs/chaos.md).
CLAIMED = declare("agent.after-claim", "agent", "the command queue took the claim, the journal has no entry")
JOURNALED = declare("agent.after-journal", "agent", "the journal says started, the handler has not run")
RAN = declare("agent.after-run", "agent", "the handler ran and the journal holds its result, not reported")


class _Stopping(Exception):  # noqa: N818 - control flow, never leaves this module
    """The agent stops while waiting for the command queue: leave the work for the next run."""


class _Later(Exception):  # noqa: N818 - control flow, never leaves this module
    """The command queue keeps failing on this one: leave the message for JetStream to bring
    back after its ack wait."""


class CommandCancelled(Exception):  # noqa: N818 - an outcome ("cancelled"), not a program error
    """Raised by ``before_call`` once a cancel of the running command reached the agent: the
    handler stops and sends nothing more (let it through)."""


@dataclass(kw_only=True)
class _Run:
    """A command this process runs now: its tries and whether a cancel reached it."""

    tries: int = 0
    last_call: str | None = None
    cancelled: bool = False
    failure: _Failure | None = None
    said_at: float = -PROGRESS_INTERVAL
    """When (monotonic) the last progress of the command went out."""
    saying: str | None = None
    """The latest progress not sent yet (it waits for its turn)."""
    flush_due: float | None = None
    """When (monotonic) the word waiting goes out."""
    try_checked: float | None = None
    """When (monotonic) the check of a try (``before_call``) let it go, while no request of the
    try has gone out since: its first request (``before_call_blocking``) takes that answer."""
    claimed: float | None = None
    """When (monotonic) the command queue let this agent claim the command (``ack``): an answer
    that the command was not cancelled then, as a check's. The first try (or, without one, the
    first request that changes the machine) takes it while it is at most ``_TRY_CHECK_FOR`` old."""

    @classmethod
    def starting(cls, *, cancelled: bool, claimed: float | None = None) -> _Run:
        """A command starting now, its ``running`` mark just set (by its claim, or sent): that
        mark is its first progress, so its first word waits its turn after it (``_say``), and a command that
        ends sooner says none (its result says more). A site agent's BMC command said its
        first try at once: a signed event and a statement at the command queue even for a
        command over within the second (bench_fleet --agent-events counts them)."""
        return cls(cancelled=cancelled, said_at=time.monotonic(), claimed=claimed, try_checked=claimed)


@dataclass(kw_only=True)
class _Failure:
    """The tries of the command's calls to its machine that failed in a row."""

    kind: CallFailure
    reason: str
    at: str
    tries: int
    since: float
    """The first failed try of the row (seconds since the epoch)."""

    def text(self) -> str:
        return call_failure_text(self.kind, self.reason, at=self.at, tries=self.tries, since=self.since)


_CURRENT: ContextVar[tuple[Agent, str, asyncio.AbstractEventLoop] | None] = ContextVar(
    "bc_agent_command", default=None
)
_CHECK_TIMEOUT: Final = 1.0
"""A check the command queue does not answer this soon lets the try go: a cancel that cannot
reach the agent has not reached it (and an outage of the queue must not stop every BMC call)."""
_TRY_CHECK_FOR: Final = 1.0
"""How long a try's check answers for its first request (nothing sent to the machine between)."""


async def before_call(call: str, *, requests_checked: bool = False) -> None:
    """Before every try (and retry) of a call to a machine, in a command's handler: raises
    ``CommandCancelled`` once a cancel of the command reached the agent (it asks the command
    queue each time, and its heartbeats bring cancels too); records the try as the command's
    progress (``try 3: POST ComputerSystem.Reset``). Outside a handler it does nothing.

    ``requests_checked``: the try's client calls ``before_call_blocking`` before each of its
    requests, so the request that changes the machine asks the command queue, right before it
    goes; the try itself then asks nothing (it stops on a cancel the agent knows of). A try that
    only reads asks nothing at all, and one that changes asks once, not twice."""
    current = _CURRENT.get()
    if current is not None:
        agent, command_id, _loop = current
        await agent._before_call(command_id, call, requests_checked=requests_checked)


async def call_failed(kind: CallFailure, reason: str, *, at: str) -> None:
    """A try of a call to a machine failed and will be tried again (in a command's handler): the
    command's progress says so at once, with the tries that failed in a row and since when
    (``BMC unreachable at 10.0.0.5:443: connection refused, 12 tries since 04:31:02 UTC``), and
    the agent's status names it as its last error until the machine answers (``call_answered``).
    ``reason`` and ``at`` must hold no secret. Outside a handler it does nothing."""
    current = _CURRENT.get()
    if current is not None:
        agent, command_id, _loop = current
        agent._call_failed(command_id, kind, reason[:200], at[:200])


async def call_answered() -> None:
    """A call to the machine answered: the failures ``call_failed`` reported are over."""
    current = _CURRENT.get()
    if current is not None:
        agent, command_id, _loop = current
        agent._call_answered(command_id)


def before_call_blocking(call: str, *, changes: bool = True) -> None:
    """``before_call`` from a worker thread a handler runs blocking calls in (``asyncio.to_thread``
    keeps the command's context): before each request of a client library that sends several
    in one step (sushy reads a resource, then acts on it). ``changes=False``: a request that only
    reads (a GET): it stops on a cancel the agent knows of, but asks the command queue nothing
    (the next request that changes the machine asks)."""
    current = _CURRENT.get()
    if current is None:
        return
    agent, command_id, loop = current
    future = asyncio.run_coroutine_threadsafe(
        agent._before_call(command_id, call, request=True, changes=changes), loop
    )
    try:
        future.result(timeout=_CHECK_TIMEOUT + 1.0)
    except concurrent.futures.TimeoutError:
        future.cancel()  # the loop is too busy to say: the try goes, as when the queue is away


class CommandRejected(Exception):  # noqa: N818 - an outcome ("rejected"), not a program error
    """Raised by a handler that refuses a command; its state becomes ``rejected``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, kw_only=True)
class Command:
    """One command as a handler sees it."""

    id: str
    kind: str
    payload: Any
    node_id: str
    site_id: str
    key: str
    destructive: bool
    not_after: float
    """Seconds since the epoch after which the command queue no longer takes its result."""
    batch_id: str | None
    workflow_id: str | None
    step: int | None
    _agent: Agent = field(repr=False)

    async def progress(self, message: str | None = None, *, percent: float | None = None) -> None:
        """Tell the command queue how far the command got (fire-and-forget)."""
        await self._agent._progress(self.id, message, percent)


CommandHandler = Callable[[Command], Awaitable[Any]]


async def connect_waiting(
    url: str, *, name: str, log: Any, stop: asyncio.Event | None = None, **kwargs: Any
) -> Nats:
    """Connect to NATS, waiting out a server that is away with a jittered backoff: an agent
    never exits on an outage, however long. Only ``stop`` being set ends the wait
    (``UNAVAILABLE``); anything but an unreachable server is raised at once."""
    backoff = Backoff(first=0.5, cap=10.0)
    stop = stop or asyncio.Event()
    while True:
        try:
            return await connect(url, name=name, **kwargs)
        except BcError as err:
            if err.code is not ErrorCode.UNAVAILABLE or stop.is_set():
                raise
            delay = backoff.next()
            log.warning("nats_unreachable", error=err.message, retry_in_s=round(delay, 2))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await stop.wait()
        if stop.is_set():
            raise BcError(ErrorCode.UNAVAILABLE, "stopped before NATS answered")


class Agent:
    """An agent of the command queue: a site agent, or a node's bcd.

    Args:
        enrollment: who the agent is (``enroll`` / ``load_enrollment``).
        handlers: command kind -> handler.
        journal: a ``Journal`` or its file path; keep it on the agent's own disk.
        nats_url: connect to NATS here (the agent owns that connection); or pass ``nc``.
        nc: an open connection to use instead (the caller closes it).
        subjects: the deployment's subject root.
        max_concurrency: commands run at once.
        sign_results: sign results with the node key (default: when the agent is a node's
            bcd, role ``node`` or ``provisioned``); the result then counts as attested.
        request_timeout: seconds to wait for each answer of the command queue.
        status: called for each hello and heartbeat: what the agent says of itself (drivers,
            cache use, last error), shown by ``bcx agents list``.
    """

    def __init__(
        self,
        *,
        enrollment: Enrollment,
        handlers: Mapping[str, CommandHandler],
        journal: Journal | str | Path,
        nats_url: str | None = None,
        nc: Nats | None = None,
        subjects: Subjects | None = None,
        version: str = __version__,
        max_concurrency: int = 16,
        sign_results: bool | None = None,
        request_timeout: float = 5.0,
        fetch_timeout: float = FETCH_TIMEOUT_S,
        stop_grace: float = 10.0,
        status: Callable[[], AgentStatus] | None = None,
    ) -> None:
        if nc is None and nats_url is None:
            raise BcError(ErrorCode.INVALID_CONFIG, "give nats_url or nc", {"path": "nats_url"})
        self.enrollment = enrollment
        self.identity = enrollment.identity
        self.agent_id = enrollment.agent_id
        self.site_id = enrollment.site_id
        self.handlers = dict(handlers)
        self._journal_arg = journal
        self.journal: Journal | None = journal if isinstance(journal, Journal) else None
        self.nats_url = nats_url
        self.nc = nc
        self._own_nc = nc is None
        self.subjects = subjects or Subjects()
        self.version = version
        self.max_concurrency = max_concurrency
        self.sign_results = (
            enrollment.role in ("node", "provisioned") if sign_results is None else sign_results
        )
        self.request_timeout = request_timeout
        self.fetch_timeout = fetch_timeout
        self.stop_grace = stop_grace
        self.status = status
        self.incarnation = secrets.token_hex(8)
        self.log = get_logger(agent_id=self.agent_id, site_id=self.site_id)
        self.ready = asyncio.Event()
        """Set once the command queue answered hello and the agent pulls its commands."""
        self.boot_lease = False
        """Whether this agent holds its site's boot lease (as of the last heartbeat)."""
        self.heartbeat_ms = 5_000
        self.idle_heartbeat_ms = 0
        """A machine's agent with nothing to do heartbeats this often (the hello reply's; 0: an
        older queue, or a site agent: always ``heartbeat_ms``)."""
        self.next_heartbeat_ms = 0
        """The gap until the next heartbeat, as the last heartbeat announced it (0: none yet)."""
        self.ack_wait_s = 30.0
        self._work = asyncio.Event()
        """Set when work arrives (a delivery, a cancel, a re-run): an idle agent's long pause
        between heartbeats ends, and it heartbeats at the busy cadence."""
        self._hello: HelloReply | None = None
        self._psub: Any = None
        self._stop = asyncio.Event()
        self._rehello = asyncio.Event()
        self._active: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._commands: set[asyncio.Task[None]] = set()
        """The tasks of ``_tasks`` that handle a delivered command: ``max_concurrency`` counts
        these alone. A command's progress word waiting its turn is a task too (``_say``), and it
        took a command's place: a site agent of 100 machines ran fewer than its 16 at once."""
        self._stopped = False
        self._runs: dict[str, _Run] = {}
        self._told_cancel: set[str] = set()
        """Commands the command queue said were cancelled after this agent claimed them."""

    # -- lifecycle ------------------------------------------------------------------

    async def __aenter__(self) -> Agent:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Open the journal and the NATS connection; ``run()`` does the rest."""
        if self.journal is None:
            self.journal = Journal(self._journal_arg)  # type: ignore[arg-type]
        if self.nc is None:
            assert self.nats_url is not None
            self.nc = await self._connect_nats(self.nats_url)
        elif not when_reconnected(self.nc, self._on_reconnect):
            # a connection we cannot hear reconnect on: a pull the restarted server forgot
            # ends by itself soon (a long one would leave the agent deaf that long)
            self.fetch_timeout = min(self.fetch_timeout, 1.0)

    async def _connect_nats(self, url: str) -> Nats:
        return await connect_waiting(
            url, name=f"bc-agent:{self.agent_id}", log=self.log, stop=self._stop,
            reconnected_cb=self._on_reconnect,
        )  # fmt: skip

    async def _on_reconnect(self) -> None:
        # The server may have come back without our consumer (or stream): say hello again.
        self._rehello.set()

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        """Serve until ``request_stop()`` or ``stop()``."""
        try:
            await self._connect_commands()
        except BcError:
            if self._stop.is_set():
                return
            raise
        await self._settle_journal()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._heartbeats(), name="agent-heartbeats")
            tg.create_task(self._pull(), name="agent-pull")
            await self._stop.wait()

    async def stop(self) -> None:
        """Let running commands finish within the grace, say goodbye, close. Safe twice."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        if self._tasks:
            _done, pending = await asyncio.wait(set(self._tasks), timeout=self.stop_grace)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=2.0)
        if self.nc is not None and self.nc.is_connected and self._hello is not None:
            with contextlib.suppress(Exception):
                await self._request("heartbeat", self._heartbeat(leaving=True), timeout=1.0)
        if self._psub is not None:
            with contextlib.suppress(Exception):
                await self._psub.unsubscribe()
        if self._own_nc and self.nc is not None and not self.nc.is_closed:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await self.nc.close()
        if self.journal is not None and not isinstance(self._journal_arg, Journal):
            self.journal.close()
        self.log.info("agent_stopped")

    # -- talking to the command queue --------------------------------------------------

    def _base(self) -> dict[str, Any]:
        return {
            "site": self.site_id,
            "agent": self.agent_id,
            "signer_id": self.identity.cert_id,
            "signed_at_ms": time.time_ns() // 1_000_000,
        }

    def _heartbeat(self, *, leaving: bool = False) -> Heartbeat:
        return Heartbeat(
            **self._base(),
            incarnation=self.incarnation,
            running=len(self._active),
            leaving=leaving,
            status=self._status(),
            journal_id=self.journal.id if self.journal is not None else "",
            next_heartbeat_ms=self.next_heartbeat_ms,
        )

    def idle(self) -> bool:
        """Nothing live here: no command being claimed, run or reported, no task of ours (a
        cancel, a re-run), nothing in the journal left to report."""
        if self._active or self._tasks or self._runs:
            return False
        return self.journal is None or not self.journal.unsettled()

    def _cadence_ms(self) -> int:
        """The gap until the next heartbeat: ``idle_heartbeat_ms`` for a machine's agent with
        nothing to do, else ``heartbeat_ms``. A site agent keeps ``heartbeat_ms``: it renews its
        site's boot lease and takes the site's commands."""
        if (
            self.idle_heartbeat_ms > self.heartbeat_ms
            and self.enrollment.role in ("node", "provisioned")
            and self.idle()
        ):
            return self.idle_heartbeat_ms
        return self.heartbeat_ms

    def _status(self) -> AgentStatus | None:
        """What the agent says of itself (its ``status`` callable); never fails a heartbeat."""
        if self.status is None:
            return None
        try:
            return self.status()
        except Exception:
            self.log.exception("agent_status_failed")
            return None

    async def _request(self, kind: str, event: AgentEvent, *, timeout: float | None = None) -> Any:
        """Send a signed event and return the reply's result; raises ``BcError``."""
        assert self.nc is not None
        subject = self.subjects.agent_event(self.site_id, self.agent_id, kind)
        try:
            msg = await self.nc.request(
                subject, sign_event(self.identity, kind, event), timeout=timeout or self.request_timeout
            )
        except nats.errors.NoRespondersError as exc:
            raise BcError(ErrorCode.UNAVAILABLE, "no command queue answers") from exc
        except (nats.errors.TimeoutError, TimeoutError) as exc:
            raise BcError(ErrorCode.TIMEOUT, f"no answer to {kind}") from exc
        except nats.errors.Error as exc:
            raise BcError(ErrorCode.UNAVAILABLE, f"NATS: {type(exc).__name__}") from exc
        return unwrap(msg.data)

    async def _store_result(self, event: Result, subject: str, stream: str) -> None:
        """Store a signed result in the site's results stream on the leaf (the command queue's
        hello named it: the site's streams live on its leaf node). The leaf's JetStream
        acknowledges it whether its link to the hub is up or not; the queue reads it from
        there. The message id is the command's and journal's: storing it again (a retry whose
        acknowledgement was lost) adds nothing. Raises ``BcError`` ``UNAVAILABLE`` when the
        leaf does not take it (tried again)."""
        assert self.nc is not None
        headers = {"Nats-Msg-Id": f"{event.command_id}:{event.journal_id}"}
        try:
            await self.nc.jetstream().publish(
                subject, sign_event(self.identity, "result", event), stream=stream, headers=headers,
                timeout=self.request_timeout,
            )  # fmt: skip
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            raise BcError(ErrorCode.UNAVAILABLE, f"the site's results stream: {type(exc).__name__}") from exc

    async def _publish(self, kind: str, event: AgentEvent) -> None:
        assert self.nc is not None
        subject = self.subjects.agent_event(self.site_id, self.agent_id, kind)
        with contextlib.suppress(nats.errors.Error):
            await self.nc.publish(subject, sign_event(self.identity, kind, event))

    async def _retrying(self, what: str, call: Callable[[], Awaitable[Any]]) -> Any:
        """``call()`` until it answers. Waits out an absent command queue and a certificate still
        ``pending``; gives up with ``_Later`` after a few ``INTERNAL`` answers; raises any other
        refusal."""
        backoff = Backoff(first=0.2, cap=2.0)
        pending = Backoff(first=_PENDING_FIRST_S, cap=_PENDING_PAUSE_S)
        internal = 0
        while True:
            pause = backoff.next()
            try:
                return await call()
            except BcError as err:
                if err.reason == "cert-pending":
                    pause = pending.next()  # the node's next step waits for this: 10 s at most
                if err.code is ErrorCode.INTERNAL:
                    internal += 1
                    if internal >= _INTERNAL_TRIES:
                        raise _Later from err
                elif err.code not in _WAIT_FOR and err.reason != "cert-pending":
                    # cert-pending: joined with a held token whose boot entry has not closed
                    # clean yet (docs/security.md); the command queue hears us once it has
                    raise
                if self._stop.is_set():
                    raise _Stopping from err
                self.log.debug("agent_request_retry", what=what, code=err.code.value)
            await asyncio.sleep(pause)

    async def _connect_commands(self) -> None:
        """Say hello until the command queue answers, then bind to our consumer."""

        async def hello() -> HelloReply:
            event = Hello(
                **self._base(),
                version=self.version,
                kinds=sorted(self.handlers),
                incarnation=self.incarnation,
                status=self._status(),
                journal_id=self.journal.id if self.journal is not None else "",
                # a hello again (a reconnect) may fall in an idle agent's long pause
                next_heartbeat_ms=self.next_heartbeat_ms,
            )
            return msgspec.convert(await self._request("hello", event), HelloReply)

        try:
            reply: HelloReply = await self._retrying("hello", hello)
        except (_Stopping, _Later) as exc:
            raise BcError(ErrorCode.UNAVAILABLE, "stopped before the command queue answered") from exc
        self._hello = reply
        self.heartbeat_ms = reply.heartbeat_ms
        self.idle_heartbeat_ms = reply.idle_heartbeat_ms or 0
        self.ack_wait_s = reply.ack_wait_ms / 1000
        self.boot_lease = reply.boot_lease
        assert self.nc is not None
        if self._psub is not None:
            with contextlib.suppress(Exception):
                await self._psub.unsubscribe()
        js = self.nc.jetstream()
        self._psub = await js.pull_subscribe_bind(durable=reply.consumer, stream=reply.stream)
        self._rehello.clear()
        if not self.ready.is_set():
            self.log.info("agent_connected", stream=reply.stream, boot_lease=reply.boot_lease)
        self.ready.set()

    async def _heartbeats(self) -> None:
        """Every ``heartbeat_ms``, or every ``idle_heartbeat_ms`` while a machine's agent has
        nothing to do; each says the gap until the next (the queue counts the agent's silence
        from it). Work arriving during an idle pause cuts it to ``heartbeat_ms`` from the last
        heartbeat: from then on the agent heartbeats, and hears cancels, as a busy one does."""
        gap_ms = self.heartbeat_ms  # the hello said no longer gap
        while not self._stop.is_set():
            await self._pause(time.monotonic(), gap_ms)
            if self._stop.is_set():
                return
            self._work.clear()  # work arriving from here on wakes the next pause
            gap_ms = self.next_heartbeat_ms = self._cadence_ms()
            try:
                got = msgspec.convert(await self._request("heartbeat", self._heartbeat()), HeartbeatReply)
                self.boot_lease = got.boot_lease
                if got.cancel:
                    self._spawn(self._cancel_reached(got.cancel, via="heartbeat"))
            except BcError as err:
                self.log.debug("heartbeat_failed", code=err.code.value)
                gap_ms = self.heartbeat_ms  # unheard: the next one comes soon, as before
                if err.code is ErrorCode.NOT_FOUND:
                    self._rehello.set()  # the command queue forgot us: announce again

    async def _pause(self, since: float, gap_ms: int) -> None:
        """Until ``gap_ms`` after ``since``, or ``heartbeat_ms`` after it once work arrives
        (at once if that is past), or a stop."""
        deadline = since + gap_ms / 1000
        busy = since + self.heartbeat_ms / 1000
        while not self._stop.is_set():
            if self._work.is_set():
                deadline = min(deadline, busy)
            left = deadline - time.monotonic()
            if left <= 0:
                return
            waits = {asyncio.ensure_future(self._stop.wait())}
            if deadline > busy:
                waits.add(asyncio.ensure_future(self._work.wait()))
            try:
                await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()

    # -- cancels -------------------------------------------------------------------------

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._work.set()

    async def _cancel_reached(self, command_ids: list[str], *, via: str) -> None:
        """The command queue says these commands of ours were cancelled: a running one stops
        at its next try; one that never started here never will, and the agent says so."""
        journal = self.journal
        assert journal is not None
        for command_id in command_ids:
            if command_id not in self._told_cancel:
                self.log.info("command_cancel_reached", command_id=command_id, via=via)
            self._told_cancel.add(command_id)
            run = self._runs.get(command_id)
            if run is not None:
                run.cancelled = True
                continue
            try:
                if await journal.cancelled(command_id):
                    self.log.info("command_cancelled_unstarted", command_id=command_id)
                entry = journal.get(command_id)
                if entry is not None and entry.state == "finished":
                    await self._report_entry(command_id)
            except Exception:
                self.log.exception("command_cancel_failed", command_id=command_id)

    async def _before_call(
        self,
        command_id: str,
        call: str,
        *,
        request: bool = False,
        changes: bool = True,
        requests_checked: bool = False,
    ) -> None:
        """``request``: before one request of a try (``before_call_blocking``), else before the
        try. A try's first request that changes the machine takes the answer of the try's own
        check when that is at most ``_TRY_CHECK_FOR`` old, rather than asking the command queue
        twice within a second; every later one asks again. A request that only reads
        (``changes=False``) asks nothing and leaves the try's check to the next: a read that
        reaches the machine after a cancel changes nothing there, and a cancel the agent knows
        of stops it all the same. Each read asked before: a Redfish action is a GET or three,
        then the POST or PATCH (deploy: 19 checks for 5 commands, bench_fleet --agent-events).
        The command's first try takes its claim's answer when that is at most
        ``_TRY_CHECK_FOR`` old (``_Run.claimed``). A try whose requests are checked
        (``requests_checked``) asks nothing: its first request that changes the machine asks
        (or takes the claim's answer, when that is still at most ``_TRY_CHECK_FOR`` old then).
        Under load a try's requests wait for a worker thread, and a try's check was often more
        than a second old when its request went: two checks for one request."""
        run = self._runs.get(command_id)
        if run is None:
            return
        run.tries += 1
        run.last_call = call
        if not run.cancelled and command_id in self._told_cancel:
            run.cancelled = True
        reads = request and not changes
        checked = run.try_checked
        if not reads:
            run.try_checked = None
        now = time.monotonic()
        fresh = request and checked is not None and now - checked <= _TRY_CHECK_FOR
        if not request and run.claimed is not None and now - run.claimed <= _TRY_CHECK_FOR:
            # the first try within a second of the claim: the claim said "not cancelled" then,
            # as a check would have; the try's first request takes it as the try's own answer
            fresh, run.try_checked = True, run.claimed
        if not reads:
            run.claimed = None  # the first try's (or first change's) only
        if requests_checked and not request:
            # its first changing request asks, or takes the claim's answer if still fresh then
            fresh = True
        if not run.cancelled and not fresh and not reads:
            try:
                got = await self._request(
                    "check", Check(**self._base(), command_ids=[command_id]), timeout=_CHECK_TIMEOUT
                )
                if command_id in msgspec.convert(got, CheckReply).stop:
                    self.log.info("command_cancel_reached", command_id=command_id, via="check")
                    run.cancelled = True
                elif not request:
                    run.try_checked = time.monotonic()
            except (BcError, msgspec.ValidationError) as err:
                self.log.debug("command_check_failed", command_id=command_id, error=str(err))
        if run.cancelled:
            raise CommandCancelled(f"cancelled: stopped before try {run.tries} ({call})")
        if run.failure is None:  # while the calls fail, the progress says that
            self._say(command_id, run, f"try {run.tries}: {call}"[:500], every=TRY_WORD_INTERVAL)

    def _call_failed(self, command_id: str, kind: CallFailure, reason: str, at: str) -> None:
        run = self._runs.get(command_id)
        if run is None:
            return
        failure = run.failure
        if failure is None or (failure.kind, failure.reason, failure.at) != (kind, reason, at):
            since = failure.since if failure is not None else time.time()
            tries = failure.tries if failure is not None else 0
            failure = run.failure = _Failure(kind=kind, reason=reason, at=at, tries=tries, since=since)
        failure.tries += 1
        self._say(command_id, run, failure.text())

    def _call_answered(self, command_id: str) -> None:
        run = self._runs.get(command_id)
        if run is None or run.failure is None:
            return
        run.failure = None
        self._say(command_id, run, f"try {run.tries}: {run.last_call or 'answered'} (it answers again)"[:500])

    def call_failures(self) -> list[tuple[str, float]]:
        """The commands running now whose calls to their machine fail: each one's progress text
        and when its failures began (seconds since the epoch), newest first."""
        found = [(r.failure.text(), r.failure.since) for r in self._runs.values() if r.failure is not None]
        return sorted(found, key=lambda f: -f[1])

    def _say(self, command_id: str, run: _Run, message: str, *, every: float = PROGRESS_INTERVAL) -> None:
        """The command's progress, at most one event per ``every`` seconds after the last: a word
        that comes sooner waits for its turn, and the latest word waiting is the one that goes
        (news, ``every=PROGRESS_INTERVAL``, brings a slower word's turn forward)."""
        run.saying = message
        due = run.said_at + every
        if run.flush_due is not None and run.flush_due <= due:
            return  # a turn comes as soon: it sends this word
        wait = due - time.monotonic()
        if wait <= 0:
            run.flush_due = None
            self._flush(command_id, run)
            return
        run.flush_due = due

        async def later() -> None:
            await asyncio.sleep(wait)
            if run.flush_due != due:
                return  # a sooner turn came instead
            run.flush_due = None
            if self._runs.get(command_id) is run:
                self._flush(command_id, run)

        self._spawn(later())

    def _flush(self, command_id: str, run: _Run) -> None:
        message, run.saying = run.saying, None
        if message is not None:
            run.said_at = time.monotonic()
            self._spawn(self._progress(command_id, message, None))

    # -- pulling and running commands ------------------------------------------------

    async def _pull(self) -> None:
        idle = 0.0
        while not self._stop.is_set():
            if self._rehello.is_set():
                try:
                    await self._connect_commands()
                except BcError:
                    await asyncio.sleep(0.5)
                    continue
            free = self.max_concurrency - len(self._commands)
            if free <= 0:
                await asyncio.wait(set(self._commands), return_when=asyncio.FIRST_COMPLETED)
                continue
            try:
                msgs = await self._fetch(min(free, 32))
            except (TimeoutError, nats.errors.TimeoutError):
                idle += self.fetch_timeout
                if idle >= 30.0:
                    idle = 0.0
                    await self._check_consumer()
                continue
            except (nats.errors.Error, nats.js.errors.Error) as exc:
                if self._stop.is_set():
                    return
                self.log.info("agent_pull_failed", error=type(exc).__name__)
                self._rehello.set()
                await asyncio.sleep(0.5)
                continue
            idle = 0.0
            for msg in msgs:
                task = asyncio.create_task(self._handle(msg), name="agent-command")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                self._commands.add(task)
                task.add_done_callback(self._commands.discard)
            if msgs:
                self._work.set()  # an idle agent's heartbeats take the busy cadence at once

    async def _fetch(self, batch: int) -> list[Msg]:
        """One long poll of our consumer: its messages as soon as there are any (the server
        answers a waiting pull at once), else ``TimeoutError`` after ``fetch_timeout``. A
        reconnect (the server may have forgotten the waiting pull), a lost consumer or a stop
        cuts the poll short (``TimeoutError`` then too), so a long ``fetch_timeout`` costs
        neither latency nor a slow stop: it only spares an idle agent's pulls (two JetStream
        requests each, the no-wait probe and the waiting pull)."""
        fetch = asyncio.ensure_future(self._psub.fetch(batch=batch, timeout=self.fetch_timeout))
        cuts = [asyncio.ensure_future(self._rehello.wait()), asyncio.ensure_future(self._stop.wait())]
        try:
            await asyncio.wait({fetch, *cuts}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for cut in cuts:
                cut.cancel()
            if not fetch.done():
                fetch.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await fetch
        if fetch.cancelled():
            raise TimeoutError
        return fetch.result()  # type: ignore[no-any-return]

    async def _check_consumer(self) -> None:
        """After a long idle pull: is our consumer still there? Only a server that says it is
        gone makes the agent say hello again. A busy or absent one is asked again at the next
        idle probe: a hello for each unanswered probe made a JetStream API queue full of
        requests fuller (each hello asks nats-server for the consumer again), and ten thousand
        machines waiting kept it full (bench/README.md "Agent events shed"); a reconnect says
        hello anyway, and a pull from a lost consumer fails."""
        try:
            await self._psub.consumer_info()
        except nats.js.errors.NotFoundError:
            self._rehello.set()
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            self.log.debug("agent_consumer_check_failed", error=type(exc).__name__)

    async def _handle(self, msg: Msg) -> None:
        journal = self.journal
        assert journal is not None
        try:
            delivery = msgspec.json.decode(msg.data, type=CommandDelivery)
        except (msgspec.MsgspecError, RecursionError):  # nested past what the decoder can hold
            self.log.warning("delivery_malformed")
            await _ack(msg)
            return
        if delivery.agent_id != self.agent_id or delivery.site_id != self.site_id:
            self.log.warning("delivery_not_ours", command_id=delivery.id)
            await _ack(msg)
            return
        if delivery.id in self._active:
            await _in_progress(msg)  # another delivery of it is being handled right here
            return
        self._active.add(delivery.id)
        try:
            await self._handle_once(delivery, msg, journal)
        except Exception:
            # Unacknowledged, the message comes again after the ack wait; the journal decides.
            self.log.exception("command_handling_failed", command_id=delivery.id)
        finally:
            self._active.discard(delivery.id)

    async def _handle_once(self, delivery: CommandDelivery, msg: Msg, journal: Journal) -> None:
        log = self.log.bind(command_id=delivery.id, kind=delivery.kind)
        entry = journal.get(delivery.id)
        if entry is not None and entry.state in ("reported", "refused"):
            await _ack(msg)  # a duplicate delivery: done already
            return
        if entry is not None and entry.state == "started":
            # Started by an earlier process of this agent, which died while running it.
            if await self._interrupted(delivery.id):
                await _ack(msg)
            return
        if entry is not None and entry.state == "finished":
            if await self._report_entry(delivery.id):
                await _ack(msg)
            return
        not_after = delivery.not_after_ms / 1000
        if time.time() >= not_after:
            await journal.refused(delivery.id, kind=delivery.kind, not_after=not_after, reason="expired")
            await _ack(msg)
            return
        # Journaled before the claim goes (not synced on its own: it survives this process's
        # crash), with the id the claim names: a claim again (its answer lost, or this process
        # died before it journaled the start) names the same id and is taken again. Taken, the
        # claim marks the command running at the queue: no running mark. A claim of this journal
        # under another id (the entry lost with the machine's power, or the journal restored
        # from an older copy) is refused `running`.
        claim_id = await journal.claiming(delivery.id, kind=delivery.kind, not_after=not_after)
        if claim_id is None:
            return  # the journal knows it otherwise since it was read above: its delivery decides
        try:
            refusal, marked = await self._claim(delivery, msg, journal, claim_id)
            claimed = time.monotonic()  # when the queue's answer came (only its "proceed" is used)
        except (_Stopping, _Later):
            return  # journaled claiming, not acknowledged: it is claimed again later
        if refusal is not None:
            reason, final = refusal
            if reason == "running":
                # This journal claimed it and has no entry of it: it may have started. As a
                # command an earlier process started: run again if idempotent, else interrupted.
                await self._lost_claim(delivery, msg, journal, not_after)
                return
            if reason == "cancelling":
                # Cancelled after a claim of ours: say that it never started here.
                await self._cancel_reached([delivery.id], via="claim")
                await _ack(msg)
                return
            if final:
                await journal.refused(delivery.id, kind=delivery.kind, not_after=not_after, reason=reason)
            else:
                # Not final: the command waits (for its batch's approval, or to be handed to this
                # agent) and comes in a new delivery, which is claimed afresh. The claim was not
                # taken, so its entry goes (a forged delivery leaves nothing behind).
                await journal.unclaimed(delivery.id)
            await _ack(msg)
            return
        kill_point(CLAIMED)
        # Durable before the handler runs: from here on, this command never runs again.
        if not await journal.started(
            delivery.id, kind=delivery.kind, not_after=not_after, delivery=bytes(msg.data)
        ):
            return
        kill_point(JOURNALED)
        await self._execute(delivery, msg, log, claimed=claimed, mark=not marked)
        kill_point(RAN)
        if await self._report_entry(delivery.id):
            await _ack(msg)

    async def _lost_claim(
        self, delivery: CommandDelivery, msg: Msg, journal: Journal, not_after: float
    ) -> None:
        """The command queue says this journal claimed the command under another claim id than
        the journal has: the journal lost the entry (the machine lost power before it was
        synced) or was restored from an older copy. Either way it may have started here:
        journaled started, it goes the way of a command an earlier process started (run again
        when the kind is idempotent and the queue agrees, else reported interrupted)."""
        self.log.warning("command_claimed_unjournaled", command_id=delivery.id, kind=delivery.kind)
        if await journal.started(
            delivery.id, kind=delivery.kind, not_after=not_after, delivery=bytes(msg.data)
        ):
            entry = journal.get(delivery.id)
            if entry is not None:
                await self._rerun_or_interrupt(entry)
        entry = journal.get(delivery.id)
        if entry is not None and entry.state == "reported":
            await _ack(msg)

    async def _claim(
        self, delivery: CommandDelivery, msg: Msg, journal: Journal, claim_id: str
    ) -> tuple[tuple[str, bool] | None, bool]:
        """Ask the command queue whether to run it: None to proceed, else why not and whether
        that is final (journaled) or only for now; and whether the claim marked it running (a
        queue that knows claim ids; an older one leaves that to the agent's first progress)."""

        async def ack() -> AckReply:
            event = Ack(
                **self._base(),
                command_id=delivery.id,
                digest=payload_digest(delivery.kind, bytes(delivery.payload)),
                journal_id=journal.id,
                claim_id=claim_id,
            )
            return msgspec.convert(await self._request("ack", event), AckReply)

        async def keep_message() -> None:
            # Claims can wait on an unreachable command queue; keep JetStream from
            # redelivering the message meanwhile.
            while True:
                await asyncio.sleep(max(self.ack_wait_s / 3, 1.0))
                await _in_progress(msg)

        keeper = asyncio.create_task(keep_message())
        try:
            reply: AckReply = await self._retrying("ack", ack)
        except BcError as err:
            self.log.warning("command_claim_refused", command_id=delivery.id, code=err.code.value)
            return (f"claim refused: {err.code.value}", True), False
        finally:
            keeper.cancel()
        if reply.proceed:
            return None, reply.state == "running"
        self.log.info(
            "command_not_claimed",
            command_id=delivery.id,
            state=reply.state,
            reason=reply.reason,
            again=reply.again,
        )
        reason = reply.reason or reply.state or "refused"
        return (reason, not reply.again and reason not in _NOT_FINAL), False

    async def _execute(
        self,
        delivery: CommandDelivery,
        msg: Msg | None,
        log: Any,
        *,
        claimed: float | None = None,
        mark: bool = True,
    ) -> None:
        """Run the command's handler and journal its end. ``claimed``: when (monotonic) the
        command queue let this agent claim it (``_Run.claimed``). ``mark``: send the ``running``
        mark first (the claim did not set it: an older queue, or a re-run)."""
        assert self.journal is not None
        if mark:
            await self._progress(delivery.id, None, None)
        handler = self.handlers.get(delivery.kind)
        status = "succeeded"
        reason: str | None = None
        result = b""
        keeper = asyncio.create_task(self._keep_in_progress(msg)) if msg is not None else None
        t0 = time.monotonic()
        run = self._runs[delivery.id] = _Run.starting(
            cancelled=delivery.id in self._told_cancel, claimed=claimed
        )
        token = _CURRENT.set((self, delivery.id, asyncio.get_running_loop()))
        try:
            if run.cancelled:
                raise CommandCancelled("cancelled: stopped before it started")
            if handler is None:
                raise CommandRejected(f"unsupported-kind: this agent does not run {delivery.kind}")
            command = Command(
                id=delivery.id,
                kind=delivery.kind,
                payload=msgspec.json.decode(delivery.payload),
                node_id=delivery.node_id,
                site_id=delivery.site_id,
                key=delivery.key,
                destructive=delivery.destructive,
                not_after=delivery.not_after_ms / 1000,
                batch_id=delivery.batch_id,
                workflow_id=delivery.workflow_id,
                step=delivery.step,
                _agent=self,
            )
            result = _as_bytes(await handler(command))
            if len(result) > MAX_RESULT_BYTES:
                status, reason, result = "failed", "result-too-large", b""
        except CommandRejected as exc:
            status, reason = "rejected", exc.reason[:500]
        except CommandCancelled as exc:
            status, reason = "rejected", str(exc)[:500]
        except asyncio.CancelledError:
            raise
        except BcError as exc:
            status, reason = "failed", f"{exc.code.value}: {exc.message}"[:500]
        except Exception as exc:
            status, reason = "failed", f"{type(exc).__name__}: {exc}"[:500]
        finally:
            _CURRENT.reset(token)
            self._runs.pop(delivery.id, None)
            if keeper is not None:
                keeper.cancel()
        signature = None
        if self.sign_results and delivery.node_id == self.agent_id:
            signature = sign_bytes(
                self.identity.private_key,
                result_document(
                    command_id=delivery.id, node_id=delivery.node_id, status=status, result=result
                ),
            )
        await self.journal.finished(
            delivery.id, status=status, reason=reason, result=result, signature=signature
        )
        log.info(
            "command_finished",
            status=status,
            reason=reason,
            ms=round((time.monotonic() - t0) * 1000, 1),
        )

    async def _rerun(self, entry: JournalEntry) -> bool | None:
        """A command an earlier process started and never finished, whose delivery the journal
        kept: when the command queue says it may (an idempotent kind, still this journal's,
        live, not cancelled), run it again; False when it may not; None when the queue could
        not say before the agent stopped (the next start asks again)."""
        assert self.journal is not None
        assert entry.delivery is not None
        try:
            delivery = msgspec.json.decode(entry.delivery, type=CommandDelivery)
        except msgspec.MsgspecError:
            return False

        async def ack() -> AckReply:
            event = Ack(
                **self._base(),
                command_id=delivery.id,
                digest=payload_digest(delivery.kind, bytes(delivery.payload)),
                journal_id=self.journal.id if self.journal is not None else "",
                rerun=True,
            )
            return msgspec.convert(await self._request("ack", event), AckReply)

        try:
            reply: AckReply = await self._retrying("rerun", ack)
        except (_Stopping, _Later):
            return None
        except BcError:
            return False
        if not reply.proceed or not reply.rerun:
            if reply.reason == "cancelling":
                await self.journal.finished(
                    delivery.id,
                    status="rejected",
                    reason="cancelled: not run again after the agent stopped while it ran",
                    result=b"",
                    signature=None,
                )
                return True
            self.log.info("command_not_rerun", command_id=delivery.id, reason=reply.reason)
            return False
        log = self.log.bind(command_id=delivery.id, kind=delivery.kind)
        log.warning("command_rerun", reason="the agent stopped while it ran; the kind is idempotent")
        await self._execute(delivery, None, log)
        return True

    async def _rerun_or_interrupt(self, entry: JournalEntry) -> None:
        """At start, beside the heartbeats (a re-run may wait on its BMC until its deadline):
        run it again if the command queue lets it, else report it interrupted."""
        try:
            ran = await self._rerun(entry)
            if ran:
                await self._report_entry(entry.id)
            elif ran is False:
                await self._interrupted(entry.id)
        except Exception:
            self.log.exception("command_rerun_failed", command_id=entry.id)
        finally:
            self._active.discard(entry.id)

    async def _keep_in_progress(self, msg: Msg) -> None:
        while True:
            await asyncio.sleep(max(self.ack_wait_s / 3, 1.0))
            await _in_progress(msg)

    async def _progress(self, command_id: str, message: str | None, percent: float | None) -> None:
        await self._publish(
            "progress",
            Progress(**self._base(), command_id=command_id, message=message, percent=percent),
        )

    async def _interrupted(self, command_id: str) -> bool:
        """A command an earlier process started and never finished: never run it again."""
        assert self.journal is not None
        await self.journal.finished(
            command_id,
            status="failed",
            reason="interrupted: the agent stopped while the command ran",
            result=b"",
            signature=None,
        )
        self.log.warning("command_interrupted", command_id=command_id)
        return await self._report_entry(command_id)

    async def _report_entry(self, command_id: str) -> bool:
        """Report a finished command's result; False when it must be reported later."""
        assert self.journal is not None
        entry = self.journal.get(command_id)
        if entry is None or entry.state != "finished":
            return entry is not None and entry.state == "reported"

        async def report() -> ResultReply:
            event = Result(
                **self._base(),
                command_id=command_id,
                status=entry.status or "failed",  # type: ignore[arg-type]
                reason=entry.reason,
                result=entry.result or b"",
                result_signature=entry.signature,
                journal_id=self.journal.id if self.journal is not None else "",
            )
            hello = self._hello
            if hello is not None and hello.results_subject and hello.results_stream:
                await self._store_result(event, hello.results_subject, hello.results_stream)
                return ResultReply(recorded=True, state="stored")
            return msgspec.convert(await self._request("result", event), ResultReply)

        try:
            reply: ResultReply = await self._retrying("result", report)
        except (_Stopping, _Later):
            return False  # still "finished" in the journal: its next delivery or start reports it
        except BcError as err:
            # Refused for good (the command is unknown there, or not ours): nobody to tell.
            self.log.warning("result_refused", command_id=command_id, code=err.code.value)
            await self.journal.reported(command_id)
            return True
        await self.journal.reported(command_id)
        self._told_cancel.discard(command_id)
        if not reply.recorded:
            self.log.info("result_not_recorded", command_id=command_id, state=reply.state)
        return True

    async def _settle_journal(self) -> None:
        """At start: report what an earlier process finished, and fail what it left running."""
        assert self.journal is not None
        for entry in self.journal.unsettled():
            if entry.state == "started" and entry.delivery is not None:
                self._active.add(entry.id)  # a delivery of it meanwhile waits for this
                self._spawn(self._rerun_or_interrupt(entry))
            elif entry.state == "started":
                await self._interrupted(entry.id)
            else:
                await self._report_entry(entry.id)


def _as_bytes(value: Any) -> bytes:
    if value is None:
        return b""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    return encode(value)


async def _ack(msg: Msg) -> None:
    with contextlib.suppress(Exception):
        await msg.ack()


async def _in_progress(msg: Msg) -> None:
    with contextlib.suppress(Exception):
        await msg.in_progress()
