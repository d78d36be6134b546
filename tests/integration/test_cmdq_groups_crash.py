"""The command queue applies claims and results that arrive together as one statement each
(group commit, ``better_compute.service.groups``). Killed between two groups (one committed and not yet
answered, the next not committed), it loses nothing and nothing runs twice: the agent asks again,
the restarted queue answers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from better_compute.agent import Agent
from better_compute.agent.sim import join_agent, sim_handlers
from better_compute.clients.cmdq import CommandQueueClient
from better_compute.core.ids import new_id
from better_compute.service import ApiClient
from better_compute.service.killpoints import marker_name
from better_compute.testing import ServiceProcesses
from better_compute.wire.cmdq import EnqueueCommand

COMMANDS = 24
FAST_ENV = {"BC_CMDQ_HEARTBEAT": "200ms", "BC_CMDQ_SILENT_AFTER": "2000ms", "BC_CMDQ_SWEEP": "100ms"}


@contextlib.asynccontextmanager
async def running(agent: Agent) -> AsyncIterator[Agent]:
    await agent.start()
    task = asyncio.create_task(agent.run())
    try:
        yield agent
    finally:
        await agent.stop()
        await asyncio.wait_for(task, 10)


@pytest.mark.parametrize("point", ["command-queue.after-claim@8", "command-queue.after-result@8"])
async def test_a_queue_killed_between_two_groups_loses_nothing_and_runs_nothing_twice(
    point: str, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    bc_processes.extra_env.update(FAST_ENV)
    bc_processes.start("bc-pki")
    bc_processes.extra_env.update(BC_KILL_AT=point, BC_KILL_MARKER_DIR=str(markers))
    queue = bc_processes.start("bc-command-queue")
    await bc_processes.wait_ready()
    cq = CommandQueueClient(bc_api)
    node = new_id("node")
    enrollment = await join_agent(bc_api, site_id="site-g", role="node", node_id=node)
    ids = []
    for i in range(COMMANDS):  # all out before the agent is there: its claims come at once
        view = await cq.enqueue(
            EnqueueCommand(node_id=node, site_id="site-g", kind="node.inventory", key=f"g-{i}", target="node")
        )
        ids.append(view.id)
    agent = Agent(
        enrollment=enrollment,
        handlers=sim_handlers(["node.inventory"], exec_log=tmp_path / "exec.log"),
        journal=tmp_path / "journal.db",
        nc=bc_api.nc,
        subjects=bc_api.subjects,
        request_timeout=1.0,
    )
    async with running(agent):
        assert await queue.wait_exit(timeout=60) is not None  # killed at the point, mid-groups
        name, nth = point.split("@")
        assert (markers / marker_name(name, int(nth))).exists()
        queue.killed = True  # by its own kill point: an exit the test asked for
        bc_processes.restart(queue)  # as its supervisor does (the marker keeps the point from firing again)
        await bc_processes.wait_ready()
        for command_id in ids:
            view = await cq.wait(id=command_id, timeout=60)
            assert view.state == "succeeded", (command_id, view.state, view.reason)
    ran = (tmp_path / "exec.log").read_text().split()[::2]
    assert sorted(ran) == sorted(ids)  # each once
