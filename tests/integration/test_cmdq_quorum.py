"""The destructive-batch quorum: batches, approvals, refusals and dispatch once M signed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import pytest
import pytest_asyncio
from cryptography.hazmat.primitives.asymmetric import ed25519
from nats.aio.msg import Msg

from bc_command_queue.config import CmdqConfig, load_quorum
from bc_command_queue.service import CommandQueueService
from better_compute.agent import Agent
from better_compute.agent.sim import join_agent, sim_handlers
from better_compute.clients.cmdq import CommandQueueClient
from better_compute.config import Settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id
from better_compute.crypto import sign_batch
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, refused, until
from better_compute.testing.approvers import approver_keys, public_b64, write_approvers
from better_compute.wire.cmdq import BatchEvent, BatchView, EnqueueCommand

APPROVERS = ("alice", "bob", "carol")


@dataclass
class Quorum:
    cq: CommandQueueClient
    keys: dict[str, ed25519.Ed25519PrivateKey]
    node: str
    agent: Agent

    def wipe(self, **kw: Any) -> EnqueueCommand:
        args: dict[str, Any] = {
            "node_id": self.node,
            "site_id": "site-q",
            "kind": "node.wipe",
            "payload": {},
            "key": new_id("cmd"),
            "target": "node",
        }
        args.update(kw)
        return EnqueueCommand(**args)

    async def approve(self, batch: BatchView, name: str) -> BatchView:
        return await self.cq.approve_batch(
            batch_id=batch.id, approver_id=name, signature=sign_batch(batch, self.keys[name])
        )


@pytest_asyncio.fixture(loop_scope="session")
async def quorum(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> AsyncIterator[Quorum]:
    keys = approver_keys(APPROVERS)
    config = CmdqConfig(sweep_ms=100).with_quorum(
        load_quorum(write_approvers(tmp_path / "approvers.toml", keys))
    )
    bc_processes.start("bc-pki")
    await bc_processes.wait_ready()
    node = new_id("node")
    async with CommandQueueService(bc_settings, config=config) as svc:
        run = asyncio.create_task(svc.run())
        enrollment = await join_agent(bc_api, site_id="site-q", role="node", node_id=node)
        agent = Agent(
            enrollment=enrollment,
            handlers=sim_handlers(["node.wipe", "node.inventory", "node.imageWrite"]),
            journal=tmp_path / "journal.db",
            nc=bc_api.nc,
            subjects=bc_api.subjects,
        )
        await agent.start()
        agent_run = asyncio.create_task(agent.run())
        await asyncio.wait_for(agent.ready.wait(), 10)
        try:
            yield Quorum(cq=CommandQueueClient(bc_api), keys=keys, node=node, agent=agent)
        finally:
            await agent.stop()
            with contextlib.suppress(Exception):
                await agent_run
            svc.request_stop()
            await run


async def test_destructive_commands_need_a_batch_in_scope(quorum: Quorum) -> None:
    cq = quorum.cq
    err = await refused(cq.enqueue(quorum.wipe()))
    assert (err.code, err.reason) == (ErrorCode.INVALID_STATE, "batch-required")
    batch = await cq.create_batch(kinds=["node.imageWrite"], nodes=[quorum.node])
    err = await refused(cq.enqueue(quorum.wipe(batch_id=batch.id)))
    assert (err.code, err.path, err.reason) == (ErrorCode.INVALID_INPUT, "kind", "outside-batch-scope")
    wide = await cq.create_batch(kinds=["node.wipe"], nodes=[new_id("node")])
    err = await refused(cq.enqueue(quorum.wipe(batch_id=wide.id)))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "nodeId")
    err = await refused(cq.enqueue(quorum.wipe(batch_id=new_id("batch"))))
    assert (err.code, err.path) == (ErrorCode.NOT_FOUND, "batchId")
    # not destructive: no batch needed, and a batch id given anyway is not kept
    inventory = await cq.enqueue(quorum.wipe(kind="node.inventory", batch_id=batch.id))
    assert inventory.batch_id is None
    assert (await cq.wait(id=inventory.id, timeout=20)).state == "succeeded"
    # creating batches checks kinds and nodes
    err = await refused(cq.create_batch(kinds=["node.wipe", "acme.nope"], nodes=[quorum.node]))
    assert (err.code, err.path) == (ErrorCode.INVALID_CONFIG, "kinds[1]")
    err = await refused(cq.create_batch(kinds=["node.wipe"], nodes=["node-1"]))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "nodes[0]")


async def test_a_destructive_command_goes_out_only_once_m_approvers_signed(quorum: Quorum) -> None:
    cq = quorum.cq
    batch = await cq.create_batch(kinds=["node.wipe", "node.imageWrite"], nodes=[quorum.node], note="rebuild")
    assert (batch.state, batch.threshold, batch.approvals) == ("open", 2, [])
    wipe = await cq.enqueue(quorum.wipe(batch_id=batch.id))
    assert (wipe.state, wipe.batch_id, wipe.destructive) == ("pending", batch.id, True)
    once = await quorum.approve(batch, "alice")
    assert once.state == "open"
    assert [a.approver_id for a in once.approvals] == ["alice"]
    assert (await cq.get(id=wipe.id)).state == "pending"
    twice = await quorum.approve(batch, "carol")
    assert twice.state == "approved"
    done = await cq.wait(id=wipe.id, timeout=20)
    assert (done.state, done.attested) == ("succeeded", True)
    # later commands of an approved batch go out at once
    later = await cq.enqueue(quorum.wipe(batch_id=batch.id))
    assert later.state == "dispatched"
    assert (await cq.get_batch(id=batch.id)).state == "approved"
    assert [b.id for b in await cq.list_batches(state="approved")] == [batch.id]


async def test_without_m_approvals_the_command_expires(quorum: Quorum) -> None:
    cq = quorum.cq
    batch = await cq.create_batch(kinds=["node.wipe"], nodes=[quorum.node])
    await quorum.approve(batch, "bob")
    wipe = await cq.enqueue(quorum.wipe(batch_id=batch.id, timeout_ms=1_000))
    done = await cq.wait(id=wipe.id, timeout=20)
    assert (done.state, done.reason) == ("expired", "quorum-not-reached")
    assert quorum.agent.journal is not None
    assert quorum.agent.journal.get(wipe.id) is None  # never delivered


async def test_batches_are_idempotent_by_key_and_listed(quorum: Quorum) -> None:
    cq = quorum.cq
    wf = new_id("wf")
    first = await cq.create_batch(
        kinds=["node.wipe"], nodes=[quorum.node], workflow_id=wf, idempotency_key=f"wf:{wf}"
    )
    again = await cq.create_batch(
        kinds=["node.wipe"], nodes=[quorum.node], workflow_id=wf, idempotency_key=f"wf:{wf}"
    )
    assert first.created
    assert not again.created
    assert again.id == first.id
    err = await refused(
        cq.create_batch(
            kinds=["node.imageWrite"], nodes=[quorum.node], workflow_id=wf, idempotency_key=f"wf:{wf}"
        )
    )
    assert (err.code, err.path) == (ErrorCode.CONFLICT, "idempotencyKey")
    assert [b.id for b in await cq.list_batches(workflow_id=wf)] == [first.id]
    view = await cq.quorum()
    assert (view.enabled, view.threshold) == (True, 2)
    assert [a.id for a in view.approvers] == list(APPROVERS)


def test_a_bad_approvers_file_is_invalid_config_and_the_service_will_not_start(
    bc_settings: Settings, tmp_path: Path
) -> None:
    good = public_b64(ed25519.Ed25519PrivateKey.generate())
    other = public_b64(ed25519.Ed25519PrivateKey.generate())
    cases = {
        f'threshold = 2\n[[approvers]]\nid = "a"\npublicKey = "{good}"\n': "cmdq.quorum.threshold",
        f'threshold = 0\n[[approvers]]\nid = "a"\npublicKey = "{good}"\n': "cmdq.quorum.threshold",
        'threshold = 1\n[[approvers]]\nid = "a"\npublicKey = "bm9wZQ=="\n': (
            "cmdq.quorum.approvers[0].publicKey"
        ),
        "threshold = 1\napprovers = []\n": "cmdq.quorum.approvers",
        f'threshold = 1\n[[approvers]]\nid = "a"\npublicKey = "{good}"\n'
        f'[[approvers]]\nid = "a"\npublicKey = "{other}"\n': "cmdq.quorum.approvers[1].id",
        f'threshold = 1\n[[approvers]]\nid = "a"\npublicKey = "{good}"\n'
        f'[[approvers]]\nid = "b"\npublicKey = "{good}"\n': "cmdq.quorum.approvers[1].publicKey",
        "threshold = [": "cmdq.quorum.file",
    }
    for text, path in cases.items():
        file = tmp_path / "approvers.toml"
        file.write_text(text)
        with pytest.raises(BcError) as info:
            load_quorum(file)
        assert (info.value.code, info.value.path) == (ErrorCode.INVALID_CONFIG, path), text
    with pytest.raises(BcError) as info:
        load_quorum(tmp_path / "missing.toml")
    assert info.value.path == "cmdq.quorum.file"
    env = {
        **os.environ,
        "BC_NATS_URL": bc_settings.nats_url or "",
        "BC_DATABASE_URL": bc_settings.database_url or "",
        "BC_CMDQ_QUORUM_FILE": str(tmp_path / "approvers.toml"),
    }
    out = subprocess.run(
        [sys.executable, "-m", "bc_command_queue"], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 1
    assert "INVALID_CONFIG" in out.stdout + out.stderr


async def test_listed_batches_show_each_its_own_approvals(quorum: Quorum) -> None:
    cq = quorum.cq
    wf = new_id("wf")
    batches = [
        await cq.create_batch(kinds=["node.wipe"], nodes=[quorum.node], workflow_id=wf) for _ in range(3)
    ]
    await quorum.approve(batches[0], "alice")
    await quorum.approve(batches[0], "bob")
    await quorum.approve(batches[2], "carol")
    listed = {b.id: b for b in await cq.list_batches(workflow_id=wf)}
    assert {ident: [a.approver_id for a in b.approvals] for ident, b in listed.items()} == {
        batches[0].id: ["alice", "bob"],
        batches[1].id: [],
        batches[2].id: ["carol"],
    }
    assert [listed[b.id].state for b in batches] == ["approved", "open", "open"]
    assert all(a.counted for b in listed.values() for a in b.approvals)


async def test_a_bulk_batch_admits_the_workflows_it_names_and_no_other(quorum: Quorum) -> None:
    cq = quorum.cq
    mine, theirs = sorted([new_id("wf"), new_id("wf")]), new_id("wf")
    err = await refused(
        cq.create_batch(kinds=["node.wipe"], nodes=[quorum.node], workflow_id=mine[0], workflow_ids=mine)
    )
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "workflowIds")
    batch = await cq.create_batch(kinds=["node.wipe"], nodes=[quorum.node], workflow_ids=mine)
    assert (batch.workflow_id, batch.workflow_ids) == (None, mine)
    assert b"workflowIds" in batch.document  # the set is in what the approvers sign
    await quorum.approve(batch, "alice")
    done = await quorum.approve(batch, "bob")
    assert done.state == "approved"
    for wf in mine:
        sent = await cq.enqueue(quorum.wipe(batch_id=batch.id, workflow_id=wf, step=0))
        assert sent.batch_id == batch.id
    for other in (theirs, None):
        err = await refused(cq.enqueue(quorum.wipe(batch_id=batch.id, workflow_id=other, step=0)))
        assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "workflowId")
        assert err.reason == "outside-batch-scope"
    # the same idempotency key with another set is another scope
    keyed = await cq.create_batch(
        kinds=["node.wipe"], nodes=[quorum.node], workflow_ids=mine, idempotency_key="k"
    )
    assert keyed.id != batch.id
    err = await refused(
        cq.create_batch(kinds=["node.wipe"], nodes=[quorum.node], workflow_ids=[theirs], idempotency_key="k")
    )
    assert err.code is ErrorCode.CONFLICT


async def test_a_batch_whose_time_ran_out_says_so_once_on_the_event_feed(
    quorum: Quorum, bc_api: ApiClient, bc_settings: Settings
) -> None:
    """A batch's expiry is an event like its creation and approvals (docs/events.md), published
    once by the sweeper, so an external consumer sees a batch's whole life."""
    cq = quorum.cq
    first = await cq.create_batch(kinds=["node.wipe"], nodes=[quorum.node])
    second = await cq.create_batch(kinds=["node.wipe"], nodes=[quorum.node])
    await quorum.approve(first, "bob")
    seen: list[BatchEvent] = []

    async def on_event(msg: Msg) -> None:
        event = msgspec.json.decode(msg.data, type=BatchEvent)
        if event.id in (first.id, second.id):
            seen.append(event)

    sub = await bc_api.nc.subscribe(bc_api.subjects.event("batch", "*"), cb=on_event)
    db = await asyncpg.connect(bc_settings.database_url)
    try:

        async def run_out(batch: BatchView) -> None:  # the TTL is a minute at least: its time passes
            await db.execute("UPDATE cmdq.batches SET expires_at = now() WHERE id = $1", batch.id)

        def expired(batch: BatchView) -> Callable[[], bool]:
            return lambda: any(e.id == batch.id and e.state == "expired" for e in seen)

        await run_out(first)
        await until(expired(first), timeout=10, what="the first batch's expiry on the feed")
        await run_out(second)
        # by the second one's event, the sweeper has passed the first again: it said it once
        await until(expired(second), timeout=10, what="the second batch's expiry on the feed")
        ended = [e for e in seen if e.id == first.id and e.state == "expired"]
        assert len(ended) == 1
        assert (ended[0].approvals, ended[0].threshold) == (1, 2)
        assert (await cq.get_batch(id=first.id)).state == "expired"
    finally:
        await sub.unsubscribe()
        await db.close()
