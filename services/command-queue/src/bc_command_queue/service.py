"""The bc-command-queue service process.

Commands are rows in PostgreSQL (the truth) and deliveries on per-site JetStream streams (the
channel). Agents report signed events; each is applied by compare-and-set on the command's
state. A sweeper, safe to run in every instance at once, expires commands, hands silent agents'
unclaimed commands to others, fails lost agents' commands, dispatches what became dispatchable
and publishes again what was not delivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Final

import asyncpg
import msgspec
import nats.errors
from nats.aio.msg import Msg

from better_compute.agent.protocol import (
    EVENT_KINDS,
    Ack,
    AckReply,
    CommandDelivery,
    Heartbeat,
    HeartbeatReply,
    Hello,
    HelloReply,
    Progress,
    Result,
    ResultReply,
    open_event,
    payload_digest,
    result_document,
)
from better_compute.cmdq_client import (
    AgentList,
    ApprovalView,
    ApproveBatch,
    ApproverView,
    BatchIdRequest,
    BatchList,
    BatchState,
    BatchView,
    CancelReply,
    CommandIdRequest,
    CommandList,
    CreateBatch,
    ListAgents,
    ListBatches,
    ListCommands,
    QuorumView,
    SiteAgentReply,
    SiteAgentRequest,
    batch_document,
)
from better_compute.config import Settings
from better_compute.core.app import App, load_app
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id, parse_id
from better_compute.core.plugins import CommandKind
from better_compute.pki_client import PkiClient
from better_compute.service import ApiRequest, Database, Handler, Service
from better_compute.service.faults import Backoff, describe, is_transient
from better_compute.wire import encode_error, encode_ok
from better_compute.wire.cmdq import (
    MAX_STATE_QUERY,
    TERMINAL_STATES,
    CancelCommands,
    CommandStates,
    CommandStatesReply,
    CommandView,
    EnqueueCommand,
    LiveWithRef,
    LiveWithRefReply,
)
from better_compute.wire.codec import convert, encode
from better_compute.wire.paging import decode_cursor, take_page
from better_compute.wire.subjects import valid_token

from . import store
from .config import CmdqConfig
from .delivery import Streams
from .signers import Signer, Signers

__all__ = ["CommandQueueService"]

MAX_TIMEOUT_MS: Final = 7 * 24 * 3600 * 1000
MIN_TIMEOUT_MS: Final = 1_000
MAX_PAYLOAD_BYTES: Final = 256 * 1024
MAX_KEY_LENGTH: Final = 256
_KEY_RE: Final = re.compile(r"^[\x21-\x7e]{1,256}$")
_DB_ERRORS: Final = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    OSError,
)


def _invalid(path: str, message: str) -> BcError:
    return BcError(ErrorCode.INVALID_INPUT, message, {"path": path})


def _name(value: str, path: str) -> str:
    if not isinstance(value, str) or len(value) > 64 or not valid_token(value):
        raise _invalid(path, "expected 1-64 letters, digits, '_' or '-'")
    return value


def _carries(value: Any, ref: str) -> bool:
    """Whether ``ref`` is one of the strings anywhere in a JSON value."""
    if isinstance(value, str):
        return value == ref
    if isinstance(value, dict):
        return any(_carries(v, ref) for v in value.values())
    if isinstance(value, list):
        return any(_carries(v, ref) for v in value)
    return False


class CommandQueueService(Service):
    """Command queue: commands, per-site streams, agents, destructive-batch quorum"""

    name: ClassVar[str] = "bc-command-queue"
    api_name: ClassVar[str] = "command-queue"
    schema: ClassVar[str | None] = "cmdq"
    migrations_package: ClassVar[str | None] = "bc_command_queue.migrations"
    description: ClassVar[str] = "Command queue: commands, per-site streams, agents, destructive-batch quorum"

    def __init__(self, settings: Settings, *, config: CmdqConfig | None = None) -> None:
        super().__init__(settings)
        self.config = config if config is not None else CmdqConfig.from_env()
        self.app: App | None = None
        self.pki: PkiClient | None = None
        self.signers: Signers | None = None
        self.streams: Streams | None = None
        self._heard_since: float | None = None  # monotonic; see _heard_for_ms

    # -- start ------------------------------------------------------------------------

    async def on_start(self) -> None:
        assert self.nc is not None
        assert self.api is not None
        self.app = load_app(self.settings.app)
        self.pki = PkiClient(self.api, timeout=5.0)
        self.signers = Signers(self.pki, ttl_seconds=self.config.cert_cache_seconds)
        self.streams = Streams(
            self.nc,
            self.subjects,
            replicas=self.config.stream_replicas,
            max_age_seconds=self.config.stream_max_age_seconds,
            ack_wait_seconds=self.config.ack_wait_ms / 1000,
        )
        await self._recount_batches()
        # One instance handles each agent event (queue group); every instance evicts a
        # revoked certificate from its own cache.
        await self.nc.subscribe(
            self.subjects.agent_events_all(),
            queue=f"{self.subjects.root}.cmdq.agent-events",
            cb=self.on_message(self._on_agent_event),
        )
        await self.nc.subscribe(self.subjects.events_all("cert"), cb=self._on_cert_event)
        quorum = self.config.quorum
        self.log.info(
            "quorum_configured" if quorum.enabled else "quorum_off",
            threshold=quorum.threshold,
            approvers=sorted(quorum.approvers),
        )

    def routes(self) -> Mapping[str, Handler]:
        return {
            "commands.enqueue": self.enqueue,
            "commands.get": self.get_command,
            "commands.states": self.command_states,
            "commands.list": self.list_commands,
            "commands.cancel": self.cancel,
            "commands.live_with_ref": self.live_with_ref,
            "agents.list": self.list_agents,
            "agents.site_agent_for": self.site_agent,
            "batches.create": self.create_batch,
            "batches.get": self.get_batch,
            "batches.list": self.list_batches,
            "batches.approve": self.approve_batch,
            "quorum.get": self.get_quorum,
        }

    def side_loops(self) -> Mapping[str, Any]:
        return {"sweeper": self._sweeper, "retention": self._retention}

    async def _retention(self) -> None:
        while True:
            try:
                purged = await self.purge()
                if purged:
                    self.log.info("commands_purged", count=purged, older_than_days=self.config.retention_days)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                self.log.warning("purge_failed", error=describe(exc))
            await asyncio.sleep(600)

    async def purge(self) -> int:
        """Delete finished commands older than the retention, a thousand at a time, so the table
        does not grow for ever; safe in several instances at once."""
        if self.config.retention_days <= 0:
            return 0
        total = 0
        while True:
            deleted = await self._db.fetchval(
                "WITH gone AS (DELETE FROM commands WHERE id IN ("
                "  SELECT id FROM commands WHERE state = ANY($1::text[])"
                "   AND updated_at < now() - make_interval(days => $2)"
                "  LIMIT 1000 FOR UPDATE SKIP LOCKED) RETURNING 1)"
                " SELECT count(*) FROM gone",
                sorted(TERMINAL_STATES),
                self.config.retention_days,
            )
            total += int(deleted)
            if deleted < 1000:
                return total

    @property
    def _db(self) -> Database:
        assert self.db is not None
        return self.db

    @property
    def _streams(self) -> Streams:
        assert self.streams is not None
        return self.streams

    @property
    def _app(self) -> App:
        assert self.app is not None
        return self.app

    # -- commands ---------------------------------------------------------------------

    def _check_enqueue(self, body: EnqueueCommand) -> tuple[CommandKind, bytes]:
        """Everything about a new command that needs no database; returns the kind and the
        canonical payload."""
        parse_id(body.node_id, "node", path="nodeId")
        _name(body.site_id, "siteId")
        _name(body.tenant_id, "tenantId")
        if not isinstance(body.key, str) or _KEY_RE.fullmatch(body.key) is None:
            raise _invalid("key", f"a key is 1-{MAX_KEY_LENGTH} printable characters")
        if body.workflow_id is not None:
            parse_id(body.workflow_id, "wf", path="workflowId")
        if body.step is not None and not 0 <= body.step <= 511:
            raise _invalid("step", "a step index is 0 to 511")
        if body.batch_id is not None:
            parse_id(body.batch_id, "batch", path="batchId")
        if not MIN_TIMEOUT_MS <= body.timeout_ms <= MAX_TIMEOUT_MS:
            raise _invalid("timeoutMs", f"between {MIN_TIMEOUT_MS} and {MAX_TIMEOUT_MS} ms")
        kind = self._app.command_kind(body.kind, path="kind")
        if body.sends is not None and body.kind not in body.sends:
            raise BcError(
                ErrorCode.INVALID_CONFIG,
                f"the step declares sends {sorted(body.sends)}, not {body.kind!r}",
                {"path": "kind", "reason": "undeclared-kind"},
            )
        payload = kind.payload.validate(body.payload, path="payload")
        canonical = msgspec.json.encode(payload, order="sorted")
        if len(canonical) > MAX_PAYLOAD_BYTES:
            raise _invalid("payload", f"payload is larger than {MAX_PAYLOAD_BYTES} bytes")
        return kind, canonical

    async def _check_batch(self, body: EnqueueCommand) -> tuple[str | None, bool]:
        """The batch a destructive command carries, and whether it may be dispatched now."""
        quorum = self.config.quorum
        if body.batch_id is None:
            if quorum.enabled:
                raise BcError(
                    ErrorCode.INVALID_STATE,
                    f"{body.kind} is destructive: it needs a batch the approvers signed",
                    {"path": "batchId", "reason": "batch-required"},
                )
            return None, True
        batch = await self._db.fetchrow(store.BATCH_BY_ID, body.batch_id)
        if batch is None:
            raise BcError(ErrorCode.NOT_FOUND, "no such batch", {"path": "batchId"})
        if batch["tenant_id"] != body.tenant_id:
            raise BcError(
                ErrorCode.INVALID_INPUT,
                "the batch belongs to another tenant",
                {"path": "batchId", "reason": "outside-batch-scope"},
            )
        if body.kind not in batch["kinds"]:
            raise BcError(
                ErrorCode.INVALID_INPUT,
                f"{body.kind} is outside the batch's scope",
                {"path": "kind", "reason": "outside-batch-scope"},
            )
        if body.node_id not in batch["nodes"]:
            raise BcError(
                ErrorCode.INVALID_INPUT,
                "the node is outside the batch's scope",
                {"path": "nodeId", "reason": "outside-batch-scope"},
            )
        # The approvers signed the batch's workflowId. A workflow's batch admits that workflow's
        # commands only; an operator's batch (no workflowId) admits only commands sent directly,
        # by no workflow: approving a job by hand approves nothing a workflow may send. (A bulk
        # verb's batch will name the set of workflows it started: a membership test here.)
        if body.workflow_id != batch["workflow_id"]:
            signed_for = f"workflow {batch['workflow_id']}" if batch["workflow_id"] else "no workflow"
            raise BcError(
                ErrorCode.INVALID_INPUT,
                f"the batch was signed for {signed_for}",
                {"path": "workflowId", "reason": "outside-batch-scope"},
            )
        if batch["expired"]:
            raise BcError(
                ErrorCode.INVALID_STATE,
                "the batch has expired",
                {"path": "batchId", "reason": "batch-expired"},
            )
        return body.batch_id, (not quorum.enabled) or batch["approved_at"] is not None

    async def _existing(self, body: EnqueueCommand) -> CommandView | None:
        row = await self._db.fetchrow(store.COMMAND_BY_NODE_KEY, body.node_id, body.key)
        if row is None:
            return None
        if row["kind"] != body.kind:
            raise BcError(
                ErrorCode.CONFLICT,
                f"key {body.key!r} of this node is already a {row['kind']} command",
                {"path": "key", "commandId": row["id"]},
            )
        return store.command_view(row)

    async def enqueue(self, req: ApiRequest) -> CommandView:
        body = req.decode(EnqueueCommand)
        kind, canonical = self._check_enqueue(body)
        batch_id: str | None = None
        may_dispatch = True
        if kind.destructive:
            # Find before checking the batch: a re-run finds its command even after the
            # batch expired.
            found = await self._existing(body)
            if found is not None:
                return found
            batch_id, may_dispatch = await self._check_batch(body)
        command_id = new_id("cmd")
        not_after_ms = time.time_ns() // 1_000_000 + body.timeout_ms
        row = await self._db.fetchrow(
            store.COMMAND_INSERT,
            command_id,
            body.node_id,
            body.site_id,
            body.tenant_id,
            body.key,
            body.kind,
            kind.destructive,
            body.target,
            canonical.decode(),
            bytes.fromhex(payload_digest(body.kind, canonical)),
            batch_id,
            body.workflow_id,
            body.step,
            not_after_ms,
            may_dispatch,
            self.config.silent_after_ms,
        )
        if row is None:  # (node, key) exists: find-before-create
            found = await self._existing(body)
            if found is None:  # removed in between: never happens, rows are kept
                raise BcError(ErrorCode.CONFLICT, "command changed meanwhile; enqueue again")
            return found
        await self._refuse_superseded(body, row)
        self.log.info(
            "command_enqueued",
            command_id=command_id,
            node_id=body.node_id,
            kind=body.kind,
            state=row["state"],
            agent_id=row["agent_id"],
            workflow_id=body.workflow_id,
        )
        await self._changed([row])
        if row["state"] == "dispatched":
            await self._deliver([row])
        return store.command_view(row, created=True)

    async def get_command(self, req: ApiRequest) -> CommandView:
        ident = parse_id(req.decode(CommandIdRequest).id, "cmd", path="id")
        row = await self._db.fetchrow(store.COMMAND_BY_ID, ident)
        if row is None:
            raise BcError(ErrorCode.NOT_FOUND, "no such command", {"path": "id"})
        return store.command_view(row)

    async def command_states(self, req: ApiRequest) -> CommandStatesReply:
        body = req.decode(CommandStates)
        if len(body.ids) > MAX_STATE_QUERY:
            raise BcError(
                ErrorCode.INVALID_INPUT, f"at most {MAX_STATE_QUERY} ids a request", {"path": "ids"}
            )
        rows = await self._db.fetch("SELECT id, state FROM commands WHERE id = ANY($1::text[])", body.ids)
        return CommandStatesReply(states={r["id"]: r["state"] for r in rows})

    async def list_commands(self, req: ApiRequest) -> CommandList:
        body = req.decode(ListCommands)
        if body.before is not None:
            parse_id(body.before, "cmd", path="before")
        rows = await self._db.fetch(
            store.LIST_COMMANDS,
            body.node_id,
            body.workflow_id,
            body.state,
            body.kind,
            body.site_id,
            body.agent_id,
            body.batch_id,
            body.before,
            body.limit,
        )
        views = [store.command_view(r, full=False) for r in rows]
        more = len(views) == body.limit
        return CommandList(commands=views, next=views[-1].id if more and views else None)

    async def cancel(self, req: ApiRequest) -> CancelReply:
        body = req.decode(CancelCommands)
        if len(body.reason) > 200:
            raise _invalid("reason", "at most 200 characters")
        running: list[str] = []
        if body.id is not None:
            ident = parse_id(body.id, "cmd", path="id")
            rows = await self._db.fetch(store.CANCEL_BY_ID, ident, body.reason)
            if not rows and await self._db.fetchrow(store.COMMAND_STATE, ident) is None:
                raise BcError(ErrorCode.NOT_FOUND, "no such command", {"path": "id"})
        elif body.key_prefix is not None:
            if not body.key_prefix or len(body.key_prefix) > MAX_KEY_LENGTH:
                raise _invalid("keyPrefix", f"1 to {MAX_KEY_LENGTH} characters")
            if body.node_id is not None:
                parse_id(body.node_id, "node", path="nodeId")
            if body.workflow_id is not None:
                parse_id(body.workflow_id, "wf", path="workflowId")
            if body.fence:
                await self._fence(body)
            args = (body.node_id, body.key_prefix, body.reason, body.workflow_id)
            rows = await self._db.fetch(store.CANCEL_BY_PREFIX, *args)
            claimed = (body.node_id, body.key_prefix, self.config.lost_after_ms, body.workflow_id)
            running = [r["id"] for r in await self._db.fetch(store.CLAIMED_UNDER_PREFIX, *claimed)]
        else:
            raise _invalid("id", "give id, or keyPrefix (with nodeId or workflowId)")
        for row in rows:
            self.log.info("command_cancelled", command_id=row["id"], reason=body.reason)
        await self._changed(rows)
        return CancelReply(cancelled=[r["id"] for r in rows], running=running)

    async def _fence(self, body: CancelCommands) -> None:
        """From now on refuse every enqueue under a superseded step attempt's key prefix.

        The fence commits before the cancel looks for live commands: a command created
        meanwhile is either cancelled by it or sees the fence itself (``_refuse_superseded``).
        """
        assert body.key_prefix is not None
        if body.workflow_id is None or not body.key_prefix.startswith(f"wf:{body.workflow_id}:"):
            raise _invalid("keyPrefix", "a fence is for one workflow: wf:<workflowId>:<step>#<attempt>")
        await self._db.execute(store.KEY_FENCE_INSERT, body.key_prefix, body.workflow_id, body.reason)

    async def _refuse_superseded(self, body: EnqueueCommand, row: Any) -> None:
        """A command just created under the key of a superseded step attempt (an engine that
        lost its shard still runs it) is cancelled before it goes out, and refused."""
        if body.workflow_id is None or not await self._db.fetchval(store.KEY_FENCED, body.key):
            return
        rows = await self._db.fetch(store.CANCEL_SUPERSEDED, row["id"])
        await self._changed(rows)
        self.log.warning("command_refused_superseded", command_id=row["id"], workflow_id=body.workflow_id)
        raise BcError(
            ErrorCode.INVALID_STATE,
            "this workflow step attempt was superseded: it sends nothing any more",
            {"path": "key", "reason": "attempt-superseded"},
        )

    async def _late_end(self, ev: Result) -> None:
        """The agent ran a command to its end after it was cancelled or expired: the result no
        longer counts, but a step attempt waiting for the run to end may go on now."""
        rows = await self._db.fetch(store.LATE_END, ev.command_id, ev.agent)
        if rows:
            self.log.info("command_ended_late", command_id=ev.command_id, status=ev.status)
            await self._changed(rows)

    async def live_with_ref(self, req: ApiRequest) -> LiveWithRefReply:
        body = req.decode(LiveWithRef)
        if not body.key_prefix:
            raise _invalid("keyPrefix", "a key prefix is required")
        for row in await self._db.fetch(store.LIVE_WITH_PREFIX, body.agent_id, body.key_prefix):
            if _carries(msgspec.json.decode(row["payload"]), body.ref):
                return LiveWithRefReply(live=True, command_id=row["id"])
        return LiveWithRefReply(live=False)

    # -- state changes: events and deliveries ---------------------------------------------

    async def _changed(self, rows: Sequence[Any]) -> None:
        """Publish each changed command's event: the engine wakes on it."""
        for row in rows:
            await self.publish_event("command", row["id"], store.command_event(row))

    def _delivery(self, row: Any) -> bytes:
        return encode(
            CommandDelivery(
                id=row["id"],
                kind=row["kind"],
                payload=msgspec.Raw(row["payload"].encode()),
                node_id=row["node_id"],
                site_id=row["site_id"],
                agent_id=row["agent_id"],
                key=row["key"],
                destructive=row["destructive"],
                not_after_ms=int(row["not_after"].timestamp() * 1000),
                batch_id=row["batch_id"],
                workflow_id=row["workflow_id"],
                step=row["step"],
            )
        )

    async def _publish(self, row: Any, conn: Any = None, *, again: bool = False) -> bool:
        """Publish a delivery. ``again``: the same publication as the last recorded one (a
        no-op while the stream's duplicate window remembers it); otherwise a new one."""
        generation = max(row["publishes"] - 1, 0) if again else row["publishes"]
        try:
            seq = await self._streams.publish(
                site_id=row["site_id"],
                agent_id=row["agent_id"],
                command_id=row["id"],
                body=self._delivery(row),
                generation=generation,
            )
        except BcError as err:
            self.log.warning("delivery_deferred", command_id=row["id"], error=err.message)
            return False
        await (conn or self._db).execute(store.PUBLISHED, row["id"], row["agent_id"], seq)
        return True

    async def _deliver(self, rows: Sequence[Any], *, again: bool = False) -> None:
        for row in rows:
            if not await self._publish(row, again=again):
                return  # the stream is in trouble: the sweeper publishes the rest later

    async def _dispatch_pending(self, *, site_id: str | None = None, batch_id: str | None = None) -> int:
        """Dispatch pending commands that may go now (quorum reached, an agent connected)."""
        silent = self.config.silent_after_ms
        changed: list[Any] = []
        async with self._db.transaction() as conn:
            rows = await conn.fetch(
                store.PENDING_TO_DISPATCH,
                self.config.quorum.enabled,
                site_id,
                batch_id,
                200,
                silent,
            )
            picks: dict[tuple[str, str], str | None] = {}
            for r in rows:
                if r["target"] == "node":
                    agent = r["node_id"]
                else:
                    pick = (r["site_id"], r["kind"])
                    if pick not in picks:
                        picks[pick] = await conn.fetchval(
                            store.PICK_SITE_AGENT, r["site_id"], silent, r["kind"]
                        )
                    agent = picks[pick]
                if agent is None:
                    continue
                row = await conn.fetchrow(store.DISPATCH, r["id"], agent)
                if row is not None:
                    changed.append(row)
        await self._changed(changed)
        await self._deliver(changed)
        return len(changed)

    # -- the sweeper --------------------------------------------------------------------

    async def _sweeper(self) -> None:
        backoff = Backoff(first=self.config.sweep_ms / 1000, cap=5.0)
        while True:
            delay = self.config.sweep_ms / 1000
            try:
                await self.sweep()
                backoff.reset()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                self._heard_since = None
                delay = max(delay, backoff.next())  # a store or bus outage: fewer tries, fewer lines
                self.log.warning("sweep_failed", error=describe(exc), retry_in_s=round(delay, 2))
            await asyncio.sleep(delay)

    def _heard_for_ms(self) -> float:
        """How long agents have been able to reach us without a break: NATS connected and the
        store answering (heartbeats need both). An agent counts as silent or lost only after it
        was silent that long while we could hear it, never because of our own outage."""
        now = time.monotonic()
        if self.nc is None or not self.nc.is_connected:
            self._heard_since = None
        elif self._heard_since is None:
            self._heard_since = now
        return 0.0 if self._heard_since is None else (now - self._heard_since) * 1000

    async def sweep(self) -> None:
        """One pass of every timed duty; safe in several instances at once."""
        cfg = self.config
        expired = await self._db.fetch(store.EXPIRE_DUE, cfg.quorum.enabled)
        if cfg.quorum.enabled:
            expired += await self._db.fetch(store.EXPIRE_BATCH_EXPIRED)
        heard_ms = self._heard_for_ms()
        reassigned = (
            await self._db.fetch(store.REASSIGN_SILENT, cfg.silent_after_ms)
            if heard_ms >= cfg.silent_after_ms
            else []
        )
        lost = (
            await self._db.fetch(store.FAIL_LOST, cfg.lost_after_ms) if heard_ms >= cfg.lost_after_ms else []
        )
        for row in expired:
            self.log.info("command_expired", command_id=row["id"], reason=row["reason"])
        for row in reassigned:
            self.log.info("command_reassigned", command_id=row["id"], reason="agent-silent")
        for row in lost:
            self.log.info("command_failed", command_id=row["id"], reason="agent-lost")
        await self._changed([*expired, *reassigned, *lost])
        await self._dispatch_pending()
        await self._republish_due()

    async def _republish_due(self) -> None:
        async with self._db.transaction() as conn:
            rows = await conn.fetch(
                store.REPUBLISH_DUE, self.config.redeliver_after_ms, self.config.silent_after_ms
            )
            for row in rows:
                if not await self._publish(row, conn):
                    return
                self.log.info("command_republished", command_id=row["id"])

    # -- agents ---------------------------------------------------------------------------

    async def _on_cert_event(self, msg: Msg) -> None:
        if self.signers is not None:
            self.signers.evict(msg.subject.rsplit(".", 1)[-1])

    async def _on_agent_event(self, msg: Msg) -> None:
        parts = msg.subject.rsplit(".", 3)
        if len(parts) != 4:
            return
        _root, site, agent, kind = parts
        try:
            if kind not in EVENT_KINDS:
                raise _invalid("subject", f"unknown agent event {kind!r}")
            doc, signature = open_event(msg.data)
            assert self.signers is not None
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

    async def _renew_lease(self, site_id: str, agent_id: str) -> bool:
        holder = await self._db.fetchval(store.LEASE_RENEW, site_id, agent_id, self.config.silent_after_ms)
        return bool(holder == agent_id)

    async def _hello(self, ev: Hello, signer: Signer) -> HelloReply:
        kinds = ev.kinds
        if kinds is not None and (len(kinds) > 512 or any(len(k) > 128 for k in kinds)):
            raise _invalid("kinds", "at most 512 kinds of up to 128 characters")
        await self._db.fetchrow(
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
        )
        stream, consumer = await self._streams.ensure_consumer(signer.site_id, signer.agent_id)
        lease = signer.role == "site" and await self._renew_lease(signer.site_id, signer.agent_id)
        self.log.info(
            "agent_hello",
            agent_id=signer.agent_id,
            site_id=signer.site_id,
            role=signer.role,
            boot_lease=lease,
        )
        task = asyncio.create_task(self._after_hello(signer), name="after-hello")
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
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
                await self._dispatch_pending(site_id=signer.site_id)
            rows = await self._db.fetch(store.AGENT_COMMANDS_TO_REPUBLISH, signer.agent_id)
            await self._deliver(rows, again=True)
        except (BcError, *_DB_ERRORS) as exc:
            self.log.warning("redelivery_deferred", agent_id=signer.agent_id, error=str(exc))

    async def _heartbeat(self, ev: Heartbeat, signer: Signer) -> HeartbeatReply:
        if ev.leaving:
            row = await self._db.fetchrow(
                store.AGENT_LEAVE, signer.agent_id, ev.signed_at_ms, self.config.silent_after_ms
            )
            if row is not None:
                await self._db.execute(store.LEASE_RELEASE, signer.site_id, signer.agent_id)
                self.log.info("agent_left", agent_id=signer.agent_id, site_id=signer.site_id)
            return HeartbeatReply(boot_lease=False)
        row = await self._db.fetchrow(store.AGENT_HEARTBEAT, signer.agent_id, ev.signed_at_ms, signer.cert_id)
        if row is None:
            if await self._db.fetchrow(store.AGENT_AGAIN, signer.agent_id) is None:
                raise BcError(ErrorCode.NOT_FOUND, "unknown agent: say hello first")
            return HeartbeatReply(boot_lease=False)  # older than one already applied
        lease = row["role"] == "site" and await self._renew_lease(signer.site_id, signer.agent_id)
        return HeartbeatReply(boot_lease=lease)

    async def _ack(self, ev: Ack) -> AckReply:
        """A claim. Taken when the command is dispatched to this agent, its digest matches and,
        for a destructive command, its batch is unexpired and approved under the approvers
        configured now; or when this very journal claimed it already (its answer was lost).
        Another journal's claim of a command that may have started settles it ``interrupted``."""
        try:
            digest = bytes.fromhex(ev.digest)
        except ValueError as exc:
            raise _invalid("digest", "expected hex") from exc
        if not isinstance(ev.journal_id, str) or len(ev.journal_id) > 64:
            raise _invalid("journalId", "a journal id is at most 64 characters")
        journal = ev.journal_id or None
        quorum = self.config.quorum.enabled
        claim = (ev.command_id, ev.agent, digest, journal, ev.signed_at_ms, quorum)
        row = await self._db.fetchrow(store.ACK, *claim)
        if row is not None:
            await self._changed([row])
            return AckReply(proceed=True, state="acked")
        cur = await self._db.fetchrow(store.CLAIM_STATE, ev.command_id)
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
        row = await self._db.fetchrow(
            store.CLAIM_INTERRUPTED, ev.command_id, ev.agent, journal, ev.signed_at_ms
        )
        if row is None:
            # A claim signed before the recorded one: a late copy from an earlier journal.
            self.log.info("claim_superseded", command_id=ev.command_id, agent_id=ev.agent)
            return AckReply(proceed=False, state=cur["state"], reason="claimed-by-another-journal")
        self.log.warning("command_interrupted", command_id=ev.command_id, agent_id=ev.agent, was=cur["state"])
        await self._changed([row])
        return AckReply(proceed=False, state="failed", reason="interrupted")

    async def _refuse_for_batch(self, ev: Ack, journal: str | None, cur: Any) -> AckReply:
        """A destructive command claimed outside a valid batch: it expires with its batch, or
        goes back to pending until the batch is approved again."""
        expired = cur["has_batch"] and cur["batch_expired"]
        sql = store.CLAIM_BATCH_EXPIRED if expired else store.CLAIM_BACK_TO_PENDING
        row = await self._db.fetchrow(sql, ev.command_id, ev.agent, journal)
        if row is None:  # changed meanwhile
            return AckReply(proceed=False, state=cur["state"], reason=cur["state"], again=True)
        self.log.warning(
            "claim_refused_batch", command_id=ev.command_id, state=row["state"], reason=row["reason"]
        )
        await self._changed([row])
        return AckReply(proceed=False, state=row["state"], reason=row["reason"], again=not expired)

    async def _progress(self, ev: Progress) -> None:
        message = ev.message[:500] if ev.message is not None else None
        row = await self._db.fetchrow(store.PROGRESS, ev.command_id, ev.agent, message)
        if row is not None and row["old_state"] != row["state"]:
            await self._changed([row])

    async def _result(self, ev: Result) -> ResultReply:
        reason = ev.reason[:500] if ev.reason is not None else None
        attested = False
        if ev.result_signature is not None:
            cur = await self._command_of(ev)
            if cur["state"] not in ("acked", "running"):
                await self._late_end(ev)
                return ResultReply(recorded=False, state=cur["state"])
            attested = await self._attest(cur["node_id"], ev)
        row = await self._db.fetchrow(
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
        await self._changed([row])
        return ResultReply(recorded=True, state=ev.status, attested=attested)

    async def _command_of(self, ev: Result) -> Any:
        """The command a result is about; ``NOT_FOUND`` or ``PERMISSION_DENIED`` if not the
        reporting agent's."""
        cur = await self._db.fetchrow(store.COMMAND_STATE, ev.command_id)
        if cur is None:
            raise BcError(ErrorCode.NOT_FOUND, "no such command", {"path": "commandId"})
        if cur["agent_id"] != ev.agent:
            raise BcError(
                ErrorCode.PERMISSION_DENIED,
                "the command is not this agent's",
                {"path": "commandId", "reason": "not-yours"},
            )
        return cur

    async def _attest(self, node_id: str, ev: Result) -> bool:
        """Check the node's signature over the result through bc-pki."""
        assert self.pki is not None
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

    async def list_agents(self, req: ApiRequest) -> AgentList:
        body = req.decode(ListAgents)
        site, ident = decode_cursor(body.cursor, str, str) or (None, None)
        rows = await self._db.fetch(
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
            _name(site, "siteId")
        elif body.node_id is not None:
            parse_id(body.node_id, "node", path="nodeId")
            site = await self._db.fetchval(store.SITE_OF_NODE, body.node_id)
            if site is None:
                return SiteAgentReply(agent_id=None)
        else:
            raise _invalid("siteId", "give siteId or nodeId")
        agent = await self._db.fetchval(store.PICK_SITE_AGENT, site, self.config.silent_after_ms, None)
        return SiteAgentReply(agent_id=agent)

    # -- batches and the quorum ----------------------------------------------------------

    async def _batch_view(self, row: Any, *, created: bool = False, conn: Any = None) -> BatchView:
        approvals = await (conn or self._db).fetch(store.APPROVALS_OF, row["id"])
        quorum = self.config.quorum
        document = bytes(row["document"])
        views = []
        for a in approvals:
            approver = quorum.approvers.get(a["approver_id"])
            counted = approver is not None and approver.verifies(bytes(a["signature"]), document)
            views.append(
                ApprovalView(approver_id=a["approver_id"], at=a["created_at"].timestamp(), counted=counted)
            )
        state: BatchState
        if row["expired"]:
            state = "expired"
        elif row["approved_at"] is not None:
            state = "approved"
        else:
            state = "open"
        return BatchView(
            id=row["id"],
            tenant_id=row["tenant_id"],
            kinds=list(row["kinds"]),
            nodes=list(row["nodes"]),
            workflow_id=row["workflow_id"],
            note=row["note"],
            state=state,
            threshold=quorum.threshold,
            approvals=views,
            created_at=row["created_at"].timestamp(),
            expires_at_ms=row["expires_at_ms"],
            document=document,
            created=created,
        )

    async def create_batch(self, req: ApiRequest) -> BatchView:
        body = req.decode(CreateBatch)
        for index, kind in enumerate(body.kinds):
            self._app.command_kind(kind, path=f"kinds[{index}]")
        for index, node in enumerate(body.nodes):
            parse_id(node, "node", path=f"nodes[{index}]")
        if body.workflow_id is not None:
            parse_id(body.workflow_id, "wf", path="workflowId")
        kinds, nodes = sorted(set(body.kinds)), sorted(set(body.nodes))
        if body.idempotency_key is not None:
            found = await self._db.fetchrow(store.BATCH_BY_KEY, body.idempotency_key)
            if found is not None:
                return await self._same_batch(found, body, kinds, nodes)
        batch_id = new_id("batch")
        expires_at_ms = time.time_ns() // 1_000_000 + body.ttl_seconds * 1000
        document = batch_document(
            batch_id=batch_id,
            tenant_id=body.tenant_id,
            kinds=kinds,
            nodes=nodes,
            expires_at_ms=expires_at_ms,
            workflow_id=body.workflow_id,
        )
        row = await self._db.fetchrow(
            store.BATCH_INSERT,
            batch_id,
            body.tenant_id,
            kinds,
            nodes,
            body.workflow_id,
            body.note,
            body.idempotency_key,
            document,
            self.config.quorum.threshold,
            expires_at_ms,
        )
        if row is None:  # another request with the same idempotency key won the race
            found = await self._db.fetchrow(store.BATCH_BY_KEY, body.idempotency_key)
            return await self._same_batch(found, body, kinds, nodes)
        self.log.info(
            "batch_created",
            batch_id=batch_id,
            kinds=kinds,
            nodes=len(nodes),
            workflow_id=body.workflow_id,
        )
        return await self._batch_view(row, created=True)

    async def _same_batch(
        self, found: Any, body: CreateBatch, kinds: list[str], nodes: list[str]
    ) -> BatchView:
        first = (found["tenant_id"], list(found["kinds"]), list(found["nodes"]))
        if first != (body.tenant_id, kinds, nodes) or found["workflow_id"] != body.workflow_id:
            raise BcError(
                ErrorCode.CONFLICT,
                "idempotency key already used for a batch with another scope",
                {"path": "idempotencyKey", "batchId": found["id"]},
            )
        return await self._batch_view(found)

    async def get_batch(self, req: ApiRequest) -> BatchView:
        ident = parse_id(req.decode(BatchIdRequest).id, "batch", path="id")
        row = await self._db.fetchrow(store.BATCH_BY_ID, ident)
        if row is None:
            raise BcError(ErrorCode.NOT_FOUND, "no such batch", {"path": "id"})
        return await self._batch_view(row)

    async def list_batches(self, req: ApiRequest) -> BatchList:
        body = req.decode(ListBatches)
        (before,) = decode_cursor(body.cursor, str) or (None,)
        sizes = await self._db.fetch(store.BATCHES_LIST, body.workflow_id, body.state, before, body.limit + 1)
        # A view carries the node list and the signed document (base64): about 2.5 times
        # the document's size.
        page, next_ = take_page(
            list(sizes), limit=body.limit, key=lambda r: (r["id"],), budget=req.page_budget,
            size=lambda r: 1024 + 3 * int(r["size"]),
        )  # fmt: skip
        rows = await self._db.fetch(store.BATCHES_BY_IDS, [r["id"] for r in page]) if page else []
        return BatchList(batches=[await self._batch_view(r) for r in rows], next=next_)

    async def approve_batch(self, req: ApiRequest) -> BatchView:
        body = req.decode(ApproveBatch)
        ident = parse_id(body.batch_id, "batch", path="batchId")
        quorum = self.config.quorum
        newly_approved = False
        async with self._db.transaction() as conn:
            # Locked, so two approvals counted at once never both miss the threshold.
            row = await conn.fetchrow(store.BATCH_BY_ID_FOR_UPDATE, ident)
            if row is None:
                raise BcError(ErrorCode.NOT_FOUND, "no such batch", {"path": "batchId"})
            if not quorum.enabled:
                raise BcError(
                    ErrorCode.INVALID_STATE,
                    "no approvers are configured: batches need no approval",
                    {"reason": "quorum-off"},
                )
            approver = quorum.approvers.get(body.approver_id)
            if approver is None:
                raise BcError(
                    ErrorCode.PERMISSION_DENIED,
                    "not a configured approver",
                    {"path": "approverId", "reason": "unknown-approver"},
                )
            if row["expired"]:
                raise BcError(
                    ErrorCode.INVALID_STATE,
                    "the batch has expired",
                    {"path": "batchId", "reason": "batch-expired"},
                )
            if not approver.verifies(body.signature, bytes(row["document"])):
                self.log.warning("approval_refused", batch_id=ident, approver_id=body.approver_id)
                raise BcError(
                    ErrorCode.UNAUTHENTICATED,
                    "the signature is not this approver's over this batch's document",
                    {"path": "signature", "reason": "bad-signature"},
                )
            inserted = await conn.fetchval(store.APPROVAL_INSERT, ident, body.approver_id, body.signature)
            was_approved = row["approved_at"] is not None
            approved = await self._recount(conn, row)
            newly_approved = approved and not was_approved
            view = await self._batch_view(await conn.fetchrow(store.BATCH_BY_ID, ident), conn=conn)
        self.log.info(
            "batch_approval",
            batch_id=ident,
            approver_id=body.approver_id,
            duplicate=inserted is None,
            approved=approved,
        )
        if newly_approved:
            await self._dispatch_pending(batch_id=ident)
        return view

    async def _recount(self, conn: Any, row: Any) -> bool:
        """Count the valid approvals under the configured approvers; record the outcome."""
        quorum = self.config.quorum
        document = bytes(row["document"])
        counted = 0
        for a in await conn.fetch(store.APPROVALS_OF, row["id"]):
            approver = quorum.approvers.get(a["approver_id"])
            if approver is not None and approver.verifies(bytes(a["signature"]), document):
                counted += 1
        approved = quorum.enabled and counted >= quorum.threshold
        await conn.execute(store.BATCH_SET_APPROVED, row["id"], approved)
        return approved

    async def _recount_batches(self) -> None:
        """At start: approvals count under the approvers configured now (one may be gone). The
        dispatched, unclaimed commands of a batch no longer approved go back to pending."""
        withdrawn: list[Any] = []
        for ident in [r["id"] for r in await self._db.fetch(store.BATCHES_UNEXPIRED)]:
            async with self._db.transaction() as conn:
                row = await conn.fetchrow(store.BATCH_BY_ID_FOR_UPDATE, ident)
                if row is not None and not await self._recount(conn, row) and self.config.quorum.enabled:
                    withdrawn += await conn.fetch(store.BATCH_UNDISPATCH, ident)
        for row in withdrawn:
            self.log.info("command_undispatched", command_id=row["id"], reason=row["reason"])
        await self._changed(withdrawn)

    async def get_quorum(self, _req: ApiRequest) -> QuorumView:
        quorum = self.config.quorum
        return QuorumView(
            enabled=quorum.enabled,
            threshold=quorum.threshold,
            approvers=[ApproverView(id=a.id, public_key=a.public_key_b64) for a in quorum.approvers.values()],
        )
