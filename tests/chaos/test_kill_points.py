"""A crash at every point of a deploy (issue 14 item 5): each process SIGKILLed at a named kill
point (better_compute.service.killpoints) while a deploy-like workflow drives a simulated
machine, restarted by the test's supervisor, and the machine's ledger (what its BMC and disk
saw, not what our services logged) checked: the workflow ends (succeeded, or failed with a
reason), and no power change, media insert or wipe happened twice.

The fast subset runs in ``make test``; the full sweep of every point, and nats-server and
PostgreSQL restarted mid-rollout, only with ``make test-long``. Each prints its table.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from better_compute.config import Settings
from better_compute.testing import ServiceProcesses
from killpoint_sweep import Case, Round, SweepStack, all_points, table

# The N-th hit of a point lands it on a chosen command: the 3rd command is the power-on, the
# 5th (after the wait for the join) the wipe; bcd's points are the wipe's disk write.
FAST = [
    Case("engine.after-enqueue@3", "engine"),
    Case("command-queue.after-claim@3", "command-queue"),
    Case("agent.after-claim@3", "site-agent"),
    Case("bcd.after-disk-write", "bcd"),
]


def full_sweep() -> list[Case]:
    cases = []
    for p in all_points():
        if p.process == "engine":
            nth = {"engine.before-mark-running": 1, "engine.after-mark-running": 1}.get(p.name, 3)
            cases.append(Case(f"{p.name}@{nth}", "engine"))
        elif p.process == "command-queue":
            cases.append(Case(f"{p.name}@3", "command-queue"))
        elif p.process == "pki":
            continue  # a join's: tests/e2e/test_fleet_instance_kills.py arms it
        elif p.process == "agent":
            cases.append(Case(f"{p.name}@3", "site-agent"))  # the power-on
            cases.append(Case(p.name, "bcd"))  # bcd's first command is the wipe
        else:
            cases.append(Case(p.name, "bcd"))
    return cases


@pytest_asyncio.fixture(loop_scope="session")
async def sweep(
    request: pytest.FixtureRequest, bc_settings: Settings, bc_processes: ServiceProcesses, tmp_path: Path
) -> AsyncIterator[SweepStack]:
    stack = SweepStack(tmp_path, bc_settings, bc_processes, machines=request.param)
    try:
        await stack.start()
        yield stack
    finally:
        await stack.close()
        print("--- site agent ---", stack.agent.output()[-3000:], sep="\n")


def _report(rounds: list[Round], capsys: pytest.CaptureFixture[str], title: str) -> None:
    with capsys.disabled():
        print(f"\n{title}\n{table(rounds)}")
    problems = [p for r in rounds for p in r.problems()]
    assert problems == [], "\n".join(problems)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("sweep", [len(FAST) + 1], indirect=True)
async def test_a_rollout_survives_a_kill_in_each_process(
    sweep: SweepStack, capsys: pytest.CaptureFixture[str]
) -> None:
    # Regression, first (alone, so the point's third hit is this machine's power-on): the site
    # agent dies after running the power-on and before reporting it, and comes back only once
    # the machine booted and its bcd joined. The join step counted only joins after the
    # power-on step *settled*, and waited for one that had already happened (a stall until its
    # 30-minute timeout; found by the full sweep).
    m = sweep.sim.machine(0)
    sweep.hold_agent = lambda: m.ledger.count("power", to="On") == 1 and m.ledger.count("bcd.started") == 0
    rounds = [await sweep.run([Case("agent.after-run@3", "site-agent")])]
    sweep.hold_agent = lambda: False

    # One point armed in each process, four machines rolled out at once: each process dies once.
    rounds.append(await sweep.run(FAST, machines=len(FAST)))
    _report(rounds, capsys, "kill points: a join before its report; one per process during a rollout")
    assert [o.state for o in rounds[0].outcomes] == ["succeeded"]


@pytest.mark.long
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("sweep", [len(full_sweep()) + 3], indirect=True)
async def test_every_kill_point_one_at_a_time(sweep: SweepStack, capsys: pytest.CaptureFixture[str]) -> None:
    cases = full_sweep()
    with capsys.disabled():
        print("\nkill points:", *(f"  {p.name} ({p.process}): {p.what}" for p in all_points()), sep="\n")
    rounds: list[Round] = []
    for case in cases:
        rounds.append(await sweep.run([case]))
        with capsys.disabled():  # as it goes: a sweep that runs out of time still shows its rows
            print(table(rounds[-1:]).split("\n", 1)[1])
    # and the servers: nats-server, then PostgreSQL, killed and restarted while three deploy
    rounds.append(await sweep.run_with_server_restarts(machines=3))
    _report(rounds, capsys, "kill points, one per workflow")
