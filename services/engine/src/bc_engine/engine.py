"""Running workflows: one reconciler pass per key, step by step.

A control-plane step is marked running in one transaction, runs outside any
transaction, and is settled in another that first checks it is still running with the
same attempt and that this process still holds the key's shard under the same epoch.
A process that dies in between leaves the step running; the next owner runs it again
under the same idempotency key. Agent steps enqueue their command through the
command-queue (find-before-create by key) and wait for its settle event.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import msgspec

from better_compute.app import App
from better_compute.cmdq_client import CommandQueueClient
from better_compute.core.errors import BcError, ErrorCode, ServiceUnavailableError
from better_compute.pki_client import PkiClient, attempt_key
from better_compute.provision import Profile, StepNotReady, profile_from_document
from better_compute.secrets_client import SecretsClient
from better_compute.service.client import ApiClient
from better_compute.service.db import Database
from better_compute.service.faults import describe, is_transient
from better_compute.wire.cmdq import LIVE_STATES, CommandView, EnqueueCommand

from . import queue
from .context import EngineSql, NodeInfo, RunContext, StepCommands, StepWorkflows
from .profiles import BUILTIN_TENANT
from .shards import ShardLeases

__all__ = ["AGENT_POLL_S", "Engine", "FencedError"]

AGENT_POLL_S = 10.0  # workflowPollMs: every waiting command is looked at at least this often
BATCH_TTL_S = 24 * 3600  # how long approvers have for a workflow's destructive batch
QUEUE_RETRY_S = 2.0  # the command-queue did not answer: try again this soon
SUPERSEDED_POLL_S = 2.0  # a previous attempt's command still runs: look again this soon
SERVICE_WAIT_S = (0.25, 5.0)  # backoff while one of our services is away: first, longest
FENCE = (
    "EXISTS (SELECT 1 FROM shard_leases WHERE shard = {s} AND owner = {o} AND epoch = {e}"
    " AND expires_at > now())"
)

OwnerReconciler = Callable[[Any, str], Awaitable[None]]

_RUNNING_SET = (
    "state = 'running', attempt = attempt + 1, started_at = clock_timestamp(),"
    " deadline = clock_timestamp() + make_interval(secs => timeout_ms / 1000.0),"
    " finished_at = NULL, sent_commands = false, minted = ARRAY[]::text[], waiting_for = NULL, result = NULL,"
    " error = NULL, command_id = NULL"
)
# A new attempt starts only if what the previous one sent or minted is what the pass saw (and
# dealt with): an engine that lost its shard may still run the previous attempt meanwhile.
MARK_RUNNING = (
    f"UPDATE workflow_steps SET {_RUNNING_SET}"
    " WHERE workflow_id = $1 AND idx = $2 AND state = 'pending' AND attempt = $3"
    " AND sent_commands = $4 AND minted = $5::text[] AND {fence} RETURNING *"
)
# No earlier attempt of the step sent commands or minted tokens or secrets: it may start at once.
_FRESH = "(attempt = 0 OR NOT (sent_commands OR cardinality(minted) > 0))"
SETTLE = (
    "UPDATE workflow_steps SET state = $4, result = $5, error = $6, finished_at = clock_timestamp(),"
    " waiting_for = NULL"
    " WHERE workflow_id = $1 AND idx = $2 AND state = 'running' AND attempt = $3"
    " AND {fence} RETURNING true"
)
# Both record what an attempt did, and only for that attempt (a superseded one learns so).
MARK_SENT = (
    "UPDATE workflow_steps SET sent_commands = true"
    " WHERE workflow_id = $1 AND idx = $2 AND attempt = $3 RETURNING true"
)
MARK_MINTED = (
    "UPDATE workflow_steps SET minted = CASE WHEN $4 = ANY (minted) THEN minted ELSE minted || $4 END,"
    " mint_secret = COALESCE(mint_secret, $5)"
    " WHERE workflow_id = $1 AND idx = $2 AND attempt = $3 RETURNING mint_secret"
)
# The next step starts in the settle's transaction, unless an earlier attempt of it sent
# commands or minted what must be cancelled or revoked first (the pass does that outside any
# transaction).
START_NEXT = (
    f"UPDATE workflow_steps SET {_RUNNING_SET}"
    f" WHERE workflow_id = $1 AND state = 'pending' AND {_FRESH}"
    " AND idx = (SELECT min(idx) FROM workflow_steps WHERE workflow_id = $1 AND idx > $2"
    "   AND state <> 'succeeded')"
    " RETURNING *"
)
# Settle a success, start the next step, or finish the workflow (and queue its owner): one
# statement, so one round trip and one commit per step. $1 workflow, $2 idx, $3 attempt,
# $4 result, $5-$7 fence, $8 owner's work-queue key (or NULL), $9 its shard.
SETTLE_OK = f"""
WITH settled AS (
    UPDATE workflow_steps SET state = 'succeeded', result = $4, finished_at = clock_timestamp(),
        waiting_for = NULL
    WHERE workflow_id = $1 AND idx = $2 AND state = 'running' AND attempt = $3
      AND {FENCE.format(s="$5", o="$6", e="$7")}
    RETURNING idx
), following AS (
    SELECT min(idx) AS idx FROM workflow_steps WHERE workflow_id = $1 AND idx > $2 AND state <> 'succeeded'
), started AS (
    UPDATE workflow_steps SET {_RUNNING_SET}
    WHERE workflow_id = $1 AND state = 'pending' AND {_FRESH}
      AND idx = (SELECT idx FROM following) AND EXISTS (SELECT 1 FROM settled)
    RETURNING *
), finished AS (
    UPDATE workflows SET state = 'succeeded', finished_at = now(), updated_at = now()
    WHERE id = $1 AND state = 'running' AND EXISTS (SELECT 1 FROM settled)
      AND (SELECT idx FROM following) IS NULL
    RETURNING owner
), owner_queued AS (
    INSERT INTO work_queue (rkey, shard, not_before)
    SELECT $8, $9, now() FROM finished WHERE $8::text IS NOT NULL
    ON CONFLICT (rkey) DO UPDATE SET not_before = now(), seq = nextval('work_seq')
    RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM settled) AS settled,
       EXISTS (SELECT 1 FROM finished) AS finished,
       (SELECT row_to_json(started) FROM started) AS next,
       (SELECT count(*) FROM owner_queued) AS owner_queued
"""
START_FIRST = (
    f"UPDATE workflow_steps SET {_RUNNING_SET}"
    f" WHERE workflow_id = $1 AND state = 'pending' AND {_FRESH}"
    " AND idx = (SELECT min(idx) FROM workflow_steps WHERE workflow_id = $1 AND state <> 'succeeded')"
    " AND {fence} RETURNING *"
)
_LOST = object()
_FINISHED = object()


class FencedError(Exception):
    """This process no longer holds the shard: stop, the new owner carries on."""


def _superseded() -> BcError:
    return BcError(
        ErrorCode.INVALID_STATE,
        "this step attempt was superseded by a later one: it sends and mints nothing any more",
        {"reason": "attempt-superseded"},
    )


def _timed_out(step: Mapping[str, Any]) -> BcError:
    """The step's deadline passed; ``details.waitingFor`` says what it waited for, if anything."""
    details: dict[str, Any] = {"path": f"steps[{step['idx']}]"}
    if step.get("waiting_for"):
        details["waitingFor"] = _json(step["waiting_for"])
    return BcError(
        ErrorCode.TIMEOUT, f"step {step['action']} did not finish within {step['timeout_ms']} ms", details
    )


def _backoff(tries: int) -> float:
    """Seconds to wait before the ``tries``-th look at a service that is away, with jitter."""
    first, longest = SERVICE_WAIT_S
    delay: float = min(first * 2.0 ** max(tries - 1, 0), longest)
    return delay * random.uniform(0.5, 1.5)


@dataclass(frozen=True)
class _Ok:
    result: Any


@dataclass(frozen=True)
class _Fail:
    error: BcError


@dataclass(frozen=True)
class _Wait:
    at: float


def _step_row(doc: Any) -> dict[str, Any]:
    """A step row that came back as JSON (``row_to_json``) with the types of a fetched row."""
    row = dict(doc)
    for key in ("started_at", "deadline", "finished_at"):
        if isinstance(row.get(key), str):
            row[key] = datetime.fromisoformat(row[key])
    return row


def _error_doc(err: BcError) -> str:
    return json.dumps({"code": err.code.value, "message": err.message, "details": err.details})


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _agent_result(raw: bytes | None) -> Any:
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return {"base64": base64.b64encode(raw).decode()}


class Engine:
    """The workflow reconciler of one engine process."""

    def __init__(
        self,
        *,
        app: App,
        db: Database,
        api: ApiClient,
        leases: ShardLeases,
        instance: str,
        log: Any,
        publish: Callable[[str, str, Any], Awaitable[None]],
        owners: Mapping[str, OwnerReconciler] | None = None,
        start_in: Any = None,
        wake: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.app = app
        self.db = db
        self.api = api
        self.leases = leases
        self.instance = instance
        self.log = log
        self.publish = publish
        self.cmdq = CommandQueueClient(api)
        self.pki = PkiClient(api)
        self.secrets = SecretsClient(api)
        self.owners = dict(owners or {})
        self.start_in = start_in
        self.wake = wake
        self._profiles: dict[tuple[str, str, int], Profile] = {}  # pinned versions never change
        self._quorum: tuple[bool, float] | None = None

    # -- helpers used by the step context ---------------------------------------

    async def mark_sent(self, workflow_id: str, idx: int, attempt: int) -> None:
        """Record that this attempt sends commands (before it does); refused once the attempt
        was superseded, so a late run of it sends nothing."""
        if not await self.db.fetchval(MARK_SENT, workflow_id, idx, attempt):
            raise _superseded()

    async def mark_minted(self, workflow_id: str, idx: int, attempt: int, service: str) -> bytes:
        """Record that this attempt mints tokens (``pki``) or stores secrets (``secrets``);
        returns the step's mint secret (see ``StepPki``), the same on every run."""
        secret: bytes | None = await self.db.fetchval(
            MARK_MINTED, workflow_id, idx, attempt, service, os.urandom(32)
        )
        if secret is None:
            raise _superseded()
        return secret

    async def cmdq_enqueue(self, cmd: EnqueueCommand) -> CommandView:
        return await self.cmdq.enqueue(cmd)

    async def site_agent_for(self, node_id: str) -> str | None:
        site = await self.db.fetchval("SELECT site_id FROM nodes WHERE id = $1", node_id)
        return (
            await self.cmdq.site_agent(site_id=site) if site else await self.cmdq.site_agent(node_id=node_id)
        )

    # -- one pass -----------------------------------------------------------------

    async def reconcile(self, rkey: str) -> float | None:
        """One pass over ``rkey``; returns when it next wants a look (epoch seconds)."""
        shard = queue.shard_of(rkey)
        epoch = self.leases.owns(shard)
        if epoch is None:
            raise FencedError(rkey)
        if ":" in rkey:
            seen = await queue.read_seq(self.db.pool, rkey)
            nxt = await self._reconcile_owner(rkey)
        else:
            # the queue entry's seq comes along with the workflows: one round trip
            wfs = await self.db.fetch(
                "SELECT (SELECT seq FROM work_queue WHERE rkey = $1) AS queue_seq, * FROM workflows"
                " WHERE rkey = $1 AND (state = 'running' OR cancel_commands) ORDER BY created_at",
                rkey,
            )
            seen = wfs[0]["queue_seq"] if wfs else await queue.read_seq(self.db.pool, rkey)
            times = []
            for wf in wfs:
                t = await self._advance(dict(wf), shard, epoch)
                if t is not None:
                    times.append(t)
            nxt = min(times) if times else None
        if nxt is None:
            await queue.done(self.db.pool, rkey, seen)
        else:
            await queue.queue_at(self.db.pool, rkey, nxt, seen)
        return nxt

    async def _reconcile_owner(self, rkey: str) -> float | None:
        owner, _, workflow_id = rkey.partition(":")
        fn = self.owners.get(owner)
        if fn is None:
            self.log.warning("owner_unknown", owner=owner, workflow_id=workflow_id)
            return None
        try:
            await fn(self, workflow_id)
        except StepNotReady as nr:
            return time.time() + nr.retry_after_ms / 1000
        except Exception:
            self.log.exception("owner_reconciler_failed", owner=owner, workflow_id=workflow_id)
            return time.time() + 5.0
        return None

    def _fence(self, base: int) -> str:
        return FENCE.format(s=f"${base}", o=f"${base + 1}", e=f"${base + 2}")

    async def _quorum_enabled(self) -> bool:
        """Whether the command-queue has approvers configured (asked at most once a minute)."""
        now = time.time()
        if self._quorum is None or now - self._quorum[1] > 60.0:
            self._quorum = ((await self.cmdq.quorum()).enabled, now)
        return self._quorum[0]

    async def _ensure_batch(self, wf: dict[str, Any]) -> float | None:
        """Under the quorum, a workflow that can send destructive commands gets its batch before it
        sends anything: scope = its destructive kinds and its node, found by the workflow's key."""
        if wf["batch_id"] is not None or wf["state"] != "running":
            return None
        kinds = [
            k for k in wf["command_kinds"] if (kind := self.app.command_kinds.get(k)) and kind.destructive
        ]
        if not kinds:
            return None
        try:
            if not await self._quorum_enabled():
                return None
            batch = await self.cmdq.create_batch(
                tenant_id=wf["tenant_id"],
                kinds=kinds,
                nodes=[wf["node_id"]] if wf["node_id"] else [],
                ttl_seconds=BATCH_TTL_S,
                workflow_id=wf["id"],
                idempotency_key=f"wf:{wf['id']}",
                note=f"workflow {wf['id']} ({wf['profile_id']}@{wf['profile_version']})",
            )
        except BcError as err:
            self.log.warning("batch_create_failed", workflow_id=wf["id"], code=err.code.value)
            return time.time() + QUEUE_RETRY_S
        batch_id = batch.id
        await self.db.execute(
            "UPDATE workflows SET batch_id = $2, updated_at = now() WHERE id = $1 AND batch_id IS NULL",
            wf["id"],
            batch_id,
        )
        wf["batch_id"] = batch_id
        await self.publish(
            "workflow", wf["id"], {"workflowId": wf["id"], "batchId": batch_id, "at": time.time()}
        )
        return None

    async def _advance(self, wf: dict[str, Any], shard: int, epoch: int) -> float | None:
        fence = (shard, self.instance, epoch)
        step: dict[str, Any] | None = None  # known from the previous settle, else read
        retry_at = await self._ensure_batch(wf)
        if retry_at is not None:
            return retry_at
        while True:
            if wf["state"] != "running":
                return await self._cleanup_aborted(wf)
            if step is None:
                # the usual case, a first step to start, in one statement
                row = await self.db.fetchrow(START_FIRST.format(fence=self._fence(2)), wf["id"], *fence)
                if row is not None:
                    step = dict(row)
                    await self._event(wf, "running", step)
                    continue
                row = await self.db.fetchrow(
                    "SELECT * FROM workflow_steps WHERE workflow_id = $1 AND state <> 'succeeded'"
                    " ORDER BY idx LIMIT 1",
                    wf["id"],
                )
                if row is None:
                    await self._finish(wf, "succeeded", None, fence)
                    return None
                step = dict(row)
            if step["state"] == "pending":
                if step["attempt"] > 0 and (step["sent_commands"] or step["minted"]):
                    # never issue attempt N+1 while attempt N's commands may still run, nor
                    # leave its tokens and secrets usable
                    wait = await self._supersede(wf, step)
                    if wait is not None:
                        return wait
                row = await self.db.fetchrow(
                    MARK_RUNNING.format(fence=self._fence(6)),
                    wf["id"], step["idx"], step["attempt"], step["sent_commands"], list(step["minted"]),
                    *fence,
                )  # fmt: skip
                if row is None:
                    wf, step = await self._reload(wf, fence), None
                    continue
                step = dict(row)
                await self._event(wf, "running", step)
            if step["state"] != "running":
                # failed or cancelled while the workflow still says running: a verb will settle it
                return None
            deadline = step["deadline"].timestamp()
            if time.time() >= deadline:
                outcome: _Ok | _Fail | _Wait = _Fail(_timed_out(step))
            elif step["mode"] == "control-plane":
                outcome = await self._run_control_plane(wf, step, deadline)
            else:
                outcome = await self._run_agent_step(wf, step, deadline)
            match outcome:
                case _Wait(at=at):
                    return float(min(at, deadline))
                case _Ok(result=result):
                    settled = await self._settle_ok(wf, step, result, fence)
                    if settled is _LOST:
                        wf, step = await self._reload(wf, fence), None
                        continue
                    await self._event(wf, "succeeded", step, result=result)
                    if settled is _FINISHED:
                        await self._event(wf, "succeeded", None)
                        return None
                    step = settled if isinstance(settled, dict) else None
                    if step is not None:
                        await self._event(wf, "running", step)
                case _Fail(error=error):
                    if await self._settle_failed(wf, step, error, fence):
                        await self._event(wf, "failed", step, error=error)
                        return None
                    wf, step = await self._reload(wf, fence), None

    async def _reload(self, wf: dict[str, Any], fence: tuple[int, str, int]) -> dict[str, Any]:
        """A settle found nothing to settle: either we were fenced off, or a verb moved it."""
        held = await self.db.fetchval(f"SELECT {self._fence(1)}", *fence)
        if not held:
            raise FencedError(wf["id"])
        row = await self.db.fetchrow("SELECT * FROM workflows WHERE id = $1", wf["id"])
        return dict(row)

    async def _settle_ok(
        self, wf: dict[str, Any], step: dict[str, Any], result: Any, fence: tuple[int, str, int]
    ) -> Any:
        """Settle a success and, in the same statement (one transaction, one round trip),
        start the next step or finish the workflow and queue its owner.

        Returns ``_LOST`` (nothing to settle: fenced or moved by a verb), ``_FINISHED``, the
        next step's row when it was started, or ``None`` when the next step needs more care
        (commands of an earlier attempt to cancel first).
        """
        owner_rkey = queue.owner_key(wf["owner"], wf["id"]) if wf["owner"] else None
        row = await self.db.fetchrow(
            SETTLE_OK,
            wf["id"], step["idx"], step["attempt"], json.dumps(result), *fence,
            owner_rkey, queue.shard_of(owner_rkey) if owner_rkey else None,
        )  # fmt: skip
        if not row["settled"]:
            return _LOST
        if row["next"] is not None:
            return _step_row(row["next"])
        if row["finished"]:
            wf["state"] = "succeeded"
            return _FINISHED
        return None

    async def _settle_failed(
        self, wf: dict[str, Any], step: dict[str, Any], error: BcError, fence: tuple[int, str, int]
    ) -> bool:
        async with self.db.transaction() as conn:
            done = await conn.fetchval(
                SETTLE.format(fence=self._fence(7)),
                wf["id"], step["idx"], step["attempt"], "failed", None, _error_doc(error), *fence,
            )  # fmt: skip
            if not done:
                return False
            await self._finish_in(conn, wf, "failed", error)
        return True

    async def _finish(
        self, wf: dict[str, Any], state: str, error: BcError | None, fence: tuple[int, str, int]
    ) -> None:
        async with self.db.transaction() as conn:
            held = await conn.fetchval(f"SELECT {self._fence(1)}", *fence)
            if not held:
                raise FencedError(wf["id"])
            await self._finish_in(conn, wf, state, error)
        await self._event(wf, state, None)

    async def _finish_in(self, conn: Any, wf: dict[str, Any], state: str, error: BcError | None) -> None:
        updated = await conn.fetchval(
            "UPDATE workflows SET state = $2, error = $3, finished_at = now(), updated_at = now()"
            " WHERE id = $1 AND state = 'running' RETURNING true",
            wf["id"],
            state,
            _error_doc(error) if error else None,
        )
        if updated and wf["owner"]:
            await queue.queue_now(conn, queue.owner_key(wf["owner"], wf["id"]))
        wf["state"] = state

    async def _cleanup_aborted(self, wf: dict[str, Any]) -> float | None:
        """After an abort: revoke what the cancelled attempt minted, fence it, and cancel the
        workflow's live commands on every node it sent to (retried until the services answer)."""
        if not wf.get("cancel_commands"):
            return None
        step = await self.db.fetchrow(
            "SELECT idx, attempt, sent_commands, minted FROM workflow_steps"
            " WHERE workflow_id = $1 AND state = 'cancelled' ORDER BY idx LIMIT 1",
            wf["id"],
        )
        sent = await self.db.fetchval(
            "SELECT bool_or(sent_commands) FROM workflow_steps WHERE workflow_id = $1", wf["id"]
        )
        try:
            if step is not None and step["attempt"] > 0:
                await self._revoke_attempt(wf, dict(step), reason="its workflow was aborted")
            if sent:
                await self.cmdq.cancel_under(
                    key_prefix=f"wf:{wf['id']}", workflow_id=wf["id"], reason="workflow aborted"
                )
        except BcError as err:
            self.log.warning("abort_cleanup_deferred", workflow_id=wf["id"], code=err.code.value)
            return time.time() + QUEUE_RETRY_S
        await self.db.execute("UPDATE workflows SET cancel_commands = false WHERE id = $1", wf["id"])
        return None

    async def _revoke_attempt(self, wf: dict[str, Any], step: dict[str, Any], *, reason: str) -> list[str]:
        """Revoke what attempt ``step["attempt"]`` minted and fence its key in every service it
        used; returns the commands of it that may still run at their agents."""
        coords = {"workflow_id": wf["id"], "step": step["idx"], "attempt": step["attempt"]}
        minted = set(step["minted"] or ())
        if "pki" in minted:
            await self.pki.revoke_attempt(**coords, reason=reason)
        if "secrets" in minted:
            await self.secrets.revoke_attempt(**coords, reason=reason)
        if not step["sent_commands"]:
            return []
        reply = await self.cmdq.cancel_under(
            key_prefix=attempt_key(wf["id"], step["idx"], step["attempt"]),
            workflow_id=wf["id"],
            fence=True,
            reason=reason,
        )
        return reply.running

    async def _supersede(self, wf: dict[str, Any], step: dict[str, Any]) -> float | None:
        """Before attempt N+1 of a step: attempt N's tokens and secrets revoked, its commands
        cancelled on every node and fenced, and none of them still running at an agent.
        Returns when to look again, or None once attempt N+1 may start."""
        try:
            running = await self._revoke_attempt(wf, step, reason="superseded by a later attempt")
        except BcError as err:
            service = err.service if isinstance(err, ServiceUnavailableError) else None
            self.log.warning(
                "supersede_deferred", workflow_id=wf["id"], step=step["idx"], code=err.code.value,
                service=service,
            )  # fmt: skip
            await self._waiting(
                wf, step, {"reason": "service-unavailable", "service": service, "code": err.code.value}
            )
            return time.time() + QUEUE_RETRY_S
        if not running:
            return None
        # A claimed command cannot be recalled: attempt N+1 waits until it ends at its agent
        # (its result, even a late one, or the agent's loss); its event wakes us sooner.
        await self._waiting(
            wf, step, {"reason": "previous-attempt-running", "attempt": step["attempt"], "commands": running}
        )
        return time.time() + SUPERSEDED_POLL_S

    async def _waiting(self, wf: dict[str, Any], step: dict[str, Any], what: dict[str, Any] | None) -> None:
        """Show what the step waits for (``waitingFor`` in workflows.get), if that changed."""
        if _json(step.get("waiting_for")) == what:
            return
        await self.db.execute(
            "UPDATE workflow_steps SET waiting_for = $4 WHERE workflow_id = $1 AND idx = $2 AND attempt = $3",
            wf["id"], step["idx"], step["attempt"], json.dumps(what) if what is not None else None,
        )  # fmt: skip
        step["waiting_for"] = what
        if what is not None:
            self.log.info(
                "step_waiting",
                workflow_id=wf["id"],
                step=step["idx"],
                attempt=step["attempt"],
                waiting_for=what,
            )
            await self._event(wf, step["state"], step)

    # -- running steps --------------------------------------------------------------

    async def _profile(self, wf: dict[str, Any]) -> Profile | None:
        """The workflow's pinned profile version (immutable, so cached for good)."""
        key = (wf["profile_tenant"], wf["profile_id"], wf["profile_version"])
        if key not in self._profiles:
            if key[0] == BUILTIN_TENANT:
                shipped = {p.key: p for p in self.app.profiles}.get((key[1], key[2]))
                if shipped is None:
                    return None
                self._profiles[key] = shipped
            else:
                doc = await self.db.fetchval(
                    "SELECT document FROM profiles WHERE tenant_id = $1 AND id = $2 AND version = $3", *key
                )
                if doc is None:
                    return None
                self._profiles[key] = profile_from_document(doc)
        return self._profiles[key]

    async def _node(self, wf: dict[str, Any]) -> NodeInfo | None:
        """The workflow's node, read once per pass."""
        if "_node" not in wf:
            wf["_node"] = await self._read_node(wf["node_id"])
        node: NodeInfo | None = wf["_node"]
        return node

    async def _read_node(self, node_id: str | None) -> NodeInfo | None:
        if node_id is None:
            return None
        row = await self.db.fetchrow("SELECT * FROM nodes WHERE id = $1", node_id)
        if row is None:
            return None
        labels = row["labels"]
        return NodeInfo(
            row["id"],
            row["site_id"],
            row["tenant_id"],
            json.loads(labels) if isinstance(labels, str) else dict(labels),
        )

    async def _run_control_plane(
        self, wf: dict[str, Any], step: dict[str, Any], deadline: float
    ) -> _Ok | _Fail | _Wait:
        definition = self.app.steps.get(step["action"])
        if definition is None or definition.run is None:
            return _Fail(
                BcError(
                    ErrorCode.INVALID_CONFIG,
                    f"step {step['action']} is not registered with this engine any more",
                    {"path": f"steps[{step['idx']}].use"},
                )
            )
        idempotency_key = f"wf:{wf['id']}:{step['idx']}#{step['attempt']}"
        log = self.log.bind(
            workflow_id=wf["id"], step=step["idx"], action=step["action"], attempt=step["attempt"]
        )
        node = await self._node(wf)
        children = StepWorkflows(self.start_in, tenant_id=wf["tenant_id"])
        wf_id, idx, attempt = wf["id"], step["idx"], step["attempt"]

        async def minting_tokens() -> bytes:
            return await self.mark_minted(wf_id, idx, attempt, "pki")

        async def storing_secrets() -> None:
            await self.mark_minted(wf_id, idx, attempt, "secrets")

        ctx = RunContext(
            workflow_id=wf["id"],
            step=step["idx"],
            attempt=step["attempt"],
            idempotency_key=idempotency_key,
            batch_id=wf["batch_id"],
            node=node,
            sql=EngineSql(self.db.pool),
            pki=self.pki.for_step(idempotency_key, node_id=wf["node_id"], before_mint=minting_tokens),
            secrets=self.secrets.for_step(
                tenant_id=wf["tenant_id"],
                workflow_id=wf_id,
                step=idx,
                attempt=attempt,
                before_put=storing_secrets,
            ),
            workflows=children,
            commands=StepCommands(self, workflow=wf, step=step),
            log=log,
            tenant_id=wf["tenant_id"],
            profile=await self._profile(wf),
            provision=self.app.provision,
        )
        inp = step["input"]
        inp = json.loads(inp) if isinstance(inp, str) else inp
        try:
            try:
                async with asyncio.timeout(max(0.0, deadline - time.time())):
                    result = await definition.run(inp, ctx)
            finally:
                if self.wake is not None:
                    for rkey in children.started:
                        await self.wake(rkey)
        except StepNotReady as nr:
            if step.get("waiting_for"):
                await self._waiting(wf, step, None)  # it got past what it waited for
            return _Wait(time.time() + nr.retry_after_ms / 1000)
        except ServiceUnavailableError as err:
            # One of our own services is away (not the step's verdict): run the step again
            # later, with backoff, until it answers or the step's deadline passes.
            return await self._service_wait(wf, step, err)
        except TimeoutError:
            return _Fail(_timed_out(step))
        except BcError as err:
            return _Fail(err)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if is_transient(exc):
                # the database or the bus went away under the step: run it again soon
                log.warning("step_interrupted", error=describe(exc))
                return _Wait(time.time() + QUEUE_RETRY_S)
            log.exception("step_raised")
            return _Fail(
                BcError(
                    ErrorCode.INTERNAL,
                    f"step {step['action']} raised {type(exc).__name__}; see the engine log",
                    {"path": f"steps[{step['idx']}]"},
                )
            )
        try:
            msgspec.json.encode(result)
        except (TypeError, msgspec.EncodeError):
            return _Fail(
                BcError(
                    ErrorCode.INTERNAL,
                    f"step {step['action']} returned a value that is not JSON",
                    {"path": f"steps[{step['idx']}]"},
                )
            )
        log.debug("step_ran")
        return _Ok(result)

    async def _service_wait(
        self, wf: dict[str, Any], step: dict[str, Any], err: ServiceUnavailableError
    ) -> _Wait:
        before = _json(step.get("waiting_for")) or {}
        same = before.get("reason") == "service-unavailable" and before.get("service") == err.service
        tries = int(before.get("tries", 0)) + 1 if same else 1
        what = {"reason": "service-unavailable", "service": err.service, "code": err.code.value,
                "message": err.message, "tries": tries}  # fmt: skip
        await self._waiting(wf, step, what)
        return _Wait(time.time() + _backoff(tries))

    async def _run_agent_step(
        self, wf: dict[str, Any], step: dict[str, Any], deadline: float
    ) -> _Ok | _Fail | _Wait:
        node = await self._node(wf)
        if node is None:
            return _Fail(BcError(ErrorCode.NOT_FOUND, f"node {wf['node_id']} is gone", {"path": "nodeId"}))
        kind = self.app.command_kinds.get(step["command"])
        inp = step["input"]
        inp = json.loads(inp) if isinstance(inp, str) else inp
        cmd = EnqueueCommand(
            node_id=node.id,
            site_id=node.site_id,
            kind=step["command"],
            payload=inp,
            key=f"wf:{wf['id']}:{step['idx']}#{step['attempt']}",
            target="node" if step["runs_on"] == "node" else "site",
            workflow_id=wf["id"],
            step=step["idx"],
            batch_id=wf["batch_id"] if kind is not None and kind.destructive else None,
            timeout_ms=max(1000, int((deadline - time.time()) * 1000)),
            tenant_id=wf["tenant_id"],
        )
        if not step["sent_commands"]:
            try:
                await self.mark_sent(wf["id"], step["idx"], step["attempt"])
            except BcError as err:
                return _Fail(err)  # superseded: the settle finds nothing and the pass reloads
            step["sent_commands"] = True
        try:
            view = await self.cmdq_enqueue(cmd)
        except BcError as err:
            if err.code in (ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT, ErrorCode.INTERNAL):
                self.log.warning("command_queue_unavailable", code=err.code.value)
                return _Wait(time.time() + QUEUE_RETRY_S)
            return _Fail(err)
        if step["command_id"] != view.id:
            await self.db.execute(
                "UPDATE workflow_steps SET command_id = $3 WHERE workflow_id = $1 AND idx = $2",
                wf["id"], step["idx"], view.id,
            )  # fmt: skip
        if view.state in LIVE_STATES:
            # The command's settle event wakes this key at once; the safety net is the bulk
            # look at every waiting command every AGENT_POLL_S (EngineService._command_watch),
            # so a waiting workflow costs no pass of its own until its deadline.
            return _Wait(deadline)
        if view.state == "succeeded":
            return _Ok(
                {
                    "commandId": view.id,
                    "result": _agent_result(view.result),
                    "attested": view.attested,
                }
            )
        return _Fail(
            BcError(
                ErrorCode.DRIVER_ERROR,
                f"command {view.kind} {view.state}" + (f": {view.reason}" if view.reason else ""),
                {"state": view.state, "reason": view.reason, "commandId": view.id},
            )
        )

    async def _event(
        self,
        wf: dict[str, Any],
        state: str,
        step: dict[str, Any] | None,
        *,
        result: Any = None,
        error: BcError | None = None,
    ) -> None:
        payload: dict[str, Any] = {
            "workflowId": wf["id"],
            "nodeId": wf["node_id"],
            "workflowState": wf["state"],
            "at": time.time(),
        }
        if step is not None:
            payload["step"] = {
                "index": step["idx"],
                "action": step["action"],
                "state": state,
                "attempt": step["attempt"],
            }
            if error is not None:
                payload["step"]["error"] = {"code": error.code.value, "message": error.message}
            if step.get("waiting_for") and state in ("pending", "running"):
                payload["step"]["waitingFor"] = _json(step["waiting_for"])
        await self.publish("workflow", wf["id"], payload)
