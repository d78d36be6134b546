"""Agent steps end to end: engine, command-queue and PKI as processes, a simulated site agent."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from nats.aio.msg import Msg

from better_compute.config import Settings
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, until
from better_compute.testing.workflows import wait_workflow
from better_compute.wire import Subjects
from better_compute.wire.cmdq import SERVICE as CMDQ
from better_compute.wire.engine import WorkflowStep
from engine_stack import FAST, AgentStack, sim_bmc


@pytest_asyncio.fixture(loop_scope="session")
async def stack(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> AsyncIterator[AgentStack]:
    settings = msgspec.structs.replace(bc_settings, app="engine_test_app:app")
    bc_processes.settings = settings
    bc_processes.extra_env.update(FAST)
    for name in ("bc-pki", "bc-command-queue", "bc-engine"):
        bc_processes.start(name)
    await bc_processes.wait_ready()
    s = AgentStack(bc_api, settings, tmp_path)
    yield s
    s.close_agents()


async def test_agent_steps_driver_operations_and_await_command(stack: AgentStack) -> None:
    sim, agent_id = await stack.agent("lab1")
    node = await stack.engine.create_node(site_id="lab1", bmc=sim_bmc())
    await stack.profile(
        "power",
        [
            {"use": "test.power", "on": "site", "with": {"action": "on"}},
            {"use": "netboot.clearEntry", "on": "site", "with": {"mac": "52:54:00:00:00:01"}},
            {"use": "test.awaitPower", "with": {"action": "cycle"}},
        ],
    )
    wf_id = await stack.start("power", node.id)
    done = await wait_workflow(stack.api, wf_id, timeout=60)
    assert done.state == "succeeded", done
    assert done.command_kinds == ["power.setPower", "driver.invoke"]
    results = [s.result for s in done.steps]
    assert results[0]["result"]["kind"] == "power.setPower"
    assert results[1]["result"]["kind"] == "driver.invoke"
    assert results[2]["result"]["kind"] == "power.setPower"
    assert [r["attested"] for r in results] == [False, False, False]  # a site agent does not attest

    commands = {c.key: c for c in (await stack.cq.list_commands(workflow_id=wf_id)).commands}
    assert set(commands) == {f"wf:{wf_id}:0#1", f"wf:{wf_id}:1#1", f"wf:{wf_id}:2#1:power"}
    assert {c.state for c in commands.values()} == {"succeeded"}
    assert {c.agent_id for c in commands.values()} == {agent_id}
    assert [s.command_id for s in done.steps[:2]] == [
        commands[f"wf:{wf_id}:0#1"].id, commands[f"wf:{wf_id}:1#1"].id,
    ]  # fmt: skip
    assert len(sim.executions()) == 3  # each command ran exactly once


async def test_a_failed_command_fails_the_step_with_driver_error(stack: AgentStack) -> None:
    await stack.agent("lab2", "--fail", "power.setPower")
    node = await stack.engine.create_node(site_id="lab2", bmc=sim_bmc())
    await stack.profile("fails", [{"use": "test.power", "on": "site"}])
    done = await wait_workflow(stack.api, await stack.start("fails", node.id), timeout=60)
    assert done.state == "failed"
    err = done.steps[0].error
    assert err["code"] == "DRIVER_ERROR"
    assert err["details"]["state"] == "failed"
    assert err["details"]["commandId"] == done.steps[0].command_id


async def test_retry_cancels_the_previous_attempts_command_before_sending_anew(stack: AgentStack) -> None:
    node = await stack.engine.create_node(site_id="lab3", bmc=sim_bmc())
    # no agent in lab3 yet: the step times out while its command (10 minutes to live) still waits
    # (12 s: attempt 2 has as long, and it must outlast the agent's start on a loaded machine;
    # with 5 s it did not once, at a load of 25 on 2 cores: the agent said hello 5.6 s after the retry)
    await stack.profile("slow", [{"use": "test.awaitPower", "timeout": "12s"}])
    wf_id = await stack.start("slow", node.id)
    done = await wait_workflow(stack.api, wf_id, timeout=30)
    assert (done.state, done.steps[0].error["code"]) == ("failed", "TIMEOUT")
    [first] = (await stack.cq.list_commands(workflow_id=wf_id)).commands
    assert (first.key, first.state) == (f"wf:{wf_id}:0#1:power", "pending")

    await stack.engine.retry_workflow(id=wf_id)

    async def first_cancelled() -> bool:
        return (await stack.cq.get(id=first.id)).state == "cancelled"

    await until(first_cancelled)  # only then may an agent appear in lab3
    sim, _ = await stack.agent("lab3")
    done = await wait_workflow(stack.api, wf_id, timeout=60)
    assert done.state == "succeeded", done
    assert done.steps[0].attempt == 2
    assert (await stack.cq.get(id=first.id)).state == "cancelled"
    second = await stack.cq.get(id=done.steps[0].result["commandId"])
    assert second.key == f"wf:{wf_id}:0#2:power"
    ran = sim.executions()
    assert len(ran) == 1  # attempt 1's command never ran
    assert first.id not in ran[0]


async def test_abort_cancels_the_workflows_live_commands(stack: AgentStack) -> None:
    node = await stack.engine.create_node(site_id="lab4", bmc=sim_bmc())
    await stack.profile("waits", [{"use": "test.power", "on": "site"}])
    wf_id = await stack.start("waits", node.id)

    async def command_id() -> str | None:
        view = await stack.engine.get_workflow(id=wf_id)
        return view.steps[0].command_id  # type: ignore[no-any-return]

    cmd = await until(command_id)
    await stack.engine.abort_workflow(id=wf_id)

    async def cancelled() -> bool:
        return (await stack.cq.get(id=cmd)).state == "cancelled"

    await until(cancelled)
    view = await stack.engine.get_workflow(id=wf_id)
    assert view.state == "aborted"
    assert msgspec.json.encode(view).count(b"cancelled") >= 1


@pytest.mark.parametrize(
    "first",
    [
        pytest.param({"use": "test.power", "on": "site"}, id="agent-step"),
        # a control-plane step waiting on its command (await_command) is covered the same way
        pytest.param(
            {"use": "test.awaitPower", "with": {"action": "on"}}, id="control-plane", marks=pytest.mark.long
        ),
    ],
)
async def test_a_command_that_settles_while_the_engine_is_down_is_still_picked_up(
    stack: AgentStack, bc_processes: ServiceProcesses, first: dict[str, Any]
) -> None:
    node = await stack.engine.create_node(site_id="lab5", bmc=sim_bmc())
    await stack.profile("later", [first, {"use": "test.noop"}])
    wf_id = await stack.start("later", node.id)

    async def command_id() -> str | None:
        view = await stack.engine.get_workflow(id=wf_id)
        return view.steps[0].command_id  # type: ignore[no-any-return]

    cmd = await until(command_id)
    [engine] = [p for p in bc_processes.procs if p.service == "bc-engine"]
    engine.kill()  # its settle event will go to nobody
    await stack.agent("lab5")

    async def settled() -> bool:
        return (await stack.cq.get(id=cmd)).state == "succeeded"

    await until(settled)
    bc_processes.start("bc-engine")  # nothing wakes it for this key: only the safety net can
    await bc_processes.wait_ready()
    done = await wait_workflow(stack.api, wf_id, timeout=60)
    assert done.state == "succeeded"
    assert done.steps[0].result["commandId"] == cmd


async def test_a_control_plane_step_waits_on_its_command_without_running_again(stack: AgentStack) -> None:
    # the command runs 4.5 s at its agent: a control-plane step waiting on it used to run again
    # (and enqueue it again) every COMMAND_POLL_MS (2 s), and on each of its dispatched, acked
    # and running events
    sim, _ = await stack.agent("lab6", "--delay", "power.setPower=4500")
    node = await stack.engine.create_node(site_id="lab6", bmc=sim_bmc())
    await stack.profile("cp-wait", [{"use": "test.awaitPower", "with": {"action": "cycle"}}])
    keys: list[str] = []
    reads: list[str] = []

    async def enqueued(msg: Msg) -> None:
        keys.append(str(msgspec.json.decode(msg.data).get("key")))

    async def read(msg: Msg) -> None:
        reads.append(str(msgspec.json.decode(msg.data).get("id")))

    subjects = Subjects(stack.settings.subject_root)
    sub = await stack.api.nc.subscribe(subjects.api(CMDQ, "commands", "enqueue"), cb=enqueued)
    got = await stack.api.nc.subscribe(subjects.api(CMDQ, "commands", "get"), cb=read)
    try:
        wf_id = await stack.start("cp-wait", node.id)

        async def waiting_on_command() -> WorkflowStep | None:
            step = await stack.step(wf_id)
            return step if step.command_id and step.state == "running" else None

        step = await until(waiting_on_command, timeout=30)
        assert step.waiting_for == {
            "reason": "command",
            "commandId": step.command_id,
            "kind": "power.setPower",
        }
        why = await stack.engine.why(id=wf_id)
        assert step.command_id in why.answer
        done = await wait_workflow(stack.api, wf_id, timeout=60)

        def ours() -> list[str]:
            return [k for k in keys if k.startswith(f"wf:{wf_id}:")]

        # the copies this test's subscriptions got, all read
        await until(lambda: ours() and step.command_id in reads)
    finally:
        await sub.unsubscribe()
        await got.unsubscribe()
    assert done.state == "succeeded", done
    assert done.steps[0].result["commandId"] == step.command_id
    assert len(sim.executions()) == 1
    # enqueued once, when the step sent it; read by its id (not enqueued again) when its end woke
    # the step, and nothing between but, at most, one pass a work-queue poll brought that had read
    # the new workflow's key as due before its first pass moved it to the step's deadline (every
    # 2 s: 4 or more)
    assert ours() == [f"wf:{wf_id}:0#1:power"]
    assert 1 <= reads.count(str(step.command_id)) <= 2, reads
