"""Destructive-command batches, the approvers' quorum and the sweeper's deadlines, on the in-memory
store with its clock moved by hand. (On PostgreSQL and the bus: tests/integration/
test_cmdq_quorum.py, test_cmdq_commands.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

from bc_command_queue.config import Quorum
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id
from better_compute.wire.cmdq import ApproveBatch, BatchIdRequest, BatchView, CloseBatch, CreateBatch
from cmdq_kit import Queue, ack, approvers, command, queue, request


async def create(q: Queue, nodes: list[str], *, ttl: int = 3600, key: str | None = None) -> BatchView:
    body = CreateBatch(kinds=["node.wipe"], nodes=nodes, ttl_seconds=ttl, idempotency_key=key)
    return await q.batches.create(request(body))


async def approve(q: Queue, batch: BatchView, name: str, key: ed25519.Ed25519PrivateKey) -> BatchView:
    body = ApproveBatch(batch_id=batch.id, approver_id=name, signature=key.sign(batch.document))
    return await q.batches.approve(request(body))


async def refused(coro: object) -> BcError:
    with pytest.raises(BcError) as caught:
        await coro  # type: ignore[misc]
    return caught.value


async def test_a_batch_opens_is_approved_at_the_threshold_and_then_dispatches_its_commands(
    tmp_path: Path,
) -> None:
    quorum, keys = approvers(tmp_path, threshold=2)
    q = queue(quorum=quorum)
    node = new_id("node")
    batch = await create(q, [node])
    assert (batch.state, batch.threshold, batch.approvals) == ("open", 2, [])
    # a wipe under the batch waits for the quorum: enqueued pending, not dispatched by a sweep
    wipe = await command(q, kind="node.wipe", node=node, batch_id=batch.id, may_dispatch=False)
    await q.sweeper.sweep()
    assert (await q.store.command_by_id(wipe.id)).state == "pending"  # type: ignore[union-attr]
    once = await approve(q, batch, "alice", keys["alice"])
    assert (once.state, [a.counted for a in once.approvals]) == ("open", [True])
    twice = await approve(q, batch, "alice", keys["alice"])  # the same approver counts once
    assert (twice.state, len(twice.approvals)) == ("open", 1)
    done = await approve(q, batch, "bob", keys["bob"])
    assert done.state == "approved"
    assert [r.id for r in q.deliveries.sent] == [wipe.id]
    assert [(e.state, e.approvals) for e in q.batch_events] == [("open", 0), ("open", 1), ("approved", 2)]
    claimed = await q.claims.ack(ack(q.deliveries.sent[0]))
    assert claimed.proceed


async def test_an_approval_is_refused_for_a_wrong_signature_an_unknown_approver_or_without_a_quorum(
    tmp_path: Path,
) -> None:
    quorum, keys = approvers(tmp_path)
    q = queue(quorum=quorum)
    batch = await create(q, [new_id("node")])
    forged = ApproveBatch(batch_id=batch.id, approver_id="alice", signature=keys["bob"].sign(batch.document))
    assert (await refused(q.batches.approve(request(forged)))).code is ErrorCode.UNAUTHENTICATED
    stranger = ed25519.Ed25519PrivateKey.generate()
    err = await refused(approve(q, batch, "mallory", stranger))
    assert (err.code, err.details["reason"]) == (ErrorCode.PERMISSION_DENIED, "unknown-approver")
    assert (await q.batches.get(request(BatchIdRequest(id=batch.id)))).approvals == []
    off = queue()
    open_batch = await create(off, [new_id("node")])
    err = await refused(approve(off, open_batch, "alice", keys["alice"]))
    assert (err.code, err.details["reason"]) == (ErrorCode.INVALID_STATE, "quorum-off")


async def test_a_closed_batch_takes_no_approval_keeps_its_first_reason_and_reopens_as_it_was(
    tmp_path: Path,
) -> None:
    quorum, keys = approvers(tmp_path)
    q = queue(quorum=quorum)
    batch = await create(q, [new_id("node")])
    await approve(q, batch, "alice", keys["alice"])
    closed = await q.batches.close(request(CloseBatch(id=batch.id, reason="workflow failed")))
    assert (closed.state, closed.closed_reason) == ("closed", "workflow failed")
    again = await q.batches.close(request(CloseBatch(id=batch.id, reason="aborted")))
    assert again.closed_reason == "workflow failed"
    err = await refused(approve(q, batch, "bob", keys["bob"]))
    assert (err.code, err.details["reason"]) == (ErrorCode.INVALID_STATE, "batch-closed")
    reopened = await q.batches.reopen(request(BatchIdRequest(id=batch.id)))
    assert (reopened.state, reopened.closed_reason, len(reopened.approvals)) == ("open", None, 1)
    assert (await approve(q, batch, "bob", keys["bob"])).state == "approved"


async def test_the_same_idempotency_key_returns_the_first_batch_and_another_scope_is_a_conflict() -> None:
    q = queue()
    node = new_id("node")
    first = await create(q, [node], key="job-1")
    assert first.created
    same = await create(q, [node], key="job-1")
    assert (same.id, same.created) == (first.id, False)
    err = await refused(create(q, [new_id("node")], key="job-1"))
    assert (err.code, err.details["path"]) == (ErrorCode.CONFLICT, "idempotencyKey")


async def test_an_expired_batch_is_published_once_refuses_approvals_and_its_commands_never_run(
    tmp_path: Path,
) -> None:
    quorum, keys = approvers(tmp_path, threshold=1)
    q = queue(quorum=quorum)
    node = new_id("node")
    batch = await create(q, [node], ttl=60)
    await command(q, kind="node.wipe", node=node, batch_id=batch.id, may_dispatch=False, timeout_s=600)
    await approve(q, batch, "alice", keys["alice"])
    [wipe] = q.deliveries.sent  # dispatched once approved, not claimed before the batch ran out
    q.store.advance(61)
    assert (await q.batches.get(request(BatchIdRequest(id=batch.id)))).state == "expired"
    err = await refused(approve(q, batch, "bob", keys["bob"]))
    assert (err.code, err.details["reason"]) == (ErrorCode.INVALID_STATE, "batch-expired")
    # its claim is refused for good: the command expires with its batch
    reply = await q.claims.ack(ack(wipe))
    assert (reply.proceed, reply.state, reply.reason, reply.again) == (
        False,
        "expired",
        "batch-expired",
        False,
    )
    events = len(q.batch_events)
    assert await q.batches.publish_expiries() == 1
    assert await q.batches.publish_expiries() == 0
    assert [e.state for e in q.batch_events[events:]] == ["expired"]


async def test_a_claim_of_a_batch_no_longer_approved_sends_the_command_back_until_approved_again(
    tmp_path: Path,
) -> None:
    quorum, keys = approvers(tmp_path, threshold=1)
    q = queue(quorum=quorum)
    node = new_id("node")
    batch = await create(q, [node])
    wipe = await command(q, kind="node.wipe", node=node, batch_id=batch.id, may_dispatch=False)
    await approve(q, batch, "alice", keys["alice"])
    [sent] = q.deliveries.sent
    # the approver is withdrawn from the configuration and the service restarts: counted again
    q.config = q.batches.config = q.claims.config = q.sweeper.config = q.config.with_quorum(
        Quorum(threshold=1, approvers={"bob": quorum.approvers["bob"]})
    )
    await q.batches.recount_all()
    assert (await q.store.command_by_id(wipe.id)).state == "pending"  # type: ignore[union-attr]
    assert q.states()[-1] == (wipe.id, "pending", "batch-not-approved")
    reply = await q.claims.ack(ack(sent))
    assert (reply.proceed, reply.state, reply.again) == (False, "pending", True)
    await approve(q, batch, "bob", keys["bob"])
    assert [r.id for r in q.deliveries.sent] == [wipe.id, wipe.id]


async def test_without_a_batch_a_destructive_command_is_claimed_only_with_the_quorum_off(
    tmp_path: Path,
) -> None:
    quorum, _keys = approvers(tmp_path)
    on = queue(quorum=quorum)
    wipe = await command(on, kind="node.wipe")
    reply = await on.claims.ack(ack(wipe))
    assert (reply.proceed, reply.state, reply.reason) == (False, "pending", "batch-not-approved")
    off = queue()
    assert (await off.claims.ack(ack(await command(off, kind="node.wipe")))).proceed


@pytest.mark.parametrize(
    ("claimed", "reason"),
    [(None, "not-claimed"), ("acked", "not-finished"), ("running", "not-finished")],
)
async def test_the_sweep_expires_live_commands_at_their_deadline_and_says_how_far_they_got(
    claimed: str | None, reason: str
) -> None:
    q = queue()
    row = await command(q, timeout_s=30)
    if claimed is not None:
        assert (await q.claims.ack(ack(row))).proceed
    if claimed == "running":
        await q.store.progress(row.id, row.agent_id or "", "half")
    q.store.advance(29)
    await q.sweeper.sweep()
    assert (await q.store.command_by_id(row.id)).state != "expired"  # type: ignore[union-attr]
    q.store.advance(2)
    await q.sweeper.sweep()
    assert q.states()[-1] == (row.id, "expired", reason)


async def test_a_pending_destructive_command_expires_as_quorum_not_reached(tmp_path: Path) -> None:
    quorum, _keys = approvers(tmp_path)
    q = queue(quorum=quorum)
    node = new_id("node")
    batch = await create(q, [node], ttl=3600)
    wipe = await command(q, kind="node.wipe", node=node, batch_id=batch.id, may_dispatch=False, timeout_s=60)
    q.store.advance(61)
    await q.sweeper.sweep()
    assert q.states() == [(wipe.id, "expired", "quorum-not-reached")]


async def test_a_silent_site_agents_unclaimed_commands_go_to_another_and_a_lost_ones_claimed_fail() -> None:
    q = queue(silent_after_ms=15_000, lost_after_ms=120_000)
    q.store.agent_seen("agent-a", site_id="site-a")
    todo = await command(q, target="site", timeout_s=3600)
    claimed = await command(q, target="site", timeout_s=3600)
    assert (todo.agent_id, claimed.agent_id) == ("agent-a", "agent-a")
    assert (await q.claims.ack(ack(claimed))).proceed
    await q.sweeper.sweep()  # starts hearing agents
    q.store.advance(16)
    q.store.agent_seen("agent-b", site_id="site-a")
    await q.sweeper.sweep()
    moved = await q.store.command_by_id(todo.id)
    assert moved is not None
    assert (moved.state, moved.agent_id) == ("dispatched", "agent-b")
    assert (todo.id, "pending", "agent-silent") in q.states()
    assert (await q.store.command_by_id(claimed.id)).state == "acked"  # type: ignore[union-attr]
    # agent-a's silence counts while its site is heard (agent-b, since t=16): lost_after later
    q.store.advance(121)
    q.store.agent_seen("agent-b", site_id="site-a", hello=False)
    await q.sweeper.sweep()
    assert q.states()[-1] == (claimed.id, "failed", "agent-lost")


async def test_a_site_silent_as_a_whole_is_unreachable_not_lost() -> None:
    # its leaf's link to the hub cut: every agent of the site falls silent at once, and the
    # commands they claimed wait for them, however long (their journals say what ran)
    q = queue(silent_after_ms=15_000, lost_after_ms=120_000)
    q.store.agent_seen("agent-a", site_id="site-a")
    q.store.agent_seen("node-1", site_id="site-a", role="node")
    claimed = await command(q, target="site", timeout_s=3600)
    assert (await q.claims.ack(ack(claimed))).proceed
    await q.sweeper.sweep()
    q.store.advance(600)
    await q.sweeper.sweep()
    assert (await q.store.command_by_id(claimed.id)).state == "acked"  # type: ignore[union-attr]
    # the link back: node-1 says hello first; agent-a's silence counts from then
    q.store.agent_seen("node-1", site_id="site-a", role="node")
    q.store.advance(60)
    q.store.agent_seen("node-1", site_id="site-a", role="node", hello=False)
    await q.sweeper.sweep()
    assert (await q.store.command_by_id(claimed.id)).state == "acked"  # type: ignore[union-attr]
    q.store.advance(61)
    q.store.agent_seen("node-1", site_id="site-a", role="node", hello=False)
    await q.sweeper.sweep()
    assert q.states()[-1] == (claimed.id, "failed", "agent-lost")


async def test_an_agent_is_not_silent_while_the_queue_itself_could_not_hear_it() -> None:
    q = queue(silent_after_ms=15_000)
    q.store.agent_seen("agent-a", site_id="site-a")
    todo = await command(q, target="site", timeout_s=3600)
    q.connected = False  # our own NATS outage
    q.store.advance(60)
    await q.sweeper.sweep()
    q.connected = True
    await q.sweeper.sweep()
    assert (await q.store.command_by_id(todo.id)).state == "dispatched"  # type: ignore[union-attr]
