"""Agents: their signed events (hello, heartbeat, claim, progress, result) and the agent routes.

Each event is checked against its signer's certificate and applied by compare-and-set on the
command's state, so a duplicate or late event changes nothing. A claim (``ack``) is taken only
when the command is dispatched to this agent, its digest matches and, for a destructive
command, its batch is valid under the approvers configured now.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Coroutine
from typing import Any, Final

import asyncpg
import msgspec
import nats.errors
from nats.aio.msg import Msg

from better_compute.clients.pki import PkiClient
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import parse_id
from better_compute.crypto import result_document
from better_compute.service import ApiRequest, Database
from better_compute.wire import encode_error, encode_ok
from better_compute.wire.agent import (
    EVENT_KINDS,
    Ack,
    AckReply,
    Heartbeat,
    HeartbeatReply,
    Hello,
    HelloReply,
    Progress,
    Result,
    ResultReply,
    open_event,
)
from better_compute.wire.cmdq import (
    MAX_STATUS_DRIVER_CHARS,
    MAX_STATUS_DRIVERS,
    MAX_STATUS_ERROR_CHARS,
    TERMINAL_STATES,
    AgentList,
    AgentStatus,
    ListAgents,
    SiteAgentReply,
    SiteAgentRequest,
)
from better_compute.wire.codec import convert
from better_compute.wire.paging import decode_cursor, take_page

from . import store
from .commands import check_name, invalid
from .config import CmdqConfig
from .delivery import Changed, Deliveries, Streams
from .signers import Signer, Signers
from .sweeper import DispatchPending

__all__ = ["Agents"]

_DB_ERRORS: Final = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    OSError,
)

Spawn = Callable[[Coroutine[Any, Any, None]], None]
"""Run a coroutine as a task the service waits for when it stops."""


class Agents:
    """Agent events and the ``agents.*`` routes."""

    def __init__(
        self,
        *,
        db: Database,
        config: CmdqConfig,
        streams: Streams,
        deliveries: Deliveries,
        pki: PkiClient,
        signers: Signers,
        changed: Changed,
        dispatch_pending: DispatchPending,
        spawn: Spawn,
        log: Any,
    ) -> None:
        self.db = db
        self.config = config
        self.streams = streams
        self.deliveries = deliveries
        self.pki = pki
        self.signers = signers
        self.changed = changed
        self.dispatch_pending = dispatch_pending
        self.spawn = spawn
        self.log = log

    async def on_event(self, msg: Msg) -> None:
        """One signed agent event: checked, applied, answered (when it asks for an answer)."""
        parts = msg.subject.rsplit(".", 3)
        if len(parts) != 4:
            return
        _root, site, agent, kind = parts
        try:
            if kind not in EVENT_KINDS:
                raise invalid("subject", f"unknown agent event {kind!r}")
            doc, signature = open_event(msg.data)
            signer = await self.signers.check_event(
                site=site, agent=agent, kind=kind, doc=doc, signature=signature
            )
            result = await self._apply(kind, doc, signer)
            body = encode_ok(result)
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
            body = encode_error(err)
        except _DB_ERRORS as exc:
            self.log.warning("agent_event_failed", kind=kind, error=type(exc).__name__)
            body = encode_error(BcError(ErrorCode.UNAVAILABLE, "the store is not reachable now"))
        except Exception:
            self.log.exception("agent_event_failed", kind=kind, site_id=site, agent_id=agent)
            body = encode_error(BcError(ErrorCode.INTERNAL, f"internal error handling {kind}"))
        if msg.reply:
            with contextlib.suppress(nats.errors.Error):
                await msg.respond(body)

    async def _apply(self, kind: str, doc: dict[str, Any], signer: Signer) -> Any:
        match kind:
            case "hello":
                return await self._hello(convert(doc, Hello), signer)
            case "heartbeat":
                return await self._heartbeat(convert(doc, Heartbeat), signer)
            case "ack":
                return await self._ack(convert(doc, Ack))
            case "progress":
                await self._progress(convert(doc, Progress))
                return None
            case _:
                return await self._result(convert(doc, Result))

    # -- presence ---------------------------------------------------------------------------

    async def _renew_lease(self, site_id: str, agent_id: str) -> bool:
        holder = await self.db.fetchval(store.LEASE_RENEW, site_id, agent_id, self.config.silent_after_ms)
        return bool(holder == agent_id)

    async def _hello(self, ev: Hello, signer: Signer) -> HelloReply:
        kinds = ev.kinds
        if kinds is not None and (len(kinds) > 512 or any(len(k) > 128 for k in kinds)):
            raise invalid("kinds", "at most 512 kinds of up to 128 characters")
        await self.db.fetchrow(
            store.AGENT_UPSERT,
            signer.agent_id,
            signer.site_id,
            signer.tenant_id,
            signer.role,
            signer.cert_id,
            ev.incarnation[:64],
            ev.version[:64],
            kinds,
            ev.signed_at_ms,
            _status_doc(ev.status),
        )
        stream, consumer = await self.streams.ensure_consumer(signer.site_id, signer.agent_id)
        lease = signer.role == "site" and await self._renew_lease(signer.site_id, signer.agent_id)
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
        )

    async def _after_hello(self, signer: Signer) -> None:
        """An agent is back: what waited for it goes out, what it may have missed again."""
        try:
            if signer.role == "site":
                await self.dispatch_pending(site_id=signer.site_id)
            rows = await self.db.fetch(store.AGENT_COMMANDS_TO_REPUBLISH, signer.agent_id)
            await self.deliveries.deliver(rows, again=True)
        except (BcError, *_DB_ERRORS) as exc:
            self.log.warning("redelivery_deferred", agent_id=signer.agent_id, error=str(exc))

    async def _heartbeat(self, ev: Heartbeat, signer: Signer) -> HeartbeatReply:
        if ev.leaving:
            row = await self.db.fetchrow(
                store.AGENT_LEAVE, signer.agent_id, ev.signed_at_ms, self.config.silent_after_ms
            )
            if row is not None:
                await self.db.execute(store.LEASE_RELEASE, signer.site_id, signer.agent_id)
                self.log.info("agent_left", agent_id=signer.agent_id, site_id=signer.site_id)
            return HeartbeatReply(boot_lease=False)
        row = await self.db.fetchrow(
            store.AGENT_HEARTBEAT, signer.agent_id, ev.signed_at_ms, signer.cert_id, _status_doc(ev.status)
        )
        if row is None:
            if await self.db.fetchrow(store.AGENT_AGAIN, signer.agent_id) is None:
                raise BcError(ErrorCode.NOT_FOUND, "unknown agent: say hello first")
            return HeartbeatReply(boot_lease=False)  # older than one already applied
        lease = row["role"] == "site" and await self._renew_lease(signer.site_id, signer.agent_id)
        return HeartbeatReply(boot_lease=lease)

    # -- claims -----------------------------------------------------------------------------

    async def _ack(self, ev: Ack) -> AckReply:
        """A claim. Taken when the command is dispatched to this agent, its digest matches and,
        for a destructive command, its batch is unexpired and approved under the approvers
        configured now; or when this very journal claimed it already (its answer was lost).
        Another journal's claim of a command that may have started settles it ``interrupted``."""
        try:
            digest = bytes.fromhex(ev.digest)
        except ValueError as exc:
            raise invalid("digest", "expected hex") from exc
        if not isinstance(ev.journal_id, str) or len(ev.journal_id) > 64:
            raise invalid("journalId", "a journal id is at most 64 characters")
        journal = ev.journal_id or None
        quorum = self.config.quorum.enabled
        claim = (ev.command_id, ev.agent, digest, journal, ev.signed_at_ms, quorum)
        row = await self.db.fetchrow(store.ACK, *claim)
        if row is not None:
            await self.changed([row])
            return AckReply(proceed=True, state="acked")
        cur = await self.db.fetchrow(store.CLAIM_STATE, ev.command_id)
        if cur is None:
            return AckReply(proceed=False, reason="unknown-command")
        # Not for good: the command may be handed to this agent later (another agent fell
        # silent), and a genuine delivery may follow one that was not what we sent.
        if cur["agent_id"] != ev.agent:
            return AckReply(proceed=False, reason="not-yours", again=True)
        if bytes(cur["digest"]) != digest:
            self.log.warning("claim_digest_mismatch", command_id=ev.command_id, agent_id=ev.agent)
            return AckReply(proceed=False, reason="digest-mismatch", again=True)
        state = cur["state"]
        if state in TERMINAL_STATES:
            return AckReply(proceed=False, state=state, reason=state)
        if not cur["live"]:
            return AckReply(proceed=False, state=state, reason="expired")
        same_journal = journal is not None and cur["claim_journal"] == journal
        if state == "running" and same_journal:
            # The journal started it (it reported running), so it never claims it again: this
            # is a late copy of its claim, or the journal was restored from an older copy.
            # Either way it must not run now; what runs, if anything, reports as before.
            return AckReply(proceed=False, state=state, reason="running")
        if state in ("acked", "running") and not same_journal:
            return await self._interrupt(ev, journal, cur)
        if state in ("dispatched", "acked") and cur["destructive"]:
            batch_valid = (
                cur["has_batch"] and not cur["batch_expired"] and (not quorum or cur["batch_approved"])
            ) or (not cur["has_batch"] and not quorum)
            if not batch_valid:
                return await self._refuse_for_batch(ev, journal, cur)
        # pending, or changed meanwhile: it comes again in a later delivery
        return AckReply(proceed=False, state=state, reason=state, again=True)

    async def _interrupt(self, ev: Ack, journal: str | None, cur: Any) -> AckReply:
        """Another journal of the agent claims a command that may have started: settle it
        ``failed`` (``interrupted``); it never runs again."""
        row = await self.db.fetchrow(
            store.CLAIM_INTERRUPTED, ev.command_id, ev.agent, journal, ev.signed_at_ms
        )
        if row is None:
            # A claim signed before the recorded one: a late copy from an earlier journal.
            self.log.info("claim_superseded", command_id=ev.command_id, agent_id=ev.agent)
            return AckReply(proceed=False, state=cur["state"], reason="claimed-by-another-journal")
        self.log.warning("command_interrupted", command_id=ev.command_id, agent_id=ev.agent, was=cur["state"])
        await self.changed([row])
        return AckReply(proceed=False, state="failed", reason="interrupted")

    async def _refuse_for_batch(self, ev: Ack, journal: str | None, cur: Any) -> AckReply:
        """A destructive command claimed outside a valid batch: it expires with its batch, or
        goes back to pending until the batch is approved again."""
        expired = cur["has_batch"] and cur["batch_expired"]
        sql = store.CLAIM_BATCH_EXPIRED if expired else store.CLAIM_BACK_TO_PENDING
        row = await self.db.fetchrow(sql, ev.command_id, ev.agent, journal)
        if row is None:  # changed meanwhile
            return AckReply(proceed=False, state=cur["state"], reason=cur["state"], again=True)
        self.log.warning(
            "claim_refused_batch", command_id=ev.command_id, state=row["state"], reason=row["reason"]
        )
        await self.changed([row])
        return AckReply(proceed=False, state=row["state"], reason=row["reason"], again=not expired)

    # -- runs -------------------------------------------------------------------------------

    async def _progress(self, ev: Progress) -> None:
        message = ev.message[:500] if ev.message is not None else None
        row = await self.db.fetchrow(store.PROGRESS, ev.command_id, ev.agent, message)
        if row is not None and row["old_state"] != row["state"]:
            await self.changed([row])

    async def _result(self, ev: Result) -> ResultReply:
        reason = ev.reason[:500] if ev.reason is not None else None
        attested = False
        if ev.result_signature is not None:
            cur = await self._command_of(ev)
            if cur["state"] not in ("acked", "running"):
                await self._late_end(ev)
                return ResultReply(recorded=False, state=cur["state"])
            attested = await self._attest(cur["node_id"], ev)
        row = await self.db.fetchrow(
            store.RESULT,
            ev.command_id,
            ev.agent,
            ev.status,
            reason,
            ev.result,
            ev.result_signature,
            attested,
        )
        if row is None:  # settled already (a duplicate or late result), or not this agent's
            cur = await self._command_of(ev)
            await self._late_end(ev)
            return ResultReply(recorded=False, state=cur["state"])
        self.log.info(
            "command_settled",
            command_id=ev.command_id,
            state=ev.status,
            reason=reason,
            attested=attested,
            result_bytes=len(ev.result),
        )
        await self.changed([row])
        return ResultReply(recorded=True, state=ev.status, attested=attested)

    async def _command_of(self, ev: Result) -> Any:
        """The command a result is about; ``NOT_FOUND`` or ``PERMISSION_DENIED`` if not the
        reporting agent's."""
        cur = await self.db.fetchrow(store.COMMAND_STATE, ev.command_id)
        if cur is None:
            raise BcError(ErrorCode.NOT_FOUND, "no such command", {"path": "commandId"})
        if cur["agent_id"] != ev.agent:
            raise BcError(
                ErrorCode.PERMISSION_DENIED,
                "the command is not this agent's",
                {"path": "commandId", "reason": "not-yours"},
            )
        return cur

    async def _late_end(self, ev: Result) -> None:
        """The agent ran a command to its end after it was cancelled or expired: the result no
        longer counts, but a step attempt waiting for the run to end may go on now."""
        rows = await self.db.fetch(store.LATE_END, ev.command_id, ev.agent)
        if rows:
            self.log.info("command_ended_late", command_id=ev.command_id, status=ev.status)
            await self.changed(rows)

    async def _attest(self, node_id: str, ev: Result) -> bool:
        """Check the node's signature over the result through bc-pki."""
        assert ev.result_signature is not None
        data = result_document(command_id=ev.command_id, node_id=node_id, status=ev.status, result=ev.result)
        try:
            verified = await self.pki.verify(signer_id=node_id, data=data, signature=ev.result_signature)
        except BcError as err:
            if err.code is ErrorCode.UNAUTHENTICATED:
                self.log.warning("result_signature_refused", command_id=ev.command_id, reason=err.reason)
                return False
            # bc-pki cannot answer now: the agent reports again later.
            raise BcError(ErrorCode.UNAVAILABLE, "cannot check the result's signature now") from err
        return verified.agent_id == node_id

    # -- routes -----------------------------------------------------------------------------

    async def list_agents(self, req: ApiRequest) -> AgentList:
        body = req.decode(ListAgents)
        site, ident = decode_cursor(body.cursor, str, str) or (None, None)
        rows = await self.db.fetch(
            store.AGENTS_LIST,
            body.site_id,
            body.role,
            body.connected,
            self.config.silent_after_ms,
            body.limit + 1,
            site,
            ident,
        )
        agents, next_ = take_page(
            [store.agent_view(r) for r in rows], limit=body.limit, key=lambda a: (a.site_id, a.id),
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
            site = await self.db.fetchval(store.SITE_OF_NODE, body.node_id)
            if site is None:
                return SiteAgentReply(agent_id=None)
        else:
            raise invalid("siteId", "give siteId or nodeId")
        agent = await self.db.fetchval(store.PICK_SITE_AGENT, site, self.config.silent_after_ms, None)
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
        last_error=error[:MAX_STATUS_ERROR_CHARS] if error is not None else None,
        last_error_at_ms=status.last_error_at_ms,
    )
    return msgspec.json.encode(bounded).decode()
