"""A workflow that sends destructive commands under the quorum: its batch, its approvals."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest_asyncio
from cryptography.hazmat.primitives.asymmetric import ed25519

from better_compute.clients import EngineClient
from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.pki import PkiClient
from better_compute.config import Settings
from better_compute.crypto import sign_batch
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, until
from better_compute.testing.agents import SimAgent, start_sim_agent
from better_compute.testing.approvers import approver_keys, write_approvers
from better_compute.testing.workflows import wait_workflow
from engine_stack import sim_bmc

APPROVERS = ("alice", "bob", "carol")


@pytest_asyncio.fixture(loop_scope="session")
async def keys(
    bc_settings: Settings, bc_processes: ServiceProcesses, tmp_path: Path
) -> AsyncIterator[dict[str, ed25519.Ed25519PrivateKey]]:
    made = approver_keys(APPROVERS)
    write_approvers(tmp_path / "approvers.toml", made)
    bc_processes.settings = msgspec.structs.replace(bc_settings, app="engine_test_app:app")
    bc_processes.extra_env.update(
        BC_CMDQ_QUORUM_FILE=str(tmp_path / "approvers.toml"), BC_CMDQ_HEARTBEAT="200ms", BC_CMDQ_SWEEP="100ms"
    )
    for name in ("bc-pki", "bc-command-queue", "bc-engine"):
        bc_processes.start(name)
    await bc_processes.wait_ready()
    yield made


async def test_destructive_steps_wait_for_m_of_n_approvals_of_the_workflows_batch(
    keys: dict[str, ed25519.Ed25519PrivateKey],
    bc_api: ApiClient,
    bc_processes: ServiceProcesses,
    tmp_path: Path,
) -> None:
    engine_api = EngineClient(bc_api)
    cq = CommandQueueClient(bc_api)
    sim: SimAgent
    sim, _agent = await start_sim_agent(
        bc_processes.settings, tmp_path / "agent", site_id="lab1", pki=PkiClient(bc_api), cq=cq
    )
    try:
        node = await engine_api.create_node(site_id="lab1", bmc=sim_bmc())
        doc = {"id": "wipe-ish", "version": 1, "target": "metal", "role": "host",
               "steps": [{"use": "test.power", "on": "site"},
                         {"use": "netboot.clearEntry", "on": "site",
                          "with": {"mac": "52:54:00:00:00:01"}}]}  # fmt: skip
        await engine_api.create_profile(document=doc)
        wf = await engine_api.start_workflow(profile_id="wipe-ish", node_id=node.id)

        async def batch_id() -> str | None:
            view = await engine_api.get_workflow(id=wf.id)
            return view.batch_id  # type: ignore[no-any-return]

        batch = await cq.get_batch(id=await until(batch_id))
        # the scope was fixed from what the workflow can send, before it sent anything destructive
        assert (batch.kinds, batch.nodes, batch.workflow_id) == (["driver.invoke"], [node.id], wf.id)

        async def destructive_command() -> object:
            listed = (await cq.list_commands(workflow_id=wf.id, kind="driver.invoke")).commands
            return listed[0] if listed else None

        cmd = await until(destructive_command)
        assert cmd.batch_id == batch.id  # type: ignore[attr-defined]
        # the non-destructive step ran and carries no batch; the destructive one waits
        [power] = (await cq.list_commands(workflow_id=wf.id, kind="power.setPower")).commands
        assert (power.state, power.batch_id) == ("succeeded", None)
        await cq.approve_batch(
            batch_id=batch.id, approver_id="alice", signature=sign_batch(batch, keys["alice"])
        )
        assert (await cq.get(id=cmd.id)).state == "pending"  # type: ignore[attr-defined]
        assert (await engine_api.get_workflow(id=wf.id)).state == "running"

        await cq.approve_batch(batch_id=batch.id, approver_id="bob", signature=sign_batch(batch, keys["bob"]))
        done = await wait_workflow(bc_api, wf.id, timeout=60)
        assert done.state == "succeeded", done
        assert done.steps[1].result["result"]["kind"] == "driver.invoke"
        assert len(sim.executions()) == 2
    finally:
        sim.close()
