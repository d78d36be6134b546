"""Running workflows: one reconciler pass per key, step by step.

A control-plane step is marked running in one transaction, runs outside any
transaction, and is settled in another that first checks it is still running with the
same attempt and that this process still holds the key's shard under the same epoch.
A process that dies in between leaves the step running; the next owner runs it again
under the same idempotency key. Agent steps enqueue their command through the
command-queue (find-before-create by key) and wait for its settle event.

The statements are behind ``ReconcilerStore`` (``reconciler_store``: PostgreSQL in the service, an
in-memory store in unit tests), the clean-up of earlier attempts and aborts in ``attempts``, retry
policies in ``retries``. What runs a step, what a workflow needs before its first step and what
its events say is the ``StepRunner`` and ``WorkflowEvents`` the engine is given
(``bc_engine.steps``); owner reconcilers are looked up by name (``owners``), so a plug-in's keys
run here like any other. What is left is one state machine, the pass with its mark-running,
settles, retries and events, kept in one file so its crash-safety argument reads top to bottom.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from better_compute.app import App
from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.pki import PkiClient
from better_compute.clients.secrets import SecretsClient
from better_compute.core.errors import BcError, ErrorCode
from better_compute.keyring import Keyring
from better_compute.provision import Profile, StepNotReady, profile_from_document
from better_compute.service.client import ApiClient
from better_compute.service.db import Database
from better_compute.service.faults import describe, is_transient
from better_compute.service.killpoints import declare, kill_point
from better_compute.wire.cmdq import CommandView, EnqueueCommand, engine_proof

from ..profiles import BUILTIN_TENANT
from ..store import StepRow, WorkflowRow
from . import queue
from .attempts import cleanup_aborted, supersede
from .outcomes import Fail, Ok, Outcome, Wait, timed_out
from .reconciler_store import Fence, PgReconcilerStore, ReconcilerStore
from .retries import retry_delay_s
from .shards import ShardLeases

__all__ = ["AGENT_POLL_S", "Engine", "FencedError", "OwnerReconciler", "StepRunner", "WorkflowEvents"]

AGENT_POLL_S = 10.0  # workflowPollMs: every waiting command is looked at at least this often

OwnerReconciler = Callable[[Any, str], Awaitable[None]]

# Where a chaos test may SIGKILL the engine (better_compute.service.killpoints, docs/chaos.md).
BEFORE_MARK_RUNNING = declare("engine.before-mark-running", "engine", "a step is due, not yet marked running")
AFTER_MARK_RUNNING = declare("engine.after-mark-running", "engine", "a step is marked running, has not run")
BEFORE_SETTLE = declare("engine.before-settle", "engine", "a step's outcome is known, not settled")
AFTER_SETTLE = declare("engine.after-settle", "engine", "a step is settled (the next one started)")
BEFORE_ENQUEUE = declare("engine.before-enqueue", "engine", "a step sends a command, not yet enqueued")
AFTER_ENQUEUE = declare("engine.after-enqueue", "engine", "a command is enqueued, its step does not know")

_LOST = object()
_FINISHED = object()


class StepRunner(Protocol):
    """What runs the steps of a workflow, as the reconciler pass sees it (``bc_engine.steps``)."""

    def pass_begins(self, wf: WorkflowRow, record: Any) -> None:
        """A pass looks at ``wf`` (``record``: its row of ``PASS_WORKFLOWS``, with what the pass
        read along)."""

    def pass_ends(self, wf: WorkflowRow) -> None:
        """The pass over ``wf`` ended: what was read along for it is forgotten."""

    async def prepare(self, wf: WorkflowRow) -> float | None:
        """What the workflow needs before it sends anything (its batch under the quorum); returns
        when to look again, or None when it may go on."""

    async def run(self, wf: WorkflowRow, step: StepRow, deadline: float) -> Outcome:
        """Run one attempt of ``step`` (marked running) until it has an outcome or must wait."""


class WorkflowEvents(Protocol):
    """The workflow feed: a step's change, or the workflow's end (``step`` None)."""

    async def changed(
        self,
        wf: WorkflowRow,
        state: str,
        step: StepRow | None,
        *,
        result: Any = None,
        error: BcError | None = None,
    ) -> None: ...


class _NotGiven:
    """A runner or feed the engine was not given (the service gives both before the first pass)."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"the engine was given no step runner or event feed (.{name})")


class FencedError(Exception):
    """This process no longer holds the shard: stop, the new owner carries on."""


def _superseded() -> BcError:
    return BcError(
        ErrorCode.INVALID_STATE,
        "this step attempt was superseded by a later one: it sends and mints nothing any more",
        {"reason": "attempt-superseded"},
    )


def _given(api: ApiClient | None) -> ApiClient:
    if api is None:
        raise ValueError("the engine needs an ApiClient, or each of cmdq, pki and secrets")
    return api


def _error_doc(err: BcError) -> str:
    return json.dumps({"code": err.code.value, "message": err.message, "details": err.details})


class Engine:
    """The workflow reconciler of one engine process."""

    def __init__(
        self,
        *,
        app: App,
        db: Database | None,
        api: ApiClient | None,
        leases: ShardLeases,
        instance: str,
        log: Any,
        publish: Callable[[str, str, Any], Awaitable[None]],
        owners: Mapping[str, OwnerReconciler] | None = None,
        start_in: Any = None,
        wake: Callable[[str], Awaitable[None]] | None = None,
        runner: StepRunner | None = None,
        events: WorkflowEvents | None = None,
        store: ReconcilerStore | None = None,
        cmdq: CommandQueueClient | None = None,
        pki: PkiClient | None = None,
        secrets: SecretsClient | None = None,
    ) -> None:
        self.app = app
        self.db: Any = db  # for what the engine is host to (steps, owners); the pass uses ``store``
        self.store: ReconcilerStore = store if store is not None else PgReconcilerStore(db)
        self.api = api
        self.leases = leases
        self.instance = instance
        self.log = log
        self.publish = publish
        self.cmdq = cmdq if cmdq is not None else CommandQueueClient(_given(api))
        self.pki = pki if pki is not None else PkiClient(_given(api))
        self.secrets = secrets if secrets is not None else SecretsClient(_given(api))
        self.owners = owners if owners is not None else {}  # the hooks' map: plug-ins add to it
        self.start_in = start_in
        self.wake = wake
        self.runner: StepRunner = runner if runner is not None else _NotGiven()
        self.events: WorkflowEvents = events if events is not None else _NotGiven()
        self.on_end: Callable[[WorkflowRow], None] | None = None
        """Told of each workflow this process ends (the service's admission pass: room at its site)."""
        self.engine_key: Keyring | None = None
        """``cmdq.engine_key_file``: the proof of the commands it sends under its workflows."""
        self._profiles: dict[tuple[str, str, int], Profile] = {}  # pinned versions never change

    # -- helpers used by the step runners and the step context ----------------------

    async def mark_sent(self, workflow_id: str, idx: int, attempt: int) -> None:
        """Record that this attempt sends commands (before it does); refused once the attempt
        was superseded, so a late run of it sends nothing."""
        if not await self.store.mark_sent(workflow_id, idx, attempt):
            raise _superseded()

    async def mark_minted(self, workflow_id: str, idx: int, attempt: int, service: str) -> bytes:
        """Record that this attempt mints tokens (``pki``) or stores secrets (``secrets``);
        returns the step's mint secret (see ``StepPki``), the same on every run."""
        secret = await self.store.mark_minted(workflow_id, idx, attempt, service, os.urandom(32))
        if secret is None:
            raise _superseded()
        return secret

    async def cmdq_enqueue(self, cmd: EnqueueCommand) -> CommandView:
        kill_point(BEFORE_ENQUEUE)
        if self.engine_key is not None:  # a stack without NATS accounts: prove it is ours
            cmd = engine_proof(cmd, self.engine_key)
        view = await self.cmdq.enqueue(cmd)
        kill_point(AFTER_ENQUEUE)
        return view

    async def profile(self, wf: WorkflowRow) -> Profile | None:
        """The workflow's pinned profile version (immutable, so cached for good)."""
        key = (wf.profile_tenant, wf.profile_id, wf.profile_version)
        if key not in self._profiles:
            if key[0] == BUILTIN_TENANT:
                shipped = {p.key: p for p in self.app.profiles}.get((key[1], key[2]))
                if shipped is None:
                    return None
                self._profiles[key] = shipped
            else:
                doc = await self.store.stored_profile(*key)
                if doc is None:
                    return None
                self._profiles[key] = profile_from_document(doc)
        return self._profiles[key]

    async def waiting(self, wf: WorkflowRow, step: StepRow, what: dict[str, Any] | None) -> None:
        """Show what the step waits for (``waitingFor`` in workflows.get), if that changed."""
        if step.waiting_for == what:
            return
        await self.store.set_waiting(
            wf.id, step.idx, step.attempt, json.dumps(what) if what is not None else None
        )
        step.waiting_for = what
        if what is not None:
            self.log.info(
                "step_waiting", workflow_id=wf.id, step=step.idx, attempt=step.attempt, waiting_for=what
            )
            await self.events.changed(wf, step.state, step)

    # -- one pass -----------------------------------------------------------------

    async def reconcile(self, rkey: str) -> float | None:
        """One pass over ``rkey``; returns when it next wants a look (epoch seconds)."""
        shard = queue.shard_of(rkey)
        epoch = self.leases.owns(shard)
        if epoch is None:
            raise FencedError(rkey)
        if ":" in rkey:
            seen = await self.store.queue_seq(rkey)
            nxt = await self._reconcile_owner(rkey)
        else:
            seen, rows = await self.store.pass_workflows(rkey)
            times = []
            for wf, row in rows:
                self.runner.pass_begins(wf, row)
                try:
                    t = await self._advance(wf, (shard, self.instance, epoch))
                finally:
                    self.runner.pass_ends(wf)
                if t is not None:
                    times.append(t)
            nxt = min(times) if times else None
        if nxt is None:
            await self.store.queue_done(rkey, seen)
        else:
            await self.store.queue_at(rkey, nxt, seen)
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
        except Exception as exc:
            if is_transient(exc):  # a service or server away a while: said once, no traceback
                self.log.warning(
                    "owner_reconciler_interrupted", owner=owner, workflow_id=workflow_id, error=describe(exc)
                )
            else:
                self.log.exception("owner_reconciler_failed", owner=owner, workflow_id=workflow_id)
            return time.time() + 5.0
        return None

    async def _advance(self, wf: WorkflowRow, fence: Fence) -> float | None:
        step: StepRow | None = None  # known from the previous settle, else read
        if wf.state == "running" and not wf.admitted:
            # it waits for its site's admission (core/admission.py): no step starts, no deadline
            # runs; the admission pass queues and wakes its key
            return None
        retry_at = await self.runner.prepare(wf)
        if retry_at is not None:
            return retry_at
        while True:
            if wf.state != "running":
                return await cleanup_aborted(self, wf)
            if step is None:
                # the usual case, a first step to start, in one statement
                kill_point(BEFORE_MARK_RUNNING)
                step = await self.store.start_first(wf.id, fence)
                if step is not None:
                    kill_point(AFTER_MARK_RUNNING)
                    await self.events.changed(wf, "running", step)
                    continue
                step = await self.store.next_step(wf.id)
                if step is None:
                    await self._finish(wf, "succeeded", None, fence)
                    return None
            if step.state == "pending":
                if step.retry_at is not None and step.retry_at.timestamp() > time.time():
                    return step.retry_at.timestamp()  # its retry policy's backoff
                if step.attempt > 0 and (step.sent_commands or step.minted):
                    # never issue attempt N+1 while attempt N's commands may still run, nor
                    # leave its tokens and secrets usable
                    wait = await supersede(self, wf, step)
                    if wait is not None:
                        return wait
                kill_point(BEFORE_MARK_RUNNING)
                started = await self.store.mark_running(
                    wf.id, step.idx, step.attempt, step.sent_commands, list(step.minted), fence
                )
                if started is None:
                    wf, step = await self._reload(wf, fence), None
                    continue
                kill_point(AFTER_MARK_RUNNING)
                step = started
                await self.events.changed(wf, "running", step)
            if step.state != "running" or step.deadline is None:
                # failed or cancelled while the workflow still says running: a verb will settle it
                return None
            deadline = step.deadline.timestamp()
            if time.time() >= deadline:
                outcome: Outcome = Fail(timed_out(step))
            else:
                outcome = await self.runner.run(wf, step, deadline)
            match outcome:
                case Wait(at=at):
                    return float(min(at, deadline))
                case Ok(result=result) as ok:
                    kill_point(BEFORE_SETTLE)
                    settled = await self._settle_ok(wf, step, ok.json(), fence)
                    kill_point(AFTER_SETTLE)
                    if settled is _LOST:
                        wf, step = await self._reload(wf, fence), None
                        continue
                    await self.events.changed(wf, "succeeded", step, result=result)
                    if settled is _FINISHED:
                        await self.events.changed(wf, "succeeded", None)
                        await self._wake_owner(wf)
                        return None
                    step = settled if isinstance(settled, StepRow) else None
                    if step is not None:
                        await self.events.changed(wf, "running", step)
                case Fail(error=error):
                    delay = retry_delay_s(step, error)
                    kill_point(BEFORE_SETTLE)
                    if delay is not None:
                        retry_at = await self._settle_retry(wf, step, error, delay, fence)
                        if retry_at is None:
                            wf, step = await self._reload(wf, fence), None
                            continue
                        kill_point(AFTER_SETTLE)
                        await self.events.changed(wf, "pending", step, error=error)
                        return retry_at
                    if await self._settle_failed(wf, step, error, fence):
                        kill_point(AFTER_SETTLE)
                        await self.events.changed(wf, "failed", step, error=error)
                        await self.events.changed(wf, "failed", None)  # every end has its `finished`
                        await self._wake_owner(wf)
                        return None
                    wf, step = await self._reload(wf, fence), None

    async def _reload(self, wf: WorkflowRow, fence: Fence) -> WorkflowRow:
        """A settle found nothing to settle: either we were fenced off, or a verb moved it."""
        if not await self.store.holds_shard(fence):
            raise FencedError(wf.id)
        return await self.store.workflow(wf.id)

    async def _settle_ok(self, wf: WorkflowRow, step: StepRow, result_json: str, fence: Fence) -> Any:
        """Settle a success and, in the same statement (one transaction, one round trip),
        start the next step or finish the workflow and queue its owner.

        Returns ``_LOST`` (nothing to settle: fenced or moved by a verb), ``_FINISHED``, the
        next step's row when it was started, or ``None`` when the next step needs more care
        (commands of an earlier attempt to cancel first).
        """
        owner_rkey = queue.owner_key(wf.owner, wf.id) if wf.owner else None
        settled = await self.store.settle_ok(wf.id, step.idx, step.attempt, result_json, fence, owner_rkey)
        if not settled.settled:
            return _LOST
        if settled.next is not None:
            return settled.next
        if settled.finished:
            wf.state = "succeeded"
            return _FINISHED
        return None

    async def _settle_failed(self, wf: WorkflowRow, step: StepRow, error: BcError, fence: Fence) -> bool:
        owner_rkey = queue.owner_key(wf.owner, wf.id) if wf.owner else None
        if not await self.store.settle_failed(
            wf.id, step.idx, step.attempt, _error_doc(error), fence, owner_rkey
        ):
            return False
        wf.state = "failed"
        return True

    async def _settle_retry(
        self, wf: WorkflowRow, step: StepRow, error: BcError, delay: float, fence: Fence
    ) -> float | None:
        """Settle a failed attempt its retry policy retries: back to pending, the next attempt
        not before ``delay`` seconds (``retries``). Returns that moment, None when fenced."""
        at = await self.store.settle_retry(wf.id, step.idx, step.attempt, _error_doc(error), fence, delay)
        if at is None:
            return None
        self.log.info(
            "step_retry", workflow_id=wf.id, step=step.idx, attempt=step.attempt,
            code=error.code.value, delay_s=delay,
        )  # fmt: skip
        return at

    async def _finish(self, wf: WorkflowRow, state: str, error: BcError | None, fence: Fence) -> None:
        owner_rkey = queue.owner_key(wf.owner, wf.id) if wf.owner else None
        if not await self.store.finish(wf.id, state, _error_doc(error) if error else None, fence, owner_rkey):
            raise FencedError(wf.id)
        wf.state = state
        await self.events.changed(wf, state, None)
        await self._wake_owner(wf)

    async def _wake_owner(self, wf: WorkflowRow) -> None:
        """The workflow's end queued its owner's key; look at it now, not at the next poll of the
        work queue (the owner acts on the end at once). Its site may have room for another."""
        if self.on_end is not None and wf.site_id is not None:
            self.on_end(wf)
        if wf.owner and self.wake is not None:
            await self.wake(queue.owner_key(wf.owner, wf.id))
