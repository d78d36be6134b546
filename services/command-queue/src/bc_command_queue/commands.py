"""Commands: enqueue, read, cancel.

A command is a row in PostgreSQL (the truth). Enqueue is find-before-create on the node's key;
a site command goes out at once when an agent is there (and, for a destructive one, its batch
was approved), else it waits ``pending`` for the sweeper's dispatch.
"""

from __future__ import annotations

import re
import time
from typing import Any, Final

import msgspec

from better_compute.app import App
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id, parse_id
from better_compute.core.keys import workflow_command_prefix
from better_compute.core.names import parse_name
from better_compute.core.plugins import CommandKind
from better_compute.service import ApiRequest
from better_compute.service.audit import requester
from better_compute.service.fences import attempt_superseded
from better_compute.service.groups import GroupCommit
from better_compute.wire.agent import payload_digest
from better_compute.wire.cmdq import (
    ENGINE_PROOF_MAX_AGE_MS,
    MAX_STATE_QUERY,
    CancelCommands,
    CancelReply,
    CommandIdRequest,
    CommandList,
    CommandStates,
    CommandStatesReply,
    CommandView,
    EnqueueCommand,
    ListCommands,
    LiveWithRef,
    LiveWithRefReply,
    RunningAt,
    enqueue_proof_document,
)

from .config import CmdqConfig
from .delivery import Changed, Deliveries
from .rows import ClaimedRow, CommandRow
from .storage import NewCommand, Store, row_may_be_at_fault
from .views import command_view

__all__ = ["Commands", "check_name", "invalid"]

MAX_TIMEOUT_MS: Final = 7 * 24 * 3600 * 1000
MIN_TIMEOUT_MS: Final = 1_000
MAX_PAYLOAD_BYTES: Final = 256 * 1024
MAX_KEY_LENGTH: Final = 256
_KEY_RE: Final = re.compile(r"^[\x21-\x7e]{1,256}$")


def invalid(path: str, message: str) -> BcError:
    return BcError(ErrorCode.INVALID_INPUT, message, {"path": path})


def check_name(value: str, path: str) -> str:
    """A site or tenant name (``parse_name``: the same rule and words in every service)."""
    return parse_name(value, path=path)


def _carries(value: Any, ref: str) -> bool:
    """Whether ``ref`` is one of the strings anywhere in a JSON value."""
    if isinstance(value, str):
        return value == ref
    if isinstance(value, dict):
        return any(_carries(v, ref) for v in value.values())
    if isinstance(value, list):
        return any(_carries(v, ref) for v in value)
    return False


class Commands:
    """The ``commands.*`` routes."""

    def __init__(
        self,
        *,
        store: Store,
        config: CmdqConfig,
        app: App,
        deliveries: Deliveries,
        changed: Changed,
        log: Any,
    ) -> None:
        self.store = store
        self.config = config
        self.app = app
        self.deliveries = deliveries
        self.changed = changed
        self.log = log
        self.inserted: GroupCommit[NewCommand, CommandRow | None] = GroupCommit(
            lambda news: store.insert_many(news, silent_after_ms=config.silent_after_ms),
            key=lambda n: (n.node_id, n.key),
            row_by_row=row_may_be_at_fault,
        )
        """Enqueues arriving at the same moment, inserted in one statement and one commit
        (``COMMAND_INSERT_MANY``): a commit each was the largest statement of the command path."""

    def _check_enqueue(self, body: EnqueueCommand) -> tuple[CommandKind, bytes]:
        """Everything about a new command that needs no database; returns the kind and the
        canonical payload."""
        parse_id(body.node_id, "node", path="nodeId")
        check_name(body.site_id, "siteId")
        check_name(body.tenant_id, "tenantId")
        if not isinstance(body.key, str) or _KEY_RE.fullmatch(body.key) is None:
            raise invalid("key", f"a key is 1-{MAX_KEY_LENGTH} printable characters")
        if body.workflow_id is not None:
            parse_id(body.workflow_id, "wf", path="workflowId")
        if body.step is not None and not 0 <= body.step <= 511:
            raise invalid("step", "a step index is 0 to 511")
        if body.batch_id is not None:
            parse_id(body.batch_id, "batch", path="batchId")
        if not MIN_TIMEOUT_MS <= body.timeout_ms <= MAX_TIMEOUT_MS:
            raise invalid("timeoutMs", f"between {MIN_TIMEOUT_MS} and {MAX_TIMEOUT_MS} ms")
        kind = self.app.command_kind(body.kind, path="kind")
        if body.sends is not None and body.kind not in body.sends:
            raise BcError(
                ErrorCode.INVALID_CONFIG,
                f"the step declares sends {sorted(body.sends)}, not {body.kind!r}",
                {"path": "kind", "reason": "undeclared-kind"},
            )
        payload = kind.payload.validate(body.payload, path="payload")
        canonical = msgspec.json.encode(payload, order="sorted")
        if len(canonical) > MAX_PAYLOAD_BYTES:
            raise invalid("payload", f"payload is larger than {MAX_PAYLOAD_BYTES} bytes")
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
        batch = await self.store.batch_by_id(body.batch_id)
        if batch is None:
            raise BcError(ErrorCode.NOT_FOUND, "no such batch", {"path": "batchId"})
        if batch.tenant_id != body.tenant_id:
            raise BcError(
                ErrorCode.INVALID_INPUT,
                "the batch belongs to another tenant",
                {"path": "batchId", "reason": "outside-batch-scope"},
            )
        if body.kind not in batch.kinds:
            raise BcError(
                ErrorCode.INVALID_INPUT,
                f"{body.kind} is outside the batch's scope",
                {"path": "kind", "reason": "outside-batch-scope"},
            )
        if body.node_id not in batch.nodes:
            raise BcError(
                ErrorCode.INVALID_INPUT,
                "the node is outside the batch's scope",
                {"path": "nodeId", "reason": "outside-batch-scope"},
            )
        # The approvers signed the batch's workflowId. A workflow's batch admits that workflow's
        # commands only; an operator's batch (no workflowId) admits only commands sent directly,
        # by no workflow: approving a job by hand approves nothing a workflow may send. (A bulk
        # verb's batch names the set of workflows it started: a membership test.)
        bulk = list(batch.workflow_ids)
        if (body.workflow_id not in bulk) if bulk else (body.workflow_id != batch.workflow_id):
            if bulk:
                signed_for = f"{len(bulk)} other workflows"
            elif batch.workflow_id:
                signed_for = f"workflow {batch.workflow_id}"
            else:
                signed_for = "no workflow"
            raise BcError(
                ErrorCode.INVALID_INPUT,
                f"the batch was signed for {signed_for}",
                {"path": "workflowId", "reason": "outside-batch-scope"},
            )
        if batch.expired:
            raise BcError(
                ErrorCode.INVALID_STATE,
                "the batch has expired",
                {"path": "batchId", "reason": "batch-expired"},
            )
        return body.batch_id, (not quorum.enabled) or batch.approved_at is not None

    async def _existing(self, body: EnqueueCommand) -> CommandView | None:
        row = await self.store.command_by_key(body.node_id, body.key)
        if row is None:
            return None
        if row.kind != body.kind:
            raise BcError(
                ErrorCode.CONFLICT,
                f"key {body.key!r} of this node is already a {row.kind} command",
                {"path": "key", "commandId": row.id},
            )
        return command_view(row)

    def _check_sender(self, req: ApiRequest, body: EnqueueCommand) -> None:
        """Only the engine enqueues commands under a workflow (they run under the workflow's
        batch). In a deployment nats-server says who sent it: a request that crossed an import
        (the operators' account, a site's) carries its ``Nats-Request-Info`` and is not the
        engine's, whatever it claims; inside the services' account only the engine may publish
        here (deploy/nats). In a stack without accounts, the engine's proof under
        ``cmdq.engine_key_file``. Never a header the sender writes (``Bc-Actor``)."""
        if body.workflow_id is None:
            return
        denied = BcError(
            ErrorCode.PERMISSION_DENIED,
            "only the engine enqueues commands under a workflow; an operator's command names no"
            " workflow and runs under a batch of its own",
            {"path": "workflowId", "reason": "not-the-engine"},
        )
        if requester(req.headers).imported:
            self.log.warning("enqueue_not_the_engine", workflow_id=body.workflow_id, why="imported")
            raise denied
        key = self.config.engine_key
        if key is None:
            return
        at, _, mac = (body.engine_proof or "").partition(":")
        now_ms = time.time_ns() // 1_000_000
        fresh = at.isdigit() and abs(now_ms - int(at)) <= ENGINE_PROOF_MAX_AGE_MS
        if not fresh or not key.check_mac(enqueue_proof_document(body, int(at)), mac):
            self.log.warning("enqueue_not_the_engine", workflow_id=body.workflow_id, why="no-proof")
            raise denied

    async def enqueue(self, req: ApiRequest) -> CommandView:
        body = req.decode(EnqueueCommand)
        self._check_sender(req, body)
        kind, canonical = self._check_enqueue(body)
        batch_id: str | None = None
        may_dispatch = True
        # A workflow's boot command inside its batch (its profile writes disks) is held and
        # checked as a destructive one: what it boots writes the disk.
        destructive = kind.destructive or body.in_batch
        if destructive:
            # Find before checking the batch: a re-run finds its command even after the
            # batch expired.
            found = await self._existing(body)
            if found is not None:
                return found
            batch_id, may_dispatch = await self._check_batch(body)
        command_id = new_id("cmd")
        not_after_ms = time.time_ns() // 1_000_000 + body.timeout_ms
        new = NewCommand(
            id=command_id,
            node_id=body.node_id,
            site_id=body.site_id,
            tenant_id=body.tenant_id,
            key=body.key,
            kind=body.kind,
            destructive=destructive,
            target=body.target,
            payload=canonical.decode(),
            digest=bytes.fromhex(payload_digest(body.kind, canonical)),
            batch_id=batch_id,
            workflow_id=body.workflow_id,
            step=body.step,
            not_after_ms=not_after_ms,
            may_dispatch=may_dispatch,
        )
        row = await self.inserted(new)
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
            state=row.state,
            agent_id=row.agent_id,
            workflow_id=body.workflow_id,
        )
        await self.changed([row])
        if row.state == "dispatched":
            await self.deliveries.deliver([row])
        return command_view(row, created=True)

    async def get(self, req: ApiRequest) -> CommandView:
        ident = parse_id(req.decode(CommandIdRequest).id, "cmd", path="id")
        row = await self.store.command_by_id(ident)
        if row is None:
            raise BcError(ErrorCode.NOT_FOUND, "no such command", {"path": "id"})
        return command_view(row)

    async def states(self, req: ApiRequest) -> CommandStatesReply:
        body = req.decode(CommandStates)
        if len(body.ids) > MAX_STATE_QUERY:
            raise BcError(
                ErrorCode.INVALID_INPUT, f"at most {MAX_STATE_QUERY} ids a request", {"path": "ids"}
            )
        return CommandStatesReply(states=await self.store.command_states(body.ids))

    async def list_commands(self, req: ApiRequest) -> CommandList:
        body = req.decode(ListCommands)
        if body.before is not None:
            parse_id(body.before, "cmd", path="before")
        rows = await self.store.list_commands(
            node_id=body.node_id,
            workflow_id=body.workflow_id,
            state=body.state,
            kind=body.kind,
            site_id=body.site_id,
            agent_id=body.agent_id,
            batch_id=body.batch_id,
            before=body.before,
            limit=body.limit,
        )
        views = [command_view(r, full=False) for r in rows]
        more = len(views) == body.limit
        return CommandList(commands=views, next=views[-1].id if more and views else None)

    async def cancel(self, req: ApiRequest) -> CancelReply:
        body = req.decode(CancelCommands)
        if len(body.reason) > 200:
            raise invalid("reason", "at most 200 characters")
        running: list[ClaimedRow] = []
        if body.id is not None:
            ident = parse_id(body.id, "cmd", path="id")
            rows = await self.store.cancel(ident, body.reason)
            if not rows and await self.store.command_state(ident) is None:
                raise BcError(ErrorCode.NOT_FOUND, "no such command", {"path": "id"})
        elif body.key_prefix is not None:
            if not body.key_prefix or len(body.key_prefix) > MAX_KEY_LENGTH:
                raise invalid("keyPrefix", f"1 to {MAX_KEY_LENGTH} characters")
            if body.node_id is not None:
                parse_id(body.node_id, "node", path="nodeId")
            if body.workflow_id is not None:
                parse_id(body.workflow_id, "wf", path="workflowId")
            if body.fence:
                await self._fence(body)
            under = {"node_id": body.node_id, "workflow_id": body.workflow_id}
            rows = await self.store.cancel_under(body.key_prefix, reason=body.reason, **under)
            lost_after_ms = self.config.lost_after_ms
            running = await self.store.claimed_under(body.key_prefix, lost_after_ms=lost_after_ms, **under)
        else:
            raise invalid("id", "give id, or keyPrefix (with nodeId or workflowId)")
        for row in rows:
            self.log.info("command_cancelled", command_id=row.id, reason=body.reason)
        await self.changed(rows)
        return CancelReply(
            cancelled=[r.id for r in rows],
            running=[r.id for r in running],
            running_at=[
                RunningAt(command_id=r.id, agent_id=r.agent_id, journal_id=r.claim_journal) for r in running
            ],
        )

    async def _fence(self, body: CancelCommands) -> None:
        """From now on refuse every enqueue under a superseded step attempt's key prefix.

        The fence commits before the cancel looks for live commands: a command created
        meanwhile is either cancelled by it or sees the fence itself (``_refuse_superseded``).
        """
        assert body.key_prefix is not None
        if body.workflow_id is None or not body.key_prefix.startswith(
            f"{workflow_command_prefix(body.workflow_id)}:"
        ):
            raise invalid("keyPrefix", "a fence is for one workflow: wf:<workflowId>:<step>#<attempt>")
        await self.store.fence(body.key_prefix, body.workflow_id, body.reason)

    async def _refuse_superseded(self, body: EnqueueCommand, row: CommandRow) -> None:
        """A command just created under the key of a superseded step attempt (an engine that
        lost its shard still runs it) is cancelled before it goes out, and refused."""
        if body.workflow_id is None or not await self.store.fenced(body.key):
            return
        rows = await self.store.cancel_superseded(row.id)
        await self.changed(rows)
        self.log.warning("command_refused_superseded", command_id=row.id, workflow_id=body.workflow_id)
        raise attempt_superseded("sends", path="key")

    async def live_with_ref(self, req: ApiRequest) -> LiveWithRefReply:
        body = req.decode(LiveWithRef)
        if not body.key_prefix:
            raise invalid("keyPrefix", "a key prefix is required")
        for command_id, payload in await self.store.live_under(body.agent_id, body.key_prefix, body.node_id):
            if _carries(msgspec.json.decode(payload), body.ref):
                return LiveWithRefReply(live=True, command_id=command_id)
        return LiveWithRefReply(live=False)
