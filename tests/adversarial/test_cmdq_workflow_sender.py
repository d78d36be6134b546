"""Issue 22 gap 6: only the engine may enqueue commands under a workflow, so a workflow's
approved batch admits nothing another client sends naming that workflow.

What proves the engine: in a deployment, nats-server (a request that came through an import,
from the operators' or a site's account, carries the ``Nats-Request-Info`` header the server
writes); in a stack without NATS accounts (``bcx dev up``, this test), the key both the engine
and the command queue read from ``cmdq.engine_key_file``. bc-pki and bc-command-queue run as
their own processes; executions are counted at the node's agent (its exec log).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest_asyncio
from cryptography.hazmat.primitives.asymmetric import ed25519

from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.pki import PkiClient
from better_compute.config import Settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id
from better_compute.crypto import sign_batch
from better_compute.keyring import Keyring
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, until
from better_compute.testing.agents import SimAgent, start_sim_agent
from better_compute.testing.approvers import approver_keys, write_approvers
from better_compute.wire import unwrap
from better_compute.wire.cmdq import TERMINAL_STATES, BatchView, EnqueueCommand, engine_proof

TRIES = 5


@dataclass
class Site:
    api: ApiClient
    cq: CommandQueueClient
    engine_key: Keyring
    keys: dict[str, ed25519.Ed25519PrivateKey]
    agent: SimAgent
    node: str

    async def approved(self, batch: BatchView) -> BatchView:
        for name in ("alice", "bob"):
            batch = await self.cq.approve_batch(
                batch_id=batch.id, approver_id=name, signature=sign_batch(batch, self.keys[name])
            )
        assert batch.state == "approved"
        return batch


@pytest_asyncio.fixture(loop_scope="session")
async def site(
    bc_settings: Settings,
    bc_api: ApiClient,
    bc_processes: ServiceProcesses,
    tmp_path: Path,
    sims: list[SimAgent],
) -> AsyncIterator[Site]:
    keys = approver_keys(("alice", "bob", "carol"))
    write_approvers(tmp_path / "approvers.toml", keys)
    key_file = tmp_path / "keys" / "engine-commands.key"
    engine_key, _ = Keyring.load_or_create(key_file)  # what bcx dev up makes for its stack
    bc_processes.extra_env.update(
        BC_CMDQ_QUORUM_FILE=str(tmp_path / "approvers.toml"), BC_CMDQ_ENGINE_KEY_FILE=str(key_file),
        BC_CMDQ_HEARTBEAT="200ms",
    )  # fmt: skip
    bc_processes.start("bc-pki")
    bc_processes.start("bc-command-queue")
    await bc_processes.wait_ready()
    cq = CommandQueueClient(bc_api, timeout=5.0)
    node = new_id("node")
    sim, agent_id = await start_sim_agent(
        bc_settings,
        tmp_path / node,
        site_id="site-w",
        pki=PkiClient(bc_api),
        cq=cq,
        role="node",
        node_id=node,
    )
    sims.append(sim)
    assert agent_id == node
    yield Site(api=bc_api, cq=cq, engine_key=engine_key, keys=keys, agent=sim, node=node)


def wipe(node: str, key: str, **over: object) -> EnqueueCommand:
    return EnqueueCommand(
        **{"node_id": node, "site_id": "site-w", "kind": "node.wipe", "key": key, "target": "node", **over}  # type: ignore[arg-type]
    )


async def test_a_workflows_batch_admits_no_command_another_client_sends_for_it(site: Site) -> None:
    cq, node = site.cq, site.node
    wf = new_id("wf")
    batch = await site.approved(await cq.create_batch(kinds=["node.wipe"], nodes=[node], workflow_id=wf))
    not_the_engine = (ErrorCode.PERMISSION_DENIED, "workflowId", "not-the-engine")
    enqueued = []
    refusals: list[tuple[object, ...]] = []
    for i in range(TRIES):
        # an operator's (or any client's) command naming the workflow, under its approved batch
        cmd = wipe(node, f"wf:{wf}:0#1:x{i}", batch_id=batch.id, workflow_id=wf, step=0)
        try:
            enqueued.append(await cq.enqueue(cmd))
        except BcError as err:
            refusals.append((err.code, err.path, err.reason))
    # the same as nats-server delivers it from the operators' account in a deployment: the
    # header the server writes on a request that crossed an import, whatever it carries
    stamped = {"Nats-Request-Info": '{"acc":"OPS","user":"mallory","kind":"Client"}'}
    proven = _with_proof(site, wipe(node, f"wf:{wf}:0#1:stamped", batch_id=batch.id, workflow_id=wf, step=0))
    reply = await site.api.nc.request(
        site.api.subjects.api("command-queue", "commands", "enqueue"),
        json.dumps(_camel(proven)).encode(),
        headers=stamped,
        timeout=5,
    )
    answer = json.loads(reply.data)
    if "error" not in answer:
        enqueued.append(unwrap(reply.data))
    # a proof seen on the bus, sent again later (after retention removed its command), or made
    # for another request, proves nothing
    stale = engine_proof(
        wipe(node, f"wf:{wf}:0#1:old", batch_id=batch.id, workflow_id=wf, step=0),
        site.engine_key,
        at_ms=time.time_ns() // 1_000_000 - 600_000,
    )
    borrowed = msgspec.structs.replace(
        _with_proof(site, wipe(node, f"wf:{wf}:0#1:a", batch_id=batch.id, workflow_id=wf, step=0)),
        key=f"wf:{wf}:0#1:b",
    )
    for cmd in (stale, borrowed):
        try:
            enqueued.append(await cq.enqueue(cmd))
        except BcError as err:
            refusals.append((err.code, err.path, err.reason))
    # the engine's own command (its proof from the stack's key) goes through and runs, once
    mine = await cq.enqueue(
        _with_proof(site, wipe(node, f"wf:{wf}:0#1", batch_id=batch.id, workflow_id=wf, step=0))
    )

    async def settled() -> bool:
        return (await cq.get(id=mine.id)).state in TERMINAL_STATES

    await until(settled)
    assert (await cq.get(id=mine.id)).state == "succeeded"
    ran = [line for line in site.agent.executions() if line.split()[0] != mine.id]
    assert (len(enqueued), ran) == (0, []), f"{len(ran)} of {TRIES + 3} commands from another sender ran"
    assert site.agent.executions() == [f"{mine.id} node.wipe"]
    assert refusals == [not_the_engine] * (TRIES + 2)
    # an operator's own command, under no workflow and its own batch, is theirs to send
    own = await site.approved(await cq.create_batch(kinds=["node.wipe"], nodes=[node]))
    by_hand = await cq.enqueue(wipe(node, "by-hand", batch_id=own.id))
    assert by_hand.workflow_id is None


def _with_proof(site: Site, cmd: EnqueueCommand) -> EnqueueCommand:
    return engine_proof(cmd, site.engine_key)


def _camel(cmd: EnqueueCommand) -> dict[str, object]:
    doc: dict[str, object] = msgspec.json.decode(msgspec.json.encode(cmd))
    return doc
