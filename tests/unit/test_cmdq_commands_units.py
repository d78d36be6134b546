"""The command queue's enqueue and cancel on the in-memory store: a key is one command, a cancel
under a step attempt's key prefix stops what it sent and a fence refuses what it sends late.
(On PostgreSQL and the bus: tests/integration/test_cmdq_commands.py, test_attempt_fences.py.)"""

from __future__ import annotations

import pytest

from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id
from better_compute.wire.cmdq import CancelCommands, CommandIdRequest, EnqueueCommand
from cmdq_kit import ack, queue, request


def enqueue(
    node: str, key: str, *, kind: str = "node.inventory", workflow_id: str | None = None
) -> EnqueueCommand:
    return EnqueueCommand(
        node_id=node, site_id="site-a", kind=kind, key=key, target="node", workflow_id=workflow_id
    )


async def test_a_node_command_goes_out_at_once_and_its_key_gives_the_same_command_again() -> None:
    q = queue()
    node = new_id("node")
    first = await q.commands.enqueue(request(enqueue(node, "inv-1")))
    assert (first.state, first.agent_id, first.created) == ("dispatched", node, True)
    assert [r.id for r in q.deliveries.sent] == [first.id]
    again = await q.commands.enqueue(request(enqueue(node, "inv-1")))
    assert (again.id, again.created) == (first.id, False)
    assert len(q.deliveries.sent) == 1
    with pytest.raises(BcError) as other_kind:
        await q.commands.enqueue(request(enqueue(node, "inv-1", kind="media.eject")))
    assert (other_kind.value.code, other_kind.value.details["path"]) == (ErrorCode.CONFLICT, "key")


async def test_a_cancel_under_a_superseded_attempt_stops_its_commands_and_the_fence_refuses_late_ones() -> (
    None
):
    q = queue()
    node, wf = new_id("node"), new_id("wf")
    attempt = f"wf:{wf}:3#1"
    idle = await q.commands.enqueue(request(enqueue(node, f"{attempt}:a", workflow_id=wf)))
    busy = await q.commands.enqueue(request(enqueue(node, f"{attempt}:b", workflow_id=wf)))
    next_attempt = await q.commands.enqueue(request(enqueue(node, f"wf:{wf}:3#12:a", workflow_id=wf)))
    q.store.agent_seen(node, site_id="site-a", role="node")
    [sent_busy] = [r for r in q.deliveries.sent if r.id == busy.id]
    assert (await q.claims.ack(ack(sent_busy, journal="ja"))).proceed
    reply = await q.commands.cancel(
        request(CancelCommands(key_prefix=attempt, workflow_id=wf, reason="superseded", fence=True))
    )
    assert sorted(reply.cancelled) == sorted([idle.id, busy.id])
    assert reply.running == [busy.id]  # claimed: it may still run at its agent
    assert [(r.agent_id, r.journal_id) for r in reply.running_at] == [(node, "ja")]
    states = {i: (await q.store.command_by_id(i)).state for i in (idle.id, busy.id, next_attempt.id)}  # type: ignore[union-attr]
    assert states == {idle.id: "cancelled", busy.id: "cancelling", next_attempt.id: "dispatched"}
    # what the superseded attempt sends late is made, cancelled at once, and refused
    with pytest.raises(BcError) as late:
        await q.commands.enqueue(request(enqueue(node, f"{attempt}:c", workflow_id=wf)))
    assert late.value.details["reason"] == "attempt-superseded"
    assert q.states()[-1][1:] == ("cancelled", "attempt-superseded")


async def test_a_cancel_of_an_unknown_command_is_not_found_and_of_a_finished_one_changes_nothing() -> None:
    q = queue()
    with pytest.raises(BcError) as unknown:
        await q.commands.cancel(request(CancelCommands(id=new_id("cmd"))))
    assert unknown.value.code is ErrorCode.NOT_FOUND
    done = await q.commands.enqueue(request(enqueue(new_id("node"), "k")))
    assert (await q.commands.cancel(request(CancelCommands(id=done.id)))).cancelled == [done.id]
    assert (await q.commands.cancel(request(CancelCommands(id=done.id)))).cancelled == []
    assert (await q.commands.get(request(CommandIdRequest(id=done.id)))).state == "cancelled"
