"""Destructive commands run only inside an approved, unexpired batch of their own workflow.

bc-pki, bc-command-queue and the node's agent each run as their own process; executions are
counted at the agent (its exec log), not from the queue's view. The sweeper is slowed down to
a minute so that what keeps a command from running is the claim and the start-up recount,
not the periodic pass.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest_asyncio
from cryptography.hazmat.primitives.asymmetric import ed25519

from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.pki import PkiClient
from better_compute.config import Settings
from better_compute.core.errors import ErrorCode
from better_compute.core.ids import new_id
from better_compute.crypto import sign_batch
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcess, ServiceProcesses, refused, until
from better_compute.testing.agents import SimAgent, start_sim_agent
from better_compute.testing.approvers import approver_keys, write_approvers
from better_compute.wire.cmdq import TERMINAL_STATES, BatchView, CommandView, EnqueueCommand

APPROVERS = ("alice", "bob", "carol")
COMMANDS = 12


@dataclass
class Site:
    api: ApiClient
    cq: CommandQueueClient
    pki: PkiClient
    procs: ServiceProcesses
    cmdq: ServiceProcess
    settings: Settings
    keys: dict[str, ed25519.Ed25519PrivateKey]
    approvers: Path
    tmp: Path
    sims: list[SimAgent]

    async def approve(self, batch: BatchView, *names: str) -> BatchView:
        for name in names:
            batch = await self.cq.approve_batch(
                batch_id=batch.id, approver_id=name, signature=sign_batch(batch, self.keys[name])
            )
        return batch

    async def node_agent(self, node: str) -> SimAgent:
        sim, agent_id = await start_sim_agent(
            self.settings, self.tmp / node, site_id="site-b", pki=self.pki, cq=self.cq, role="node",
            node_id=node,
        )  # fmt: skip
        assert agent_id == node
        self.sims.append(sim)
        return sim

    async def restart_cmdq(self) -> None:
        """Stop the command queue (SIGKILL) and start it again: it reads the approvers file anew."""
        self.cmdq.kill()
        self.cmdq = self.procs.start("bc-command-queue")
        await self.procs.wait_ready()


def wipe(node: str, key: str, **over: Any) -> EnqueueCommand:
    return EnqueueCommand(
        **{"node_id": node, "site_id": "site-b", "kind": "node.wipe", "key": key, "target": "node", **over}
    )


@pytest_asyncio.fixture(loop_scope="session")
async def site(
    bc_settings: Settings,
    bc_api: ApiClient,
    bc_processes: ServiceProcesses,
    tmp_path: Path,
    sims: list[SimAgent],
) -> AsyncIterator[Site]:
    keys = approver_keys(APPROVERS)
    approvers = tmp_path / "approvers.toml"
    write_approvers(approvers, keys)
    bc_processes.extra_env.update(
        BC_CMDQ_QUORUM_FILE=str(approvers), BC_CMDQ_HEARTBEAT="200ms", BC_CMDQ_SWEEP="60000ms"
    )
    bc_processes.start("bc-pki")
    cmdq = bc_processes.start("bc-command-queue")
    await bc_processes.wait_ready()
    yield Site(
        api=bc_api, cq=CommandQueueClient(bc_api, timeout=3.0), pki=PkiClient(bc_api), procs=bc_processes,
        cmdq=cmdq, settings=bc_settings, keys=keys, approvers=approvers, tmp=tmp_path, sims=sims,
    )  # fmt: skip


async def expire_now(settings: Settings, batch_id: str) -> None:
    """The batch's time is up: its expiry moves to now, as if its 24 hours had passed (the
    signed document keeps the original expiry; the queue goes by the row)."""
    conn = await asyncpg.connect(settings.database_url)
    try:
        await conn.execute("UPDATE cmdq.batches SET expires_at = now() WHERE id = $1", batch_id)
    finally:
        await conn.close()


async def all_settled(cq: CommandQueueClient, views: list[CommandView]) -> list[CommandView] | None:
    now = [await cq.get(id=v.id) for v in views]
    return now if all(v.state in TERMINAL_STATES for v in now) else None


async def test_commands_of_a_batch_that_expired_after_dispatch_never_run(
    site: Site, bc_settings: Settings
) -> None:
    cq, node = site.cq, new_id("node")
    batch = await cq.create_batch(kinds=["node.wipe"], nodes=[node])
    wipes = [await cq.enqueue(wipe(node, f"w{i}", batch_id=batch.id)) for i in range(COMMANDS)]
    await site.approve(batch, "alice", "bob")
    assert {(await cq.get(id=w.id)).state for w in wipes} == {"dispatched"}
    # the node's agent is away; meanwhile the batch's 24 hours pass
    await expire_now(bc_settings, batch.id)
    assert (await cq.get_batch(id=batch.id)).state == "expired"
    sim = await site.node_agent(node)  # it finds every delivery in its stream and claims each

    async def settled_or_ran() -> list[CommandView] | None:
        return await all_settled(cq, wipes) or ([] if sim.executions() else None)

    settled = await until(settled_or_ran)
    assert sim.executions() == []
    assert {(v.state, v.reason) for v in settled} == {("expired", "batch-expired")}


async def test_the_sweeper_expires_unclaimed_commands_of_an_expired_batch(
    site: Site, bc_settings: Settings
) -> None:
    cq, node = site.cq, new_id("node")
    batch = await cq.create_batch(kinds=["node.wipe"], nodes=[node])
    wipes = [await cq.enqueue(wipe(node, f"w{i}", batch_id=batch.id)) for i in range(COMMANDS)]
    await site.approve(batch, "alice", "bob")
    await expire_now(bc_settings, batch.id)
    site.procs.extra_env["BC_CMDQ_SWEEP"] = "100ms"
    await site.restart_cmdq()
    try:  # a few sweeps are plenty
        settled = await asyncio.wait_for(until(lambda: all_settled(cq, wipes)), 10)
    except TimeoutError:
        settled = [await cq.get(id=w.id) for w in wipes]
    assert {(v.state, v.reason) for v in settled} == {("expired", "batch-expired")}
    # the agent comes back to deliveries of commands that are over
    sim = await site.node_agent(node)
    await until(lambda: sim.output().count('"command_not_claimed"') >= COMMANDS or sim.executions())
    assert sim.executions() == []


async def test_commands_dispatched_before_an_approver_was_withdrawn_never_run_until_approved_again(
    site: Site,
) -> None:
    cq, node = site.cq, new_id("node")
    batch = await cq.create_batch(kinds=["node.wipe"], nodes=[node])
    wipes = [await cq.enqueue(wipe(node, f"w{i}", batch_id=batch.id)) for i in range(COMMANDS)]
    await site.approve(batch, "alice", "bob")
    assert {(await cq.get(id=w.id)).state for w in wipes} == {"dispatched"}
    # bob leaves: the approvers file loses him and the command queue restarts
    write_approvers(site.approvers, {k: v for k, v in site.keys.items() if k != "bob"})
    await site.restart_cmdq()
    assert (await cq.get_batch(id=batch.id)).state == "open"
    assert {((v := await cq.get(id=w.id)).state, v.reason) for w in wipes} == {
        ("pending", "batch-not-approved")
    }
    # the node's agent comes: its stream still holds every delivery, and it claims each
    sim = await site.node_agent(node)

    def refused_or_ran() -> bool:
        return sim.output().count('"command_not_claimed"') >= COMMANDS or bool(sim.executions())

    await until(refused_or_ran)
    assert sim.executions() == []
    assert {(await cq.get(id=w.id)).state for w in wipes} == {"pending"}
    # carol signs: the batch is approved again under the approvers configured now, and each
    # wipe runs, once
    assert (await site.approve(batch, "carol")).state == "approved"
    settled = await until(lambda: all_settled(cq, wipes))
    assert {v.state for v in settled} == {"succeeded"}
    assert sorted(sim.executions()) == sorted(f"{w.id} node.wipe" for w in wipes)


async def test_a_batch_admits_only_commands_of_the_workflow_it_was_signed_for(site: Site) -> None:
    cq, node = site.cq, new_id("node")
    sim = await site.node_agent(node)
    wf = new_id("wf")
    signed_for_wf = await site.approve(
        await cq.create_batch(kinds=["node.wipe"], nodes=[node], workflow_id=wf), "alice", "bob"
    )
    operators = await site.approve(await cq.create_batch(kinds=["node.wipe"], nodes=[node]), "alice", "bob")
    # another workflow, or no workflow at all, under the workflow's batch; any workflow under
    # the operator's batch: each refused, however many are tried
    outside = (ErrorCode.INVALID_INPUT, "workflowId", "outside-batch-scope")
    for i in range(COMMANDS):
        for batch, workflow in ((signed_for_wf, new_id("wf")), (signed_for_wf, None), (operators, wf)):
            err = await refused(cq.enqueue(wipe(node, f"x{i}", batch_id=batch.id, workflow_id=workflow)))
            assert (err.code, err.path, err.reason) == outside
    # what each batch was signed for goes through and runs
    ok = [
        await cq.enqueue(wipe(node, "mine", batch_id=signed_for_wf.id, workflow_id=wf, step=0)),
        await cq.enqueue(wipe(node, "by-hand", batch_id=operators.id)),
    ]
    settled = await until(lambda: all_settled(cq, ok))
    assert {v.state for v in settled} == {"succeeded"}
    assert sorted(sim.executions()) == sorted(f"{v.id} node.wipe" for v in ok)
    assert [c.id for c in (await cq.list_commands(node_id=node)).commands] == sorted(
        (v.id for v in ok), reverse=True
    )
