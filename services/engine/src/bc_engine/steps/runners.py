"""Running one attempt of one step: a control-plane step in this process, an agent step as a
command through the command-queue.

Each runner returns an outcome for the reconciler pass to settle: ``Ok`` (the result), ``Fail``
(the error) or ``Wait`` (look again at that time: a command still runs, a step is not ready, one of
our services is away).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import time
from typing import Any

import msgspec

from better_compute.core.errors import BcError, ErrorCode, ServiceUnavailableError
from better_compute.provision import CommandNotReady, StepNotReady, step_command_key
from better_compute.service.faults import Backoff
from better_compute.wire.cmdq import LIVE_STATES, EnqueueCommand

from .. import store
from ..core.outcomes import QUEUE_RETRY_S, Fail, Ok, Outcome, Wait, timed_out
from ..store import StepRow, WorkflowRow
from .context import EngineSql, RunContext, StepCommands, StepWorkflows
from .host import StepHost

__all__ = ["StepRunners", "run_agent_step", "run_control_plane"]

SERVICE_WAIT_FIRST_S = 0.25  # backoff while one of our services is away: the first wait …
SERVICE_WAIT_CAP_S = 5.0  # … doubling up to this (jittered: faults.Backoff)


def _agent_result(raw: bytes | None) -> Any:
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return {"base64": base64.b64encode(raw).decode()}


def _input(step: StepRow) -> Any:
    return json.loads(step.input) if isinstance(step.input, str) else step.input


async def run_control_plane(host: StepHost, wf: WorkflowRow, step: StepRow, deadline: float) -> Outcome:
    definition = host.app.steps.get(step.action)
    if definition is None or definition.run is None:
        return Fail(
            BcError(
                ErrorCode.INVALID_CONFIG,
                f"step {step.action} is not registered with this engine any more",
                {"path": f"steps[{step.idx}].use"},
            )
        )
    idempotency_key = step_command_key(step)
    log = host.log.bind(workflow_id=wf.id, step=step.idx, action=step.action, attempt=step.attempt)
    node = await host.node(wf)
    if node is not None:  # the inventory only here: a pass's other reads need none of it
        node = dataclasses.replace(node, inventory=await host.node_inventory(wf, node.id))
    children = StepWorkflows(host.start_in, tenant_id=wf.tenant_id)
    wf_id, idx, attempt = wf.id, step.idx, step.attempt
    memo = host.memos.of(wf_id, idx, attempt)

    async def minting_tokens() -> bytes:
        if "pki" in memo.marked and memo.mint_secret is not None:
            return memo.mint_secret  # recorded by an earlier run of this attempt
        memo.mint_secret = await host.mark_minted(wf_id, idx, attempt, "pki")
        memo.marked.add("pki")
        return memo.mint_secret

    async def storing_secrets() -> None:
        if "secrets" not in memo.marked:
            memo.mint_secret = await host.mark_minted(wf_id, idx, attempt, "secrets")
            memo.marked.add("secrets")

    ctx = RunContext(
        workflow_id=wf.id,
        step=step.idx,
        attempt=step.attempt,
        idempotency_key=idempotency_key,
        batch_id=wf.batch_id,
        node=node,
        sql=EngineSql(host.db.pool),
        pki=host.pki.for_step(
            idempotency_key=idempotency_key,
            node_id=wf.node_id,
            before_mint=minting_tokens,
            issued=memo.tokens,
        ),
        secrets=host.secrets.for_step(
            tenant_id=wf.tenant_id,
            workflow_id=wf_id,
            step=idx,
            attempt=attempt,
            before_put=storing_secrets,
            node_id=wf.node_id,
            stored=memo.secrets,
        ),
        workflows=children,
        commands=StepCommands(host, workflow=wf, step=step, memo=memo),
        log=log,
        tenant_id=wf.tenant_id,
        profile=await host.profile(wf),
        provision=host.app.provision,
        memo=memo,
    )
    try:
        try:
            async with asyncio.timeout(max(0.0, deadline - time.time())):
                result = await definition.run(_input(step), ctx)
        finally:
            if host.wake is not None:
                for rkey in children.started:
                    await host.wake(rkey)
    except CommandNotReady as nr:
        if _own_command(nr, idempotency_key):
            return await _command_wait(host, wf, step, nr, deadline)
        return await _not_ready(host, wf, step, nr)
    except StepNotReady as nr:
        return await _not_ready(host, wf, step, nr)
    except ServiceUnavailableError as err:
        # One of our own services is away (not the step's verdict): run the step again
        # later, with backoff, until it answers or the step's deadline passes.
        return await _service_wait(host, wf, step, err)
    except TimeoutError:
        host.memos.drop(wf_id)
        return Fail(timed_out(step))
    except BcError as err:
        host.memos.drop(wf_id)
        return Fail(err)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        # Whatever else a step raises is its failure, even when it looks transient (a refused
        # connection to its own device): only ServiceUnavailableError above makes it wait.
        log.exception("step_raised")
        host.memos.drop(wf_id)
        return Fail(
            BcError(
                ErrorCode.INTERNAL,
                f"step {step.action} raised {type(exc).__name__}; see the engine log",
                {"path": f"steps[{step.idx}]"},
            )
        )
    try:
        encoded = msgspec.json.encode(result).decode()  # the settle stores this text
    except (TypeError, msgspec.EncodeError, OverflowError):
        host.memos.drop(wf_id)
        return Fail(
            BcError(
                ErrorCode.INTERNAL,
                f"step {step.action} returned a value that is not JSON",
                {"path": f"steps[{step.idx}]"},
            )
        )
    log.debug("step_ran")
    host.memos.drop(wf_id)  # the attempt settles: nothing runs under its keys any more
    return Ok(result, encoded)


def _own_command(nr: CommandNotReady, attempt_key: str) -> bool:
    """Whether the live command is one of this attempt's (``step_command_key``)."""
    return nr.key == attempt_key or nr.key.startswith(attempt_key + ":")


async def _not_ready(host: StepHost, wf: WorkflowRow, step: StepRow, nr: StepNotReady) -> Wait:
    """The step's own ``step_not_ready(ms)``: run it again in ms (never after its deadline)."""
    # what the step says it waits for (its own reason), else it got past what it waited for
    what = {"reason": "step-not-ready", "message": nr.reason} if nr.reason else None
    if step.command_id is not None:
        # it waited on a command earlier in this attempt and waits on something else now: the
        # command watch must not keep waking it for that command
        await host.waiting_command(wf, step, None, None)
    if step.waiting_for != what:
        await host.waiting(wf, step, what)
    return Wait(time.time() + nr.retry_after_ms / 1000)


async def _command_wait(
    host: StepHost, wf: WorkflowRow, step: StepRow, nr: CommandNotReady, deadline: float
) -> Wait:
    """The step waits on a live command of its attempt (``await_command``): as an agent step
    does, the command is recorded as the one the step waits on (``command_id``, and
    ``waitingFor`` says which) and the pass waits until the deadline. The command's settle event
    wakes the workflow at once; the command watch (every AGENT_POLL_S, in bulk) is the safety
    net. So the step runs again once per command it sends, not every COMMAND_POLL_MS. A wake-up
    lives in memory only: an engine that died after a command was enqueued but before it was
    recorded here left the key due at an earlier wait's end; the engine that takes the shard runs
    each of its keys once (``store.GAINED_KEYS``). A re-run every 30 s did that before, at a cost
    per waiting machine: 10,000 machines waiting made 333 passes a second."""
    what = {"reason": "command", "commandId": nr.command_id, "kind": nr.kind}
    if step.command_id != nr.command_id or step.waiting_for != what:
        await host.waiting_command(wf, step, nr.command_id, what)
    return Wait(deadline)


async def _service_wait(host: StepHost, wf: WorkflowRow, step: StepRow, err: ServiceUnavailableError) -> Wait:
    before = step.waiting_for or {}
    same = before.get("reason") == "service-unavailable" and before.get("service") == err.service
    tries = int(before.get("tries", 0)) + 1 if same else 1
    what = {"reason": "service-unavailable", "service": err.service, "code": err.code.value,
            "message": err.message, "tries": tries}  # fmt: skip
    await host.waiting(wf, step, what)
    # the count of tries lives in the step row (waitingFor), so any engine process backs off alike
    backoff = Backoff(first=SERVICE_WAIT_FIRST_S, cap=SERVICE_WAIT_CAP_S)
    backoff.failures = tries - 1
    return Wait(time.time() + backoff.next())


async def run_agent_step(host: StepHost, wf: WorkflowRow, step: StepRow, deadline: float) -> Outcome:
    node = await host.node(wf)
    if node is None:
        return Fail(BcError(ErrorCode.NOT_FOUND, f"node {wf.node_id} is gone", {"path": "nodeId"}))
    batched = bool(step.command) and await host.in_batch(wf, step.command or "")
    try:
        payload = host.fill_payload(step.command or "", _input(step), node.id, node)
    except BcError as err:
        return Fail(err)
    cmd = EnqueueCommand(
        node_id=node.id,
        site_id=node.site_id,
        kind=step.command or "",
        payload=payload,
        key=step_command_key(step),
        target="node" if step.runs_on == "node" else "site",
        workflow_id=wf.id,
        step=step.idx,
        batch_id=wf.batch_id if batched else None,
        in_batch=batched,
        timeout_ms=max(1000, int((deadline - time.time()) * 1000)),
        tenant_id=wf.tenant_id,
    )
    try:
        # the command this attempt enqueued (``command_id``) read by its id, not enqueued again
        view = await host.sent_command(step.command_id, cmd) if step.command_id is not None else None
        if view is None:
            if not step.sent_commands:
                try:
                    await host.mark_sent(wf.id, step.idx, step.attempt)
                except BcError as err:
                    return Fail(err)  # superseded: the settle finds nothing and the pass reloads
                step.sent_commands = True
            view = await host.enqueue(cmd)
    except BcError as err:
        if err.code in (ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT, ErrorCode.INTERNAL):
            host.log.warning("command_queue_unavailable", code=err.code.value)
            return Wait(time.time() + QUEUE_RETRY_S)
        return Fail(err)
    if step.command_id != view.id:
        await host.db.execute(store.SET_COMMAND, wf.id, step.idx, view.id)
    if view.state in LIVE_STATES:
        # The command's settle event wakes this key at once; the safety net is the bulk
        # look at every waiting command every AGENT_POLL_S (EngineService._command_watch),
        # so a waiting workflow costs no pass of its own until its deadline.
        return Wait(deadline)
    if view.state == "succeeded":
        result = _agent_result(view.result)
        await host.command_settled(node.id, view.kind, payload, result)
        return Ok({"commandId": view.id, "result": result, "attested": view.attested})
    return Fail(
        BcError(
            ErrorCode.DRIVER_ERROR,
            f"command {view.kind} {view.state}" + (f": {view.reason}" if view.reason else ""),
            {"state": view.state, "reason": view.reason, "commandId": view.id},
        )
    )


class StepRunners:
    """The engine's ``StepRunner``: a control-plane step runs in this process, any other as a
    command through the command-queue; before a workflow sends anything, its quorum batch."""

    def __init__(self, host: StepHost) -> None:
        self.host = host

    def pass_begins(self, wf: WorkflowRow, record: Any) -> None:
        self.host.pass_begins(wf, record)

    def pass_ends(self, wf: WorkflowRow) -> None:
        self.host.pass_ends(wf)

    async def prepare(self, wf: WorkflowRow) -> float | None:
        return await self.host.quorum.ensure(wf)

    async def run(self, wf: WorkflowRow, step: StepRow, deadline: float) -> Outcome:
        if step.mode == "control-plane":
            return await run_control_plane(self.host, wf, step, deadline)
        return await run_agent_step(self.host, wf, step, deadline)
