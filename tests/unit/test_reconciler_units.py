"""The reconciler's state machine (``bc_engine.core.engine``) against the in-memory store
(``tests/support/reconciler_memory.py``): advance, scheduling, retry, supersede, abort and fencing,
each a few passes with scripted step outcomes, no PostgreSQL and no processes."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest

from bc_engine.core.engine import Engine, FencedError
from bc_engine.core.outcomes import Fail, Ok, Outcome, Wait
from bc_engine.core.reconciler_store import PgReconcilerStore
from bc_engine.store import StepRow, WorkflowRow
from better_compute.core.errors import BcError, ErrorCode
from better_compute.provision import parse_retry
from reconciler_memory import MemoryReconcilerStore

Script = Outcome | Callable[[StepRow], Awaitable[Outcome]]
# stored as a workflow step stores it (RetryPolicy.to_stored), so the engine reads it back whole
RETRY_TWICE = parse_retry({"on": ["DRIVER_ERROR"], "attempts": 2, "backoff": "60s"}, "retry").to_stored()


class Runner:
    """A ``StepRunner`` whose steps come to the outcomes it is given, in turn."""

    def __init__(self, *script: Script) -> None:
        self.script = list(script)
        self.ran: list[tuple[int, int]] = []  # (step, attempt)

    def pass_begins(self, wf: WorkflowRow, record: Any) -> None:
        pass

    def pass_ends(self, wf: WorkflowRow) -> None:
        pass

    async def prepare(self, wf: WorkflowRow) -> float | None:
        return None

    async def run(self, wf: WorkflowRow, step: StepRow, deadline: float) -> Outcome:
        self.ran.append((step.idx, step.attempt))
        out = self.script.pop(0)
        return out if isinstance(out, Ok | Fail | Wait) else await out(step)


class Feed:
    def __init__(self) -> None:
        self.seen: list[tuple[str, int | None]] = []

    async def changed(self, wf: Any, state: str, step: Any, *, result: Any = None, error: Any = None) -> None:
        self.seen.append((state, step.idx if step is not None else None))


class Log:
    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *a, **kw: None


class Services:
    """The command-queue, bc-pki and bc-secrets as the clean-up calls them."""

    def __init__(self) -> None:
        self.still_running: list[str] = []
        self.away = False
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def cancel_under(self, **kw: Any) -> Any:
        self.calls.append(("cancel_under", kw))
        if self.away:
            raise BcError(ErrorCode.UNAVAILABLE, "away", {})
        running = [
            SimpleNamespace(command_id=c, agent_id="agt_1", journal_id="jr_1") for c in self.still_running
        ]
        return SimpleNamespace(running=list(self.still_running), running_at=running)

    async def revoke_attempt(self, **kw: Any) -> None:
        self.calls.append(("revoke_attempt", kw))
        if self.away:
            raise BcError(ErrorCode.UNAVAILABLE, "away", {})


class Leases:
    def owns(self, shard: int) -> int:
        return 1


def make(store: MemoryReconcilerStore, runner: Runner) -> tuple[Engine, Feed, Services, list[str]]:
    feed, services, woken = Feed(), Services(), []

    async def wake(rkey: str) -> None:
        woken.append(rkey)

    async def publish(*_: Any) -> None:
        pass

    engine = Engine(
        app=None,
        db=None, api=None, leases=Leases(),
        instance="me", log=Log(), publish=publish, wake=wake, runner=runner, events=feed, store=store,
        cmdq=services, pki=services, secrets=services,
    )  # fmt: skip
    return engine, feed, services, woken


def failure() -> Fail:
    return Fail(BcError(ErrorCode.DRIVER_ERROR, "the BMC said no", {}))


def past() -> dt.datetime:
    return dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)


async def test_a_pass_runs_every_step_in_turn_then_ends_the_workflow_and_queues_its_owner() -> None:
    store = MemoryReconcilerStore()
    store.add_workflow("wf_1", [{}, {}, {}], owner="keeper")
    engine, feed, _, woken = make(store, runner := Runner(Ok(1), Ok(2), Ok(3)))

    assert await engine.reconcile("wf_1") is None

    assert runner.ran == [(0, 1), (1, 1), (2, 1)]
    assert [s.state for s in store.steps["wf_1"]] == ["succeeded"] * 3
    assert store.workflows["wf_1"].state == "succeeded"
    assert feed.seen == [
        ("running", 0), ("succeeded", 0), ("running", 1), ("succeeded", 1),
        ("running", 2), ("succeeded", 2), ("succeeded", None),
    ]  # fmt: skip
    assert "wf_1" not in store.queue  # nothing more to look at
    assert "keeper:wf_1" in store.queue
    assert woken == ["keeper:wf_1"]


async def test_a_waiting_step_is_looked_at_again_when_it_asked_and_not_run_again_meanwhile() -> None:
    store = MemoryReconcilerStore()
    store.add_workflow("wf_1", [{}])
    at = time.time() + 30
    engine, _, _, _ = make(store, runner := Runner(Wait(at), Ok("done")))

    assert await engine.reconcile("wf_1") == at
    assert store.queue["wf_1"][0] == at  # the work queue has the key at that moment
    assert store.step("wf_1", 0).state == "running"

    assert await engine.reconcile("wf_1") is None  # its command settled: a wake-up
    assert runner.ran == [(0, 1), (0, 1)]  # the same attempt, looked at again
    assert store.workflows["wf_1"].state == "succeeded"


async def test_a_wake_up_during_a_pass_is_not_overwritten_by_the_passs_next_look() -> None:
    store = MemoryReconcilerStore()
    store.add_workflow("wf_1", [{}])

    async def woken_meanwhile(step: StepRow) -> Outcome:
        store.queue_now("wf_1")  # a command's settle event lands during the pass
        return Wait(time.time() + 30)

    engine, _, _, _ = make(store, Runner(woken_meanwhile))
    await engine.reconcile("wf_1")
    assert store.queue["wf_1"][0] == 0.0  # still due now


async def test_a_failure_its_policy_retries_waits_its_backoff_then_runs_a_new_attempt() -> None:
    store = MemoryReconcilerStore()
    store.add_workflow("wf_1", [{"retry": RETRY_TWICE}])
    engine, feed, _, _ = make(store, runner := Runner(failure(), failure()))

    again = await engine.reconcile("wf_1")
    assert again is not None
    assert 55 < again - time.time() <= 60
    step = store.step("wf_1", 0)
    assert (step.state, step.attempt, len(step.attempts)) == ("pending", 1, 1)
    assert feed.seen[-1] == ("pending", 0)

    assert await engine.reconcile("wf_1") == pytest.approx(again)  # not before its backoff
    assert runner.ran == [(0, 1)]

    step.retry_at = past()
    assert await engine.reconcile("wf_1") is None  # attempt 2 fails too: the policy is spent
    assert runner.ran == [(0, 1), (0, 2)]
    assert store.workflows["wf_1"].state == "failed"
    assert feed.seen[-2:] == [("failed", 0), ("failed", None)]


async def test_a_failure_without_a_policy_fails_the_workflow_at_once() -> None:
    store = MemoryReconcilerStore()
    store.add_workflow("wf_1", [{}, {}])
    engine, _, _, _ = make(store, runner := Runner(failure()))

    assert await engine.reconcile("wf_1") is None
    assert runner.ran == [(0, 1)]
    assert [s.state for s in store.steps["wf_1"]] == ["failed", "pending"]
    assert store.workflows["wf_1"].state == "failed"


async def test_a_new_attempt_waits_until_the_previous_attempts_commands_ended() -> None:
    store = MemoryReconcilerStore()
    store.add_workflow("wf_1", [{"retry": RETRY_TWICE}])

    async def sends_then_fails(step: StepRow) -> Outcome:
        await engine.mark_sent(step.workflow_id, step.idx, step.attempt)
        return failure()

    engine, _, services, _ = make(store, runner := Runner(sends_then_fails, Ok("done")))
    await engine.reconcile("wf_1")
    store.step("wf_1", 0).retry_at = past()
    services.still_running = ["cmd_1"]  # claimed by an agent: cannot be recalled

    again = await engine.reconcile("wf_1")
    assert again is not None
    assert again - time.time() <= 2.0
    step = store.step("wf_1", 0)
    assert (step.state, step.attempt) == ("pending", 1)
    assert step.waiting_for["reason"] == "previous-attempt-running"
    assert step.waiting_for["commands"] == ["cmd_1"]
    name, fenced = services.calls[-1]
    assert name == "cancel_under"
    assert fenced["fence"]
    assert fenced["key_prefix"] == "wf:wf_1:0#1"
    assert runner.ran == [(0, 1)]

    services.still_running = []  # it ended at its agent
    assert await engine.reconcile("wf_1") is None
    assert runner.ran == [(0, 1), (0, 2)]
    assert store.workflows["wf_1"].state == "succeeded"


async def test_an_abort_revokes_what_the_attempt_minted_and_runs_nothing_more() -> None:
    store = MemoryReconcilerStore()
    store.add_workflow("wf_1", [{}, {}])

    async def mints_then_waits(step: StepRow) -> Outcome:
        await engine.mark_minted(step.workflow_id, step.idx, step.attempt, "pki")
        return Wait(time.time() + 600)

    engine, _, services, _ = make(store, runner := Runner(mints_then_waits))
    await engine.reconcile("wf_1")
    store.abort("wf_1")
    services.away = True  # bc-pki is away: the clean-up waits for it

    again = await engine.reconcile("wf_1")
    assert again is not None
    assert again - time.time() <= 2.0
    assert store.workflows["wf_1"].cancel_commands

    services.away = False
    assert await engine.reconcile("wf_1") is None
    assert ("revoke_attempt", {"workflow_id": "wf_1", "step": 0, "attempt": 1,
                               "reason": "its workflow was aborted"}) in services.calls  # fmt: skip
    assert not any(name == "cancel_under" for name, _ in services.calls)  # it sent nothing
    assert not store.workflows["wf_1"].cancel_commands
    assert runner.ran == [(0, 1)]
    assert await engine.reconcile("wf_1") is None  # nothing left to look at


async def test_a_process_that_lost_the_shard_settles_nothing() -> None:
    store = MemoryReconcilerStore()
    store.add_workflow("wf_1", [{}, {}])

    async def outlived_its_lease(step: StepRow) -> Outcome:
        store.fenced = True  # another engine took the shard meanwhile
        return Ok("late")

    engine, feed, _, _ = make(store, Runner(outlived_its_lease))
    with pytest.raises(FencedError):
        await engine.reconcile("wf_1")
    assert store.step("wf_1", 0).state == "running"  # the new owner runs it again
    assert ("succeeded", 0) not in feed.seen


class _SettleDb:
    """A database whose settle statement answers every row as settled (last row first: its
    answers are matched by workflow), after ``turns(n)`` turns of the event loop for its n-th
    statement."""

    def __init__(self, turns: Callable[[int], int]) -> None:
        self.turns = turns
        self.batches: list[int] = []

    async def fetch(self, _sql: str, workflow_ids: list[str], *_columns: Any) -> list[dict[str, Any]]:
        self.batches.append(len(workflow_ids))
        for _ in range(self.turns(len(self.batches))):
            await asyncio.sleep(0)
        return [
            {"workflow_id": w, "settled": True, "finished": False, "next": None}
            for w in reversed(workflow_ids)
        ]


@pytest.mark.parametrize(
    ("db_turns", "pass_turns", "passes"),
    [
        (lambda n: 0, lambda n, i: 0, 2),
        (lambda n: 0, lambda n, i: 0, 40),
        (lambda n: 0, lambda n, i: (n * 7 + i) % 4, 5),
        (lambda n: 1, lambda n, i: (n * 7 + i) % 4, 2),
        (lambda n: n % 3, lambda n, i: (n * 7 + i) % 4, 2),
        (lambda n: n % 3, lambda n, i: (n * 7 + i) % 4, 40),
    ],
)
async def test_every_settle_is_answered_however_the_passes_interleave_with_the_batches(
    db_turns: Callable[[int], int], pass_turns: Callable[[int, int], int], passes: int
) -> None:
    """Settles that arrive while the batches in flight end (their flushers done, not yet
    forgotten) still go out: the workflow benchmark once hung with five workflows waiting on
    settles no batch took."""
    db = _SettleDb(db_turns)
    settles = PgReconcilerStore(db).settles

    async def one_pass(n: int) -> int:
        for i in range(30):
            for _ in range(pass_turns(n, i)):
                await asyncio.sleep(0)
            row = await settles((f"wf{n}", i, 1, "{}", 0, "me", 1, None, None))
            assert row["workflow_id"] == f"wf{n}"
        return n

    async with asyncio.timeout(10):
        assert await asyncio.gather(*(one_pass(n) for n in range(passes))) == list(range(passes))
    assert sum(db.batches) == passes * 30
