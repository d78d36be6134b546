"""An in-memory ``ReconcilerStore`` (``bc_engine.core.reconciler_store``) for unit tests of the
reconciler: each method does what its statement in ``bc_engine.store`` does, on dicts, so a pass
runs in microseconds without PostgreSQL. ``fenced`` makes every fenced write find nothing, as
when this process lost the shard; ``abort`` does what ``workflows.abort`` writes."""

from __future__ import annotations

import datetime as dt
import itertools
import json
from typing import Any

import msgspec

from bc_engine.core.reconciler_store import Fence, SettledOk
from bc_engine.store import StepRow, WorkflowRow


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class MemoryReconcilerStore:
    def __init__(self) -> None:
        self.workflows: dict[str, WorkflowRow] = {}
        self.steps: dict[str, list[StepRow]] = {}
        self.queue: dict[str, tuple[float, int]] = {}  # rkey -> (not before, seq)
        self.profiles: dict[tuple[str, str, int], Any] = {}
        self.fenced = False
        self._seq = itertools.count(1)
        self._secrets: dict[tuple[str, int], bytes] = {}

    # -- set-up, as workflows.start and workflows.abort write it -------------------------------

    def add_workflow(
        self,
        workflow_id: str,
        steps: list[dict[str, Any]],
        *,
        owner: str | None = None,
        rkey: str | None = None,
        node_id: str | None = None,
    ) -> WorkflowRow:
        wf = WorkflowRow(
            id=workflow_id, tenant_id="root", node_id=node_id, rkey=rkey or workflow_id,
            profile_tenant="root", profile_id="p", profile_version=1, state="running", owner=owner,
            command_kinds=[], batch_id=None, cancel_commands=False,
        )  # fmt: skip
        self.workflows[workflow_id] = wf
        self.steps[workflow_id] = [
            StepRow(
                workflow_id=workflow_id,
                idx=i,
                action=s.get("action", f"s{i}"),
                runs_on="control-plane",
                mode=s.get("mode", "control-plane"),
                command=None,
                input={},
                timeout_ms=s.get("timeout_ms", 60_000),
                state="pending",
                attempt=0,
                started_at=None,
                deadline=None,
                finished_at=None,
                retry=s.get("retry"),
            )
            for i, s in enumerate(steps)
        ]
        self.queue_now(wf.rkey)
        return msgspec.structs.replace(wf)

    def queue_now(self, rkey: str) -> None:
        self.queue[rkey] = (0.0, next(self._seq))

    def abort(self, workflow_id: str) -> None:
        """``workflows.abort``: the step it stops is cancelled; the workflow aborted, with the
        clean-up to do when an attempt sent or minted something."""
        steps = self.steps[workflow_id]
        live = [s for s in steps if s.state in ("pending", "running")]
        if live:
            live[0].state = "cancelled"
            live[0].finished_at = _now()
        leaves_work = any(s.sent_commands or s.minted for s in steps)
        wf = self.workflows[workflow_id]
        wf.state, wf.cancel_commands = "aborted", leaves_work
        self.queue_now(wf.rkey)

    def step(self, workflow_id: str, idx: int) -> StepRow:
        return self.steps[workflow_id][idx]

    # -- ReconcilerStore ------------------------------------------------------------------------

    async def queue_seq(self, rkey: str) -> int | None:
        entry = self.queue.get(rkey)
        return entry[1] if entry else None

    async def queue_at(self, rkey: str, at: float, seen_seq: int | None) -> None:
        if seen_seq is None:
            self.queue.setdefault(rkey, (at, next(self._seq)))
        elif rkey in self.queue and self.queue[rkey][1] == seen_seq:
            self.queue[rkey] = (at, seen_seq)

    async def queue_done(self, rkey: str, seen_seq: int | None) -> None:
        if seen_seq is not None and rkey in self.queue and self.queue[rkey][1] == seen_seq:
            del self.queue[rkey]

    async def pass_workflows(self, rkey: str) -> tuple[int | None, list[tuple[WorkflowRow, Any]]]:
        rows = [
            (msgspec.structs.replace(wf), {"node_info": None})
            for wf in self.workflows.values()
            if wf.rkey == rkey and (wf.state == "running" or wf.cancel_commands)
        ]
        return await self.queue_seq(rkey), rows

    async def workflow(self, workflow_id: str) -> WorkflowRow:
        return msgspec.structs.replace(self.workflows[workflow_id])

    async def holds_shard(self, fence: Fence) -> bool:
        return not self.fenced

    def _start(self, step: StepRow) -> StepRow:
        now = _now()
        step.state, step.attempt = "running", step.attempt + 1
        step.started_at, step.deadline = now, now + dt.timedelta(milliseconds=step.timeout_ms)
        step.finished_at, step.sent_commands, step.minted = None, False, []
        step.waiting_for = step.result = step.error = step.command_id = None
        return msgspec.structs.replace(step)

    def _first_open(self, workflow_id: str, after: int = -1) -> StepRow | None:
        return next((s for s in self.steps[workflow_id] if s.idx > after and s.state != "succeeded"), None)

    @staticmethod
    def _startable(step: StepRow) -> bool:
        return step.state == "pending" and (step.attempt == 0 or not (step.sent_commands or step.minted))

    async def start_first(self, workflow_id: str, fence: Fence) -> StepRow | None:
        step = self._first_open(workflow_id)
        if step is None or self.fenced or not self._startable(step):
            return None
        if step.retry_at is not None and step.retry_at > _now():
            return None
        return self._start(step)

    async def next_step(self, workflow_id: str) -> StepRow | None:
        step = self._first_open(workflow_id)
        return msgspec.structs.replace(step) if step is not None else None

    async def mark_running(
        self, workflow_id: str, idx: int, attempt: int, sent: bool, minted: list[str], fence: Fence
    ) -> StepRow | None:
        step = self.steps[workflow_id][idx]
        if self.fenced or step.state != "pending" or step.attempt != attempt:
            return None
        if step.sent_commands != sent or list(step.minted) != minted:
            return None
        return self._start(step)

    def _running(self, workflow_id: str, idx: int, attempt: int) -> StepRow | None:
        step = self.steps[workflow_id][idx]
        ok = not self.fenced and step.state == "running" and step.attempt == attempt
        return step if ok else None

    def _finish(self, workflow_id: str, state: str, error: Any, owner_rkey: str | None) -> None:
        wf = self.workflows[workflow_id]
        if wf.state != "running":
            return
        wf.state, wf.error = state, error
        if owner_rkey:
            self.queue_now(owner_rkey)

    async def settle_ok(
        self, workflow_id: str, idx: int, attempt: int, result_json: str, fence: Fence, owner_rkey: str | None
    ) -> SettledOk:
        step = self._running(workflow_id, idx, attempt)
        if step is None:
            return SettledOk(settled=False)
        step.state, step.result, step.finished_at, step.waiting_for = (
            "succeeded",
            json.loads(result_json),
            _now(),
            None,
        )
        following = self._first_open(workflow_id, idx)
        if following is None:
            finished = self.workflows[workflow_id].state == "running"
            self._finish(workflow_id, "succeeded", None, owner_rkey)
            return SettledOk(settled=True, finished=finished)
        started = self._start(following) if self._startable(following) else None
        return SettledOk(settled=True, next=started)

    def _failed_attempt(self, step: StepRow, error_json: str, **extra: Any) -> None:
        error = json.loads(error_json)
        step.result, step.error, step.finished_at, step.waiting_for = None, error, _now(), None
        step.attempts = [*step.attempts, {"attempt": step.attempt, "error": error, **extra}]

    async def settle_failed(
        self, workflow_id: str, idx: int, attempt: int, error_json: str, fence: Fence, owner_rkey: str | None
    ) -> bool:
        step = self._running(workflow_id, idx, attempt)
        if step is None:
            return False
        step.state = "failed"
        self._failed_attempt(step, error_json)
        self._finish(workflow_id, "failed", json.loads(error_json), owner_rkey)
        return True

    async def settle_retry(
        self, workflow_id: str, idx: int, attempt: int, error_json: str, fence: Fence, delay_s: float
    ) -> float | None:
        step = self._running(workflow_id, idx, attempt)
        if step is None:
            return None
        step.state, step.retry_at = "pending", _now() + dt.timedelta(seconds=delay_s)
        self._failed_attempt(step, error_json, retryAt=step.retry_at.isoformat())
        return step.retry_at.timestamp()

    async def finish(
        self, workflow_id: str, state: str, error_json: str | None, fence: Fence, owner_rkey: str | None
    ) -> bool:
        if self.fenced:
            return False
        self._finish(workflow_id, state, json.loads(error_json) if error_json else None, owner_rkey)
        return True

    async def mark_sent(self, workflow_id: str, idx: int, attempt: int) -> bool:
        step = self.steps[workflow_id][idx]
        if step.attempt != attempt:
            return False
        step.sent_commands = True
        return True

    async def mark_minted(
        self, workflow_id: str, idx: int, attempt: int, service: str, secret: bytes
    ) -> bytes | None:
        step = self.steps[workflow_id][idx]
        if step.attempt != attempt:
            return None
        if service not in step.minted:
            step.minted = [*step.minted, service]
        return self._secrets.setdefault((workflow_id, idx), secret)

    async def set_waiting(self, workflow_id: str, idx: int, attempt: int, what_json: str | None) -> None:
        step = self.steps[workflow_id][idx]
        if step.attempt == attempt:
            step.waiting_for = json.loads(what_json) if what_json is not None else None

    async def stored_profile(self, tenant_id: str, profile_id: str, version: int) -> Any:
        return self.profiles.get((tenant_id, profile_id, version))

    async def cancelled_step(self, workflow_id: str) -> StepRow | None:
        found = next((s for s in self.steps[workflow_id] if s.state == "cancelled"), None)
        return msgspec.structs.replace(found) if found is not None else None

    async def any_sent(self, workflow_id: str) -> bool:
        return any(s.sent_commands for s in self.steps[workflow_id])

    async def minted_steps(self, workflow_id: str) -> list[StepRow]:
        return [
            msgspec.structs.replace(s)
            for s in self.steps[workflow_id]
            if s.attempt > 0 and s.minted and s.state != "cancelled"
        ]

    async def cleaned_up(self, workflow_id: str) -> None:
        self.workflows[workflow_id].cancel_commands = False
