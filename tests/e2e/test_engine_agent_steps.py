"""Agent steps end to end: engine, command-queue and PKI as processes, a simulated site agent."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest_asyncio

from better_compute.cmdq_client import CommandQueueClient
from better_compute.config import Settings
from better_compute.pki_client import PkiClient
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, until
from better_compute.testing.agents import SimAgent, start_sim_agent
from better_compute.testing.workflows import wait_workflow

# a node's BMC: the engine relays it to BMC commands (docs/metal.md)
SIM_BMC = {"driver": "sim", "address": "sim-bmc"}

FAST = {"BC_CMDQ_HEARTBEAT": "200ms", "BC_CMDQ_SILENT_AFTER": "1500ms", "BC_CMDQ_SWEEP": "100ms"}


class Stack:
    def __init__(self, api: ApiClient, settings: Settings, tmp: Path) -> None:
        self.api = api
        self.settings = settings
        self.tmp = tmp
        self.cq = CommandQueueClient(api)
        self.pki = PkiClient(api)
        self.agents: list[SimAgent] = []

    async def agent(self, site: str, *args: str) -> tuple[SimAgent, str]:
        sim, agent_id = await start_sim_agent(
            self.settings, self.tmp / f"agent-{len(self.agents)}", site_id=site, pki=self.pki, cq=self.cq,
            args=list(args),
        )  # fmt: skip
        self.agents.append(sim)
        return sim, agent_id

    async def profile(self, pid: str, steps: list[dict[str, Any]]) -> None:
        doc = {"id": pid, "version": 1, "target": "metal", "role": "host", "steps": steps}
        await self.api.call("engine", "profiles.create", {"document": doc})

    async def start(self, pid: str, node: str) -> str:
        wf = await self.api.call("engine", "workflows.start", {"profileId": pid, "nodeId": node})
        return str(wf["id"])


@pytest_asyncio.fixture(loop_scope="session")
async def stack(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> AsyncIterator[Stack]:
    settings = msgspec.structs.replace(bc_settings, app="engine_test_app:app")
    bc_processes.settings = settings
    bc_processes.extra_env.update(FAST)
    for name in ("bc-pki", "bc-command-queue", "bc-engine"):
        bc_processes.start(name)
    await bc_processes.wait_ready()
    s = Stack(bc_api, settings, tmp_path)
    yield s
    for sim in s.agents:
        sim.close()


async def test_agent_steps_driver_operations_and_await_command(stack: Stack) -> None:
    sim, agent_id = await stack.agent("lab1")
    node = await stack.api.call("engine", "nodes.create", {"siteId": "lab1", "bmc": SIM_BMC})
    await stack.profile(
        "power",
        [
            {"use": "test.power", "on": "site", "with": {"action": "on"}},
            {"use": "netboot.clearEntry", "on": "site", "with": {"mac": "52:54:00:00:00:01"}},
            {"use": "test.awaitPower", "with": {"action": "cycle"}},
        ],
    )
    wf_id = await stack.start("power", node["id"])
    done = await wait_workflow(stack.api, wf_id, timeout=60)
    assert done["state"] == "succeeded", done
    assert done["commandKinds"] == ["power.setPower", "driver.invoke"]
    results = [s["result"] for s in done["steps"]]
    assert results[0]["result"]["kind"] == "power.setPower"
    assert results[1]["result"]["kind"] == "driver.invoke"
    assert results[2]["result"]["kind"] == "power.setPower"
    assert [r["attested"] for r in results] == [False, False, False]  # a site agent does not attest

    commands = {c.key: c for c in (await stack.cq.list_commands(workflow_id=wf_id)).commands}
    assert set(commands) == {f"wf:{wf_id}:0#1", f"wf:{wf_id}:1#1", f"wf:{wf_id}:2#1:power"}
    assert {c.state for c in commands.values()} == {"succeeded"}
    assert {c.agent_id for c in commands.values()} == {agent_id}
    assert [s["commandId"] for s in done["steps"][:2]] == [
        commands[f"wf:{wf_id}:0#1"].id, commands[f"wf:{wf_id}:1#1"].id,
    ]  # fmt: skip
    assert len(sim.executions()) == 3  # each command ran exactly once


async def test_a_failed_command_fails_the_step_with_driver_error(stack: Stack) -> None:
    await stack.agent("lab2", "--fail", "power.setPower")
    node = await stack.api.call("engine", "nodes.create", {"siteId": "lab2", "bmc": SIM_BMC})
    await stack.profile("fails", [{"use": "test.power", "on": "site"}])
    done = await wait_workflow(stack.api, await stack.start("fails", node["id"]), timeout=60)
    assert done["state"] == "failed"
    err = done["steps"][0]["error"]
    assert err["code"] == "DRIVER_ERROR"
    assert err["details"]["state"] == "failed"
    assert err["details"]["commandId"] == done["steps"][0]["commandId"]


async def test_retry_cancels_the_previous_attempts_command_before_sending_anew(stack: Stack) -> None:
    node = await stack.api.call("engine", "nodes.create", {"siteId": "lab3", "bmc": SIM_BMC})
    # no agent in lab3 yet: the step times out while its command (10 minutes to live) still waits
    # (5 s: attempt 2 has as long, and it must outlast the agent's start on a loaded machine)
    await stack.profile("slow", [{"use": "test.awaitPower", "timeout": "5s"}])
    wf_id = await stack.start("slow", node["id"])
    done = await wait_workflow(stack.api, wf_id, timeout=30)
    assert (done["state"], done["steps"][0]["error"]["code"]) == ("failed", "TIMEOUT")
    [first] = (await stack.cq.list_commands(workflow_id=wf_id)).commands
    assert (first.key, first.state) == (f"wf:{wf_id}:0#1:power", "pending")

    await stack.api.call("engine", "workflows.retry", {"id": wf_id})

    async def first_cancelled() -> bool:
        return (await stack.cq.get(first.id)).state == "cancelled"

    await until(first_cancelled)  # only then may an agent appear in lab3
    sim, _ = await stack.agent("lab3")
    done = await wait_workflow(stack.api, wf_id, timeout=60)
    assert done["state"] == "succeeded", done
    assert done["steps"][0]["attempt"] == 2
    assert (await stack.cq.get(first.id)).state == "cancelled"
    second = await stack.cq.get(done["steps"][0]["result"]["commandId"])
    assert second.key == f"wf:{wf_id}:0#2:power"
    ran = sim.executions()
    assert len(ran) == 1  # attempt 1's command never ran
    assert first.id not in ran[0]


async def test_abort_cancels_the_workflows_live_commands(stack: Stack) -> None:
    node = await stack.api.call("engine", "nodes.create", {"siteId": "lab4", "bmc": SIM_BMC})
    await stack.profile("waits", [{"use": "test.power", "on": "site"}])
    wf_id = await stack.start("waits", node["id"])

    async def command_id() -> str | None:
        view = await stack.api.call("engine", "workflows.get", {"id": wf_id})
        return view["steps"][0]["commandId"]  # type: ignore[no-any-return]

    cmd = await until(command_id)
    await stack.api.call("engine", "workflows.abort", {"id": wf_id})

    async def cancelled() -> bool:
        return (await stack.cq.get(cmd)).state == "cancelled"

    await until(cancelled)
    view = await stack.api.call("engine", "workflows.get", {"id": wf_id})
    assert view["state"] == "aborted"
    assert json.dumps(view).count("cancelled") >= 1


async def test_a_command_that_settles_while_the_engine_is_down_is_still_picked_up(
    stack: Stack, bc_processes: ServiceProcesses
) -> None:
    node = await stack.api.call("engine", "nodes.create", {"siteId": "lab5", "bmc": SIM_BMC})
    await stack.profile("later", [{"use": "test.power", "on": "site"}, {"use": "test.noop"}])
    wf_id = await stack.start("later", node["id"])

    async def command_id() -> str | None:
        view = await stack.api.call("engine", "workflows.get", {"id": wf_id})
        return view["steps"][0]["commandId"]  # type: ignore[no-any-return]

    cmd = await until(command_id)
    [engine] = [p for p in bc_processes.procs if p.service == "bc-engine"]
    engine.kill()  # its settle event will go to nobody
    await stack.agent("lab5")

    async def settled() -> bool:
        return (await stack.cq.get(cmd)).state == "succeeded"

    await until(settled)
    bc_processes.start("bc-engine")  # nothing wakes it for this key: only the safety net can
    await bc_processes.wait_ready()
    done = await wait_workflow(stack.api, wf_id, timeout=60)
    assert done["state"] == "succeeded"
    assert done["steps"][0]["result"]["commandId"] == cmd
