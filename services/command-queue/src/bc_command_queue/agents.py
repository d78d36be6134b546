"""Agents: their signed events and the agent routes.

Each event is checked against its signer's certificate, decoded once into the event union
(``wire.agent.AnyAgentEvent``) and dispatched with ``match``: presence (hello, heartbeat) is
here with the checks before an agent's tries (check), claims (ack) in ``claims.py``, runs
(progress, result) in ``runs.py``. Each is applied by
compare-and-set on the command's state, so a duplicate or late event changes nothing.

Under an overload the queue sheds what nobody waits for any more, never heartbeats or progress
(``_NEVER_SHED``): an event
that has not reached the store ``agent_event_wait_ms`` after it arrived is answered
``UNAVAILABLE`` (``busy``) without being applied, and past ``agent_events_max`` events in hand
a new one is answered so at once, before its signature is checked. Its agent asks again after a
pause (``AgentRunner._retrying``); without this, each retry of an agent that heard nothing in its
request timeout added one more event to a backlog the store worked through in order, answering
events whose senders had stopped listening (bench/README.md, "Agent events shed").
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Coroutine
from typing import Any, Final

import asyncpg
import msgspec
import nats.errors
from nats.aio.msg import Msg

from better_compute.backoff import Backoff
from better_compute.clients.pki import PkiClient
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import parse_id
from better_compute.service import ApiRequest
from better_compute.service.groups import LateError, slot_by
from better_compute.wire import encode_error, encode_ok
from better_compute.wire.agent import (
    EVENT_KINDS,
    Ack,
    AnyAgentEvent,
    Check,
    CheckReply,
    Heartbeat,
    HeartbeatReply,
    Hello,
    HelloReply,
    Progress,
    Result,
    open_event,
    read_event,
)
from better_compute.wire.cmdq import (
    MAX_STATUS_DRIVER_CHARS,
    MAX_STATUS_DRIVERS,
    MAX_STATUS_ERROR_CHARS,
    AgentList,
    AgentStatus,
    ListAgents,
    SiteAgentReply,
    SiteAgentRequest,
)
from better_compute.wire.paging import decode_cursor, take_page

from . import metrics
from .claims import Claims
from .commands import check_name, invalid
from .config import CmdqConfig
from .delivery import Changed, Deliveries, Streams
from .presence import Presence
from .runs import Runs
from .signers import Signer, Signers
from .storage import AgentHello, Store
from .sweeper import DispatchPending
from .views import agent_view

__all__ = ["Agents"]

_DB_ERRORS: Final = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    OSError,
)

_BUSY: Final = BcError(ErrorCode.UNAVAILABLE, "the command queue is busy: ask again", {"reason": "busy"})
_NEVER_SHED: Final = frozenset({"heartbeat", "progress"})
"""A site agent's heartbeat late by ``silent_after`` hands its site's commands to nobody; a
progress is sent once and never again (the first is the command's ``running`` mark)."""
_SHED_LOG_S: Final = 10.0
"""Shed events are counted (``bc_agent_events_shed_total``) and logged at most this often."""

Spawn = Callable[[Coroutine[Any, Any, None]], None]
"""Run a coroutine as a task the service waits for when it stops."""


class Agents:
    """Agent events and the ``agents.*`` routes."""

    def __init__(
        self,
        *,
        store: Store,
        config: CmdqConfig,
        streams: Streams,
        deliveries: Deliveries,
        pki: PkiClient,
        signers: Signers,
        changed: Changed,
        dispatch_pending: DispatchPending,
        spawn: Spawn,
        log: Any,
        reruns: Callable[[str, Any], bool] = lambda _kind, _payload: False,
        presence: Presence | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.streams = streams
        self.deliveries = deliveries
        self.pki = pki
        self.signers = signers
        self.changed = changed
        self.dispatch_pending = dispatch_pending
        self.spawn = spawn
        self.log = log
        self._slots = asyncio.Semaphore(config.agent_event_slots)
        self.claims = Claims(
            store=store, config=config, changed=changed, log=log, reruns=reruns, slots=self._slots
        )
        self.runs = Runs(store=store, pki=pki, changed=changed, log=log, slots=self._slots)
        self.presence = presence if presence is not None else Presence(store=store, config=config, log=log)
        self.in_hand = 0
        """Agent events received and not yet answered."""
        self._shed: dict[tuple[str, str], int] = {}  # (kind, why) -> shed since the last log
        self._shed_logged = 0.0

    async def on_event(self, msg: Msg, *, received: float | None = None) -> None:
        """One signed agent event: checked, applied, answered (when it asks for an answer).
        ``received``: when it arrived (the event loop's clock; now when None)."""
        parts = msg.subject.rsplit(".", 3)
        if len(parts) != 4:
            return
        _root, site, agent, kind = parts
        arrived = received if received is not None else asyncio.get_running_loop().time()
        wait_ms = self.config.agent_event_wait_ms
        deadline = arrived + wait_ms / 1000 if wait_ms else math.inf
        self.in_hand += 1
        metrics.AGENT_EVENTS_IN_HAND.set(self.in_hand)
        try:
            body = await self._answer(msg, site, agent, kind, deadline)
        finally:
            self.in_hand -= 1
            metrics.AGENT_EVENTS_IN_HAND.set(self.in_hand)
        if msg.reply:
            with contextlib.suppress(nats.errors.Error):
                await msg.respond(body)

    async def _answer(self, msg: Msg, site: str, agent: str, kind: str, deadline: float) -> bytes:
        try:
            if kind not in EVENT_KINDS:
                raise invalid("subject", f"unknown agent event {kind!r}")
            if kind not in _NEVER_SHED:
                # before the signature's check: what an overload sheds must cost next to nothing
                if 0 < self.config.agent_events_max < self.in_hand:
                    return self._shed_one(kind, "full")
                if asyncio.get_running_loop().time() > deadline:
                    return self._shed_one(kind, "late")
            doc, signature = open_event(msg.data)
            signer = await self.signers.check_event(
                site=site, agent=agent, kind=kind, doc=doc, signature=signature
            )
            result = await self.apply(read_event(kind, doc), signer, deadline=deadline)
            return encode_ok(result)
        except LateError:
            return self._shed_one(kind, "late")
        except BcError as err:
            self.log.info(
                "agent_event_refused",
                kind=kind,
                site_id=site,
                agent_id=agent,
                code=err.code.value,
                reason=err.reason,
                path=err.path,
            )
            return encode_error(err)
        except _DB_ERRORS as exc:
            self.log.warning("agent_event_failed", kind=kind, error=type(exc).__name__)
            return encode_error(BcError(ErrorCode.UNAVAILABLE, "the store is not reachable now"))
        except Exception:
            self.log.exception("agent_event_failed", kind=kind, site_id=site, agent_id=agent)
            return encode_error(BcError(ErrorCode.INTERNAL, f"internal error handling {kind}"))

    def _shed_one(self, kind: str, why: str) -> bytes:
        """An event not applied (``why``: ``full``, too many in hand; ``late``, it waited past
        ``agent_event_wait_ms``): counted, logged now and then, answered busy."""
        metrics.AGENT_EVENTS_SHED.labels(kind, why).inc()
        key = (kind, why)
        self._shed[key] = self._shed.get(key, 0) + 1
        now = asyncio.get_running_loop().time()
        if now - self._shed_logged >= _SHED_LOG_S:
            shed = {f"{k}.{w}": n for (k, w), n in sorted(self._shed.items())}
            self.log.warning("agent_events_shed", shed=shed, in_hand=self.in_hand)
            self._shed.clear()
            self._shed_logged = now
        return encode_error(_BUSY)

    async def apply(self, event: AnyAgentEvent, signer: Signer, *, deadline: float | None = None) -> Any:
        """An event whose signature ``signer`` made (checked): applied; the answer to send.
        At most ``agent_event_slots`` statements of agent events at once work on the store
        (heartbeats need none). Claims, progress and results that arrive together go as one
        statement each (``GroupCommit``), which takes one slot; they wait for their group
        without one. ``LateError`` when the event waited for the store past ``deadline`` (the
        event loop's clock): nothing was applied."""
        match event:
            case Heartbeat():
                # never behind a storm: a site agent's heartbeat late by silent_after would hand
                # its site's commands to nobody (a machine's is answered from memory anyway)
                return await self._heartbeat(event, signer)
            case Hello():  # takes a slot for its statements only (see _hello)
                return await self._hello(event, signer, deadline=deadline)
            case Ack():
                return await self.claims.ack(event, deadline=deadline)
            case Progress():  # never shed (_NEVER_SHED): however late, it goes
                await self.runs.progress(event)
                return None
            case Result():
                return await self.runs.result(event, signer, deadline=deadline)
            case Check():
                async with slot_by(self._slots, deadline):
                    return await self._check(event, signer)

    async def _check(self, ev: Check, signer: Signer) -> CheckReply:
        """Before a try of a call to a machine: which of these commands must stop now."""
        if len(ev.command_ids) > 256:
            raise invalid("commandIds", "at most 256 commands a check")
        return CheckReply(stop=await self.store.must_stop(ev.command_ids, signer.agent_id))

    # -- presence ---------------------------------------------------------------------------

    async def _renew_lease(self, site_id: str, agent_id: str) -> bool:
        return await self.store.renew_lease(site_id, agent_id, ttl_ms=self.config.silent_after_ms)

    async def _hello(self, ev: Hello, signer: Signer, *, deadline: float | None = None) -> HelloReply:
        kinds = ev.kinds
        if kinds is not None and (len(kinds) > 512 or any(len(k) > 128 for k in kinds)):
            raise invalid("kinds", "at most 512 kinds of up to 128 characters")
        async with slot_by(self._slots, deadline):
            await self._hello_rows(ev, signer)
        # the consumer on JetStream outside the slot: a storm of hellos (a thousand machines
        # after an outage) waits on nats-server, not on the store's connections
        stream, consumer = await self.streams.ensure_consumer(signer.site_id, signer.agent_id)
        lease = False
        if signer.role == "site":
            async with self._slots:
                lease = await self._renew_lease(signer.site_id, signer.agent_id)
        self.log.info(
            "agent_hello",
            agent_id=signer.agent_id,
            site_id=signer.site_id,
            role=signer.role,
            boot_lease=lease,
        )
        self.spawn(self._after_hello(signer))
        return HelloReply(
            heartbeat_ms=self.config.heartbeat_ms,
            silent_after_ms=self.config.silent_after_ms,
            stream=stream,
            consumer=consumer,
            boot_lease=lease,
            ack_wait_ms=self.config.ack_wait_ms,
            idle_heartbeat_ms=max(self.config.idle_heartbeat_ms, self.config.heartbeat_ms),
            # the site's streams on its leaf: the agent stores its results there (site_results)
            **self._results_on_leaf(signer),
        )

    async def _hello_rows(self, ev: Hello, signer: Signer) -> None:
        await self.store.agent_hello(
            AgentHello(
                agent_id=signer.agent_id,
                site_id=signer.site_id,
                tenant_id=signer.tenant_id,
                role=signer.role,
                cert_id=signer.cert_id,
                incarnation=ev.incarnation[:64],
                version=ev.version[:64],
                kinds=ev.kinds,
                signed_at_ms=ev.signed_at_ms,
                status=_status_doc(ev.status),
                gap_ms=self.config.silence_gap_ms(ev.next_heartbeat_ms, role=signer.role),
            )
        )
        await self._journal_seen(signer.agent_id, ev.journal_id)

    def _results_on_leaf(self, signer: Signer) -> dict[str, str]:
        if not self.streams.on_leaves:
            return {}
        subjects = self.streams.subjects
        return {
            "results_subject": subjects.site_results(signer.site_id, signer.agent_id),
            "results_stream": subjects.site_results_stream(signer.site_id),
        }

    async def _after_hello(self, signer: Signer) -> None:
        """An agent is back: what waited for it goes out, what it may have missed again."""
        try:
            if signer.role == "site":
                await self.dispatch_pending(site_id=signer.site_id)
            rows = await self.store.agent_commands_to_republish(signer.agent_id)
            await self.deliveries.deliver(rows, again=True)
        except (BcError, *_DB_ERRORS) as exc:
            self.log.warning("redelivery_deferred", agent_id=signer.agent_id, error=str(exc))

    async def _heartbeat(self, ev: Heartbeat, signer: Signer) -> HeartbeatReply:
        if ev.leaving:
            left = await self.store.agent_leave(
                signer.agent_id, ev.signed_at_ms, silent_after_ms=self.config.silent_after_ms
            )
            self.presence.forget(signer.agent_id)
            if left is not None:
                await self.store.release_lease(signer.site_id, signer.agent_id)
                self.log.info("agent_left", agent_id=signer.agent_id, site_id=signer.site_id)
            return HeartbeatReply(boot_lease=False)
        if signer.role != "site":
            # a machine's bcd: answered from memory, written with the others (presence.py)
            if len(ev.journal_id) > 64:
                raise invalid("journalId", "a journal id is at most 64 characters")
            cancel = await self.presence.heard(
                signer.agent_id,
                signed_at_ms=ev.signed_at_ms,
                cert_id=signer.cert_id,
                status=_status_doc(ev.status),
                journal_id=ev.journal_id,
                gap_ms=self.config.silence_gap_ms(ev.next_heartbeat_ms, role=signer.role),
            )
            return HeartbeatReply(boot_lease=False, cancel=cancel or [])
        seen = await self.store.agent_heartbeat(
            signer.agent_id,
            ev.signed_at_ms,
            signer.cert_id,
            _status_doc(ev.status),
            silent_after_ms=self.config.silent_after_ms,
        )
        if seen is None:
            if await self.store.agent_by_id(signer.agent_id) is None:
                raise BcError(ErrorCode.NOT_FOUND, "unknown agent: say hello first")
            return HeartbeatReply(boot_lease=False)  # older than one already applied
        await self._journal_seen(signer.agent_id, ev.journal_id)
        lease = seen.role == "site" and await self._renew_lease(signer.site_id, signer.agent_id)
        return HeartbeatReply(boot_lease=lease, cancel=await self.store.cancelling(signer.agent_id))

    async def on_cert_event(self, cert_id: str) -> None:
        """bc-pki says a certificate changed (its revocation event, ``bc.events.cert.<id>``). The
        event is a wake-up, not the truth: bc-pki is asked, and only a certificate it calls
        revoked cuts its agent off, at once: shown disconnected, its boot lease gone, its
        unclaimed site commands back to pending for another agent of the site (nothing more is
        dispatched to it, and the events it signs are refused from now on)."""
        self.signers.evict(cert_id)
        if not cert_id.startswith("cert_") or len(cert_id) > 64:
            return
        backoff = Backoff(first=0.2, cap=3.2)
        for _ in range(5):
            try:
                info = await self.pki.get_certificate(cert_id=cert_id)
                if info.state != "revoked":
                    return
                cut = await self.store.cut_off(cert_id, silent_after_ms=self.config.silent_after_ms)
            except BcError as err:
                if err.code == ErrorCode.NOT_FOUND:
                    return
                self.log.warning("agent_cut_off_deferred", cert_id=cert_id, error=str(err))
            except _DB_ERRORS as exc:
                self.log.warning("agent_cut_off_deferred", cert_id=cert_id, error=type(exc).__name__)
            else:
                for agent in cut.agents:
                    self.log.info("agent_cut_off", agent_id=agent.id, site_id=agent.site_id, cert_id=cert_id)
                for command in cut.reassigned:
                    self.log.info("command_reassigned", command_id=command.id, reason="agent-revoked")
                await self.changed(cut.reassigned)
                for site_id in {agent.site_id for agent in cut.agents}:
                    await self.dispatch_pending(site_id=site_id)
                return
            # bc-pki or the store away for a moment; the certificate cache's lifetime and the
            # agent's silence still end it if this never gets through
            await asyncio.sleep(backoff.next())

    async def _journal_seen(self, agent_id: str, journal_id: str) -> None:
        """The process of this journal is there: its generation is given at its first hello
        (before it can have received a delivery), and what it claimed may still run there."""
        if not journal_id:
            return
        if len(journal_id) > 64:
            raise invalid("journalId", "a journal id is at most 64 characters")
        await self.store.journal_seen(agent_id, journal_id, present=True)

    # -- routes -----------------------------------------------------------------------------

    async def list_agents(self, req: ApiRequest) -> AgentList:
        body = req.decode(ListAgents)
        rows = await self.store.list_agents(
            site_id=body.site_id,
            role=body.role,
            connected=body.connected,
            silent_after_ms=self.config.silent_after_ms,
            limit=body.limit + 1,
            after=decode_cursor(body.cursor, str, str),
        )
        agents, next_ = take_page(
            [agent_view(r) for r in rows], limit=body.limit, key=lambda a: (a.site_id, a.id),
            budget=req.page_budget,
        )  # fmt: skip
        return AgentList(agents=agents, next=next_)

    async def site_agent(self, req: ApiRequest) -> SiteAgentReply:
        body = req.decode(SiteAgentRequest)
        site = body.site_id
        if site is not None:
            check_name(site, "siteId")
        elif body.node_id is not None:
            parse_id(body.node_id, "node", path="nodeId")
            site = await self.store.site_of_node(body.node_id)
            if site is None:
                return SiteAgentReply(agent_id=None)
        else:
            raise invalid("siteId", "give siteId or nodeId")
        agent = await self.store.pick_site_agent(site, silent_after_ms=self.config.silent_after_ms, kind=None)
        return SiteAgentReply(agent_id=agent)


def _status_doc(status: AgentStatus | None) -> str | None:
    """An agent's word about itself, bounded before it is stored (it is the agent's to say, so
    it is cut rather than refused: a heartbeat must never fail over it)."""
    if status is None:
        return None
    error = status.last_error
    bounded = AgentStatus(
        drivers=[d[:MAX_STATUS_DRIVER_CHARS] for d in status.drivers[:MAX_STATUS_DRIVERS]],
        cache_used_bytes=status.cache_used_bytes,
        cache_max_bytes=status.cache_max_bytes,
        cache_objects=status.cache_objects,
        cache_pinned=status.cache_pinned,
        last_error=error[:MAX_STATUS_ERROR_CHARS] if error is not None else None,
        last_error_at_ms=status.last_error_at_ms,
    )
    return msgspec.json.encode(bounded).decode()
