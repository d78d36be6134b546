"""An agent that loses its journal never runs a command a second time.

A node's bcd comes back in its new OS, a RAM-disk agent reboots, an operator wipes a state
folder: the agent keeps its identity (enrollment, key, certificate) but its journal, which is
what made execution at most once, is gone. The command queue recognises the claim as coming
from another journal and settles the command ``failed`` (``interrupted``) instead of letting it
run again. Executions are counted at the agent (its own exec log), not from the queue's view.

``BC_STRESS_ROUNDS`` sets how many times the journal is lost (8 by default).
"""

from __future__ import annotations

import os
import signal
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest_asyncio

from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.pki import PkiClient
from better_compute.config import Settings
from better_compute.core.ids import new_id
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, until
from better_compute.testing.agents import SimAgent, start_sim_agent
from better_compute.wire.cmdq import TERMINAL_STATES, CommandView, EnqueueCommand

ROUNDS = int(os.environ.get("BC_STRESS_ROUNDS", "8"))
FAST_ENV = {
    "BC_CMDQ_HEARTBEAT": "200ms",
    "BC_CMDQ_SILENT_AFTER": "1500ms",
    "BC_CMDQ_LOST_AFTER": "600000ms",  # the queue must not settle it by itself meanwhile
    "BC_CMDQ_REDELIVER_AFTER": "1000ms",
    "BC_CMDQ_SWEEP": "100ms",
    "BC_CMDQ_ACK_WAIT": "2000ms",  # the dead agent's delivery comes again after 2 s
}


@dataclass
class Stack:
    api: ApiClient
    cq: CommandQueueClient
    pki: PkiClient
    settings: Settings
    tmp: Path


@pytest_asyncio.fixture(loop_scope="session")
async def stack(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> AsyncIterator[Stack]:
    bc_processes.extra_env.update(FAST_ENV)
    bc_processes.start("bc-pki")
    bc_processes.start("bc-command-queue")
    await bc_processes.wait_ready()
    yield Stack(
        api=bc_api,
        cq=CommandQueueClient(bc_api, timeout=3.0),
        pki=PkiClient(bc_api),
        settings=bc_settings,
        tmp=tmp_path,
    )


def lose_journal(state: Path) -> None:
    """What a wiped state folder leaves: the enrollment (identity, key, certificate) and the
    test's exec log, and no journal. The crash marker goes too, so the next command crashes."""
    for path in [*state.glob("journal.db*"), state / "crashed"]:
        path.unlink(missing_ok=True)
    assert (state / "enrollment.json").exists()


def wipe(node: str, key: str) -> EnqueueCommand:
    return EnqueueCommand(node_id=node, site_id="site-j", kind="node.wipe", key=key, target="node")


async def test_an_agent_that_lost_its_journal_never_runs_a_command_twice(
    stack: Stack, sims: list[SimAgent]
) -> None:
    cq = stack.cq
    node = new_id("node")
    state = stack.tmp / "bcd"
    # the crash point alternates: while the wipe runs, and after its result was journaled
    # but before it was reported (the result is lost with the journal)
    points = ["started", "executed"]
    sim, agent_id = await start_sim_agent(
        stack.settings, state, site_id="site-j", pki=stack.pki, cq=cq, role="node", node_id=node,
        args=["--crash", f"node.wipe={points[0]}"],
    )  # fmt: skip
    sims.append(sim)
    assert agent_id == node

    def runs(command_id: str) -> int:
        return sum(line.split()[0] == command_id for line in sim.executions())

    interrupted: list[CommandView] = []
    for i in range(ROUNDS):
        view = await cq.enqueue(wipe(node, f"wipe-{i}"))
        assert await sim.wait_exit() == -signal.SIGKILL
        assert runs(view.id) == 1
        assert (await cq.get(id=view.id)).state in ("acked", "running")
        lose_journal(state)
        last_round = i + 1 == ROUNDS
        sim.args = [] if last_round else ["--crash", f"node.wipe={points[(i + 1) % 2]}"]
        sim.start()  # the same identity, a new (empty) journal

        async def settled_or_ran_again(command_id: str = view.id) -> CommandView | None:
            got = await cq.get(id=command_id)
            if got.state in TERMINAL_STATES or runs(command_id) > 1:
                return got
            return None

        done = await until(settled_or_ran_again)
        assert runs(view.id) == 1, f"round {i}: {view.id} ran twice"
        assert (done.state, done.reason) == ("failed", "interrupted")
        interrupted.append(done)
    # the agent with its new journal runs new commands as before
    last = await cq.wait(id=(await cq.enqueue(wipe(node, "wipe-last"))).id, timeout=30)
    assert (last.state, last.attested) == ("succeeded", True)
    assert sorted(sim.executions()) == sorted(f"{v.id} node.wipe" for v in [*interrupted, last])


def restore(state: Path, copy: Path) -> None:
    """The state folder rolled back to ``copy`` (a host restored from a snapshot): the journal
    as it was then, the crash marker gone so the agent runs on."""
    for path in [*state.glob("journal.db*"), state / "crashed"]:
        path.unlink(missing_ok=True)
    with sqlite3.connect(copy) as src, sqlite3.connect(state / "journal.db") as dst:
        src.backup(dst)


async def test_a_journal_restored_from_an_older_copy_never_runs_what_it_claimed_since(
    stack: Stack, sims: list[SimAgent]
) -> None:
    """Issue 25 item 5: a claim marks its command running (no running mark), under the id the
    journal wrote before the claim. The agent's host is rolled back to a snapshot taken before
    the claim: its journal has the same id but no entry of the command. Its claim (another claim
    id) is refused, and the agent settles the command as one an earlier process of it started:
    the wipe (not idempotent) fails interrupted, promptly, and never runs twice."""
    cq = stack.cq
    node = new_id("node")
    state = stack.tmp / "bcd-restored"
    sim, _agent_id = await start_sim_agent(
        stack.settings, state, site_id="site-j", pki=stack.pki, cq=cq, role="node", node_id=node,
        args=["--crash", "node.wipe=started"],
    )  # fmt: skip
    sims.append(sim)
    snapshot = stack.tmp / "snapshot.db"
    with sqlite3.connect(state / "journal.db") as src, sqlite3.connect(snapshot) as dst:
        src.backup(dst)  # consistent while the agent runs: SQLite's online backup

    def runs(command_id: str) -> int:
        return sum(line.split()[0] == command_id for line in sim.executions())

    view = await cq.enqueue(wipe(node, "wipe-restored"))
    assert await sim.wait_exit() == -signal.SIGKILL  # while the wipe runs
    assert runs(view.id) == 1
    assert (await cq.get(id=view.id)).state == "running"  # by its claim
    restore(state, snapshot)
    sim.args = []
    sim.start()

    async def settled(command_id: str = view.id) -> CommandView | None:
        got = await cq.get(id=command_id)
        return got if got.state in TERMINAL_STATES or runs(command_id) > 1 else None

    done = await until(settled, timeout=30)  # not at the wipe's deadline (10 minutes)
    assert runs(view.id) == 1
    assert done.state == "failed"
    assert (done.reason or "").startswith("interrupted"), done.reason
    last = await cq.wait(id=(await cq.enqueue(wipe(node, "wipe-after"))).id, timeout=30)
    assert last.state == "succeeded"
    assert sorted(sim.executions()) == sorted(f"{v.id} node.wipe" for v in [view, last])
