"""``bcx why <node|workflow>`` (issue 15 item 2): one answer naming what a waiting step waits
for, read from the stores. A test per situation: each creates it with real services (each its
own process) and simulated agents, runs ``bcx why`` and checks that the sentence names it."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest_asyncio

from better_compute.clients import EngineClient
from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.pki import PkiClient
from better_compute.config import Settings
from better_compute.crypto import sign_batch
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, bcx, until
from better_compute.testing.agents import SimAgent, start_sim_agent
from better_compute.testing.approvers import approver_keys, write_approvers
from better_compute.testing.workflows import wait_workflow
from engine_stack import sim_bmc
from engine_test_app import create_tables

FAST_AGENTS = {"BC_CMDQ_HEARTBEAT": "200ms", "BC_CMDQ_SILENT_AFTER": "1s", "BC_CMDQ_SWEEP": "100ms"}


@dataclass
class Stack:
    settings: Settings
    engine: EngineClient
    cq: CommandQueueClient
    pki: PkiClient
    tmp: Path
    agents: list[SimAgent]

    async def agent(self, name: str, *args: str) -> tuple[SimAgent, str]:
        sim, agent_id = await start_sim_agent(
            self.settings, self.tmp / name, site_id="lab1", pki=self.pki, cq=self.cq, args=list(args)
        )
        self.agents.append(sim)
        return sim, agent_id

    async def start(self, steps: list[dict[str, Any]], *, node: bool = True) -> tuple[str | None, str]:
        node_id = (await self.engine.create_node(site_id="lab1", bmc=sim_bmc())).id if node else None
        pid = f"why-{len(self.agents)}-{abs(hash(json.dumps(steps))) % 10**6}"
        doc = {"id": pid, "version": 1, "target": "metal", "role": "host", "steps": steps}
        await self.engine.create_profile(document=doc)
        wf = await self.engine.start_workflow(profile_id=pid, node_id=node_id)
        return node_id, wf.id

    async def why_says(self, id: str, *parts: str) -> str:
        """``bcx why``'s answer, once the engine's names every part (the step gets there on its
        own): polled through the client, then asked once through bcx, which must say the same."""

        last = [""]

        async def answer() -> str | None:
            last[0] = got = (await self.engine.why(id=id)).answer
            return got if all(p in got for p in parts) else None

        try:
            await until(answer, timeout=30, interval=0.2, what=f"why {id} naming {parts}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; it said: {last[0]}") from None
        code, out, err = await bcx(self.settings, "why", id)
        assert code == 0, err
        assert all(p in out for p in parts), out
        return out


async def _stack(
    settings: Settings, procs: ServiceProcesses, api: ApiClient, tmp: Path, **env: str
) -> AsyncIterator[Stack]:
    procs.settings = msgspec.structs.replace(settings, app="engine_test_app:app")
    procs.extra_env.update(FAST_AGENTS, **env)
    for name in ("bc-pki", "bc-command-queue", "bc-engine"):
        procs.start(name)
    await procs.wait_ready()
    await create_tables(settings.database_url)
    stack = Stack(procs.settings, EngineClient(api), CommandQueueClient(api), PkiClient(api), tmp, [])
    try:
        yield stack
    finally:
        for sim in stack.agents:
            sim.close()


@pytest_asyncio.fixture(loop_scope="session")
async def stack(
    bc_settings: Settings, bc_processes: ServiceProcesses, bc_api: ApiClient, tmp_path: Path
) -> AsyncIterator[Stack]:
    async for made in _stack(bc_settings, bc_processes, bc_api, tmp_path):
        yield made


async def test_no_connected_agent_at_the_site_names_the_site_and_when_one_was_last_seen(stack: Stack) -> None:
    sim, gone = await stack.agent("gone")
    sim.close()  # killed: silent from now on
    await until(lambda: _none_connected(stack), timeout=20, what="the agent shown disconnected")
    node_id, wf_id = await stack.start([{"use": "test.power", "on": "site"}])
    assert node_id is not None
    out = await stack.why_says(wf_id, "no connected agent at site lab1", "last seen 20")
    assert gone in out
    assert "step 0 test.power (attempt 1) waits:" in out
    assert "command power.setPower" in out
    assert "pending since" in out
    # by the node: the same answer
    by_node = await stack.why_says(node_id, "no connected agent at site lab1")
    assert _no_deadline(by_node.splitlines()[1]) == _no_deadline(out.splitlines()[1])
    # the same answer in workflows get and nodes show, human and --json
    code, got, err = await bcx(stack.settings, "workflows", "get", wf_id)
    assert code == 0, err
    [why] = [line for line in got.splitlines() if line.startswith("why: ")]
    assert "no connected agent at site lab1" in why
    assert gone in why
    code, got, err = await bcx(stack.settings, "workflows", "get", wf_id, "--json")
    # the site's only agent is gone: nothing of lab1 is heard, which comes first
    kinds = [r["kind"] for r in json.loads(got)["why"]["reasons"]]
    assert kinds[:2] == ["site-unreachable", "no-agent"], kinds
    code, shown, err = await bcx(stack.settings, "nodes", "show", node_id)
    assert code == 0, err
    assert any(
        line.startswith("why ") and "no connected agent at site lab1" in line for line in shown.splitlines()
    )
    answer = await stack.engine.why(id=node_id)
    assert (answer.waiting, answer.workflow_id, answer.node_id) == (True, wf_id, node_id)
    assert answer.reasons[0].facts["siteId"] == "lab1"


def _no_deadline(answer: str) -> str:
    return re.sub(r"deadline in \S+", "deadline in …", answer)


async def _none_connected(stack: Stack) -> bool:
    return not await stack.cq.agents(site_id="lab1", connected=True)


async def test_a_command_running_at_its_agent_names_the_agent_and_since_when(stack: Stack) -> None:
    _sim, agent_id = await stack.agent("slow", "--delay", "power.setPower=60000")
    _node_id, wf_id = await stack.start([{"use": "test.power", "on": "site"}])
    out = await stack.why_says(wf_id, "command power.setPower", f"on agent {agent_id}", "running since 20")
    assert "deadline in " in out
    await stack.engine.abort_workflow(id=wf_id)


async def test_an_aborted_workflows_command_still_running_at_its_agent_is_named_cancelling(
    stack: Stack,
) -> None:
    """Issue 22, gap 1: a cancel is a handshake. After the abort, the command its agent still
    runs is `cancelling`, and why says so, naming the agent that has not confirmed yet."""
    _sim, agent_id = await stack.agent("held", "--delay", "power.setPower=60000")
    _node_id, wf_id = await stack.start([{"use": "test.power", "on": "site"}])
    await stack.why_says(wf_id, "command power.setPower", "running since 20")
    await stack.engine.abort_workflow(id=wf_id)
    out = await stack.why_says(
        wf_id, "aborted", "command power.setPower", "cancelling since 20", f"agent {agent_id} has not yet"
    )
    assert "no try reported" in out  # the simulated agent's handler makes no BMC call


async def test_a_step_not_ready_says_its_own_reason_and_its_deadline(stack: Stack) -> None:
    reason = "waiting for rack r12's top-of-rack switch"
    _node, wf_id = await stack.start(
        [{"use": "test.waitFlag", "with": {"flag": "r12", "reason": reason}}], node=False
    )
    out = await stack.why_says(wf_id, f"the step says: {reason}")
    # the step's timeout is 1h: its deadline is at most an hour away (60m00s when why is read
    # within the second the step started, as a quiet CI machine does)
    assert re.search(r"deadline in (59m\d\ds|60m00s) \(20\d\d-\d\d-\d\dT\d\d:\d\d:\d\dZ\)", out), out
    view = await stack.engine.get_workflow(id=wf_id)
    assert view.steps[0].waiting_for == {"reason": "step-not-ready", "message": reason}


async def test_the_nodes_last_bmc_error_is_named(stack: Stack) -> None:
    await stack.agent("failing", "--fail", "power.setPower")
    node_id, failed = await stack.start([{"use": "test.power", "on": "site"}])
    assert node_id is not None
    assert (await wait_workflow(stack.engine, failed, timeout=30)).state == "failed"
    out = await stack.why_says(node_id, f"workflow {failed} failed: DRIVER_ERROR")
    assert "the node's last BMC error: power.setPower failed at 20" in out
    # a later workflow of the node that waits still names it
    wait = {"use": "test.waitFlag", "with": {"flag": "never", "reason": "waiting for a person"}}
    doc = {"id": "why-wait", "version": 1, "target": "metal", "role": "host", "steps": [wait]}
    await stack.engine.create_profile(document=doc)
    wf = await stack.engine.start_workflow(profile_id="why-wait", node_id=node_id)
    out = await stack.why_says(node_id, "the step says: waiting for a person", "the node's last BMC error")
    assert wf.id in out


@pytest_asyncio.fixture(loop_scope="session")
async def quorum_stack(
    bc_settings: Settings, bc_processes: ServiceProcesses, bc_api: ApiClient, tmp_path: Path
) -> AsyncIterator[tuple[Stack, Any]]:
    keys = approver_keys(("alice", "bob", "carol"))
    write_approvers(tmp_path / "approvers.toml", keys)
    env = {"BC_CMDQ_QUORUM_FILE": str(tmp_path / "approvers.toml")}
    async for made in _stack(bc_settings, bc_processes, bc_api, tmp_path, **env):
        yield made, keys


async def test_a_batch_awaiting_approvals_names_how_many_and_from_whom(
    quorum_stack: tuple[Stack, Any],
) -> None:
    stack, keys = quorum_stack
    await stack.agent("agent")
    _node, wf_id = await stack.start(
        [{"use": "netboot.clearEntry", "on": "site", "with": {"mac": "52:54:00:00:00:01"}}]
    )
    out = await stack.why_says(wf_id, "awaiting approvals (have 0 of 2)")
    batch_id = (await stack.engine.get_workflow(id=wf_id)).batch_id
    assert f"batch {batch_id}" in out
    assert "not yet signed by alice, bob, carol" in out
    batch = await stack.cq.get_batch(id=batch_id)
    await stack.cq.approve_batch(
        batch_id=batch_id, approver_id="bob", signature=sign_batch(batch, keys["bob"])
    )
    out = await stack.why_says(wf_id, "(have 1 of 2: bob)", "not yet signed by alice, carol")
