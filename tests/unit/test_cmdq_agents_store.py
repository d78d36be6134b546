"""The command queue's agents on the in-memory store: presence (hello, heartbeat, leaving), the
site's boot lease, a revoked certificate, the checks before a try, the agent routes and the
metrics' counts. (The same on PostgreSQL and the bus: tests/integration/test_cmdq_agents*.py and
test_cmdq_store_contract.py.)"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from prometheus_client import REGISTRY

from bc_command_queue import metrics
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id
from better_compute.wire.agent import Check, Heartbeat, Hello
from better_compute.wire.cmdq import AgentStatus, ListAgents, SiteAgentRequest
from cmdq_kit import SITE, Queue, ack, command, queue, request, signer

_at = iter(range(int(time.time() * 1000), 2**62))


def hello(agent: str, **over: Any) -> Hello:
    fields: dict[str, Any] = {"site": SITE, "agent": agent, "signer_id": "cert_x", "signed_at_ms": next(_at)}
    return Hello(**{**fields, **over})


def heartbeat(agent: str, **over: Any) -> Heartbeat:
    fields: dict[str, Any] = {"site": SITE, "agent": agent, "signer_id": "cert_x", "signed_at_ms": next(_at)}
    return Heartbeat(**{**fields, **over})


async def listed(q: Queue, **filters: Any) -> dict[str, tuple[bool, bool, int]]:
    """The agents ``agents.list`` shows: id -> (connected, boot lease, live commands)."""
    page = await q.agents.list_agents(request(ListAgents(**filters)))
    return {a.id: (a.connected, a.boot_lease, a.live_commands) for a in page.agents}


async def test_a_site_agent_saying_hello_is_listed_connected_and_the_first_one_holds_the_boot_lease() -> None:
    q = queue()
    status = AgentStatus(drivers=["redfish"], last_error="x" * 5000)
    first = await q.agents.apply(
        hello("sa-1", kinds=["power.setPower"], version="1.2", status=status), signer("sa-1")
    )
    second = await q.agents.apply(hello("sa-2"), signer("sa-2"))
    node = await q.agents.apply(hello("node_1"), signer("node_1", role="node"))
    assert (first.boot_lease, second.boot_lease, node.boot_lease) == (True, False, False)
    assert (first.stream, first.consumer) == (f"stream-{SITE}", "consumer-sa-1")
    assert await listed(q) == {"sa-1": (True, True, 0), "sa-2": (True, False, 0), "node_1": (True, False, 0)}
    page = await q.agents.list_agents(request(ListAgents(site_id=SITE, role="site", limit=1)))
    shown = page.agents[0]
    assert (shown.id, shown.version, shown.kinds) == ("sa-1", "1.2", ["power.setPower"])
    assert shown.status is not None
    assert shown.status.last_error is not None
    assert len(shown.status.last_error) < 5000  # cut before it is stored, never refused
    rest = await q.agents.list_agents(request(ListAgents(site_id=SITE, role="site", cursor=page.next)))
    assert [a.id for a in rest.agents] == ["sa-2"]


async def test_an_older_hello_or_heartbeat_changes_nothing_and_an_unknown_agent_must_say_hello() -> None:
    q = queue()
    with pytest.raises(BcError) as err:
        await q.agents.apply(heartbeat("sa-1"), signer("sa-1"))
    assert err.value.code is ErrorCode.NOT_FOUND
    late = hello("sa-1", version="old")
    await q.agents.apply(hello("sa-1", version="new"), signer("sa-1"))
    await q.agents.apply(late, signer("sa-1"))  # a replay, signed before the applied one
    page = await q.agents.list_agents(request(ListAgents()))
    assert [a.version for a in page.agents] == ["new"]
    stale = await q.agents.apply(heartbeat("sa-1", signed_at_ms=late.signed_at_ms), signer("sa-1"))
    assert stale.boot_lease is False


async def test_a_leaving_site_agent_is_shown_disconnected_at_once_and_another_takes_the_boot_lease() -> None:
    q = queue()
    await q.agents.apply(hello("sa-1"), signer("sa-1"))
    await q.agents.apply(hello("sa-2"), signer("sa-2"))
    assert (await q.agents.apply(heartbeat("sa-2"), signer("sa-2"))).boot_lease is False
    await q.agents.apply(heartbeat("sa-1", leaving=True), signer("sa-1"))
    assert (await listed(q))["sa-1"] == (False, False, 0)
    assert await listed(q, connected=True) == {"sa-2": (True, False, 0)}
    assert (await q.agents.apply(heartbeat("sa-2"), signer("sa-2"))).boot_lease is True


async def test_a_heartbeat_tells_the_agent_which_of_its_claimed_commands_were_cancelled() -> None:
    q = queue()
    await q.agents.apply(hello("sa-1"), signer("sa-1"))
    row, site_row = await command(q), await command(q, target="site")
    await q.agents.apply(hello(row.node_id), signer(row.node_id, role="node"))
    await q.claims.ack(ack(row))
    await q.claims.ack(ack(site_row, agent="sa-1"))
    for cancelled in (row, site_row):
        await q.commands.store.cancel(cancelled.id, "operator")
    # a site agent's heartbeat reads it at once; a machine's is answered from what the last
    # presence write read (once a second in the service)
    assert (await q.agents.apply(heartbeat("sa-1"), signer("sa-1"))).cancel == [site_row.id]
    await q.agents.presence.write()
    reply = await q.agents.apply(heartbeat(row.node_id), signer(row.node_id, role="node"))
    assert reply.cancel == [row.id]


async def test_a_machines_heartbeats_reach_the_rows_at_the_next_write_as_of_when_they_were_heard() -> None:
    q = queue()
    node = signer("node_1", role="node")
    await q.agents.apply(hello("node_1"), node)
    q.store.advance(q.config.silent_after_ms / 1000 + 1)
    assert await listed(q) == {"node_1": (False, False, 0)}
    await q.agents.apply(heartbeat("node_1"), node)
    q.store.advance(2)
    assert q.agents.presence.pending == 1
    assert await q.agents.presence.write() == 1
    assert await listed(q) == {"node_1": (True, False, 0)}
    # its silence counts from when it was heard, not from the write
    q.store.advance(q.config.silent_after_ms / 1000 - 1.5)
    assert await listed(q) == {"node_1": (False, False, 0)}
    # a replay to this instance is answered at once as one, and written never
    late = heartbeat("node_1", signed_at_ms=next(_at) - 10_000)
    assert (await q.agents.apply(late, node)).cancel == []
    assert q.agents.presence.pending == 0


async def test_a_thousand_machines_heartbeats_cost_the_store_one_write_and_one_read() -> None:
    q = queue()
    calls: list[str] = []
    names = ("agent_heartbeat", "journal_seen", "cancelling", "agents_heard", "all_cancelling", "agent_by_id")
    for name in names:
        method = getattr(q.store, name)

        async def counted(*args: Any, _name: str = name, _method: Any = method, **kw: Any) -> Any:
            calls.append(_name)
            return await _method(*args, **kw)

        setattr(q.store, name, counted)
    nodes = [f"node_{i}" for i in range(1000)]
    for n in nodes:
        await q.agents.apply(hello(n, journal_id=f"j-{n}"), signer(n, role="node"))
    for n in nodes:
        await q.agents.apply(heartbeat(n, journal_id=f"j-{n}"), signer(n, role="node"))
    calls.clear()  # the first heartbeat of each asks once whether it said hello
    for n in nodes:
        await q.agents.apply(heartbeat(n, journal_id=f"j-{n}"), signer(n, role="node"))
    await q.agents.presence.write()
    assert calls == ["agents_heard", "all_cancelling"]
    assert (await q.store.journal_seen("node_7", "j-node_7", present=False)).present


async def test_a_check_before_a_try_says_stop_for_every_command_the_agent_no_longer_holds() -> None:
    q = queue()
    held, cancelled, unclaimed = await command(q), await command(q), await command(q)
    agent = held.node_id
    for row in (held, cancelled):
        await q.claims.ack(ack(row, agent=agent))  # the rows are other nodes'; the claim is refused
    assert (await q.claims.ack(ack(held))).proceed
    await q.store.cancel(cancelled.id, "operator")
    ids = [held.id, cancelled.id, unclaimed.id, "cmd_unknown"]
    reply = await q.agents.apply(
        Check(site=SITE, agent=agent, signer_id="cert_x", signed_at_ms=next(_at), command_ids=ids),
        signer(agent, role="node"),
    )
    assert reply.stop == [cancelled.id, unclaimed.id, "cmd_unknown"]


async def test_after_a_hello_what_the_agent_may_have_missed_is_delivered_again() -> None:
    q = queue()
    row = await command(q)
    await q.agents.apply(hello(row.node_id), signer(row.node_id, role="node"))
    q.deliveries.sent.clear()
    await asyncio.gather(*q.spawned)
    assert [r.id for r in q.deliveries.sent] == [row.id]


async def test_a_revoked_certificate_cuts_its_agent_off_and_its_unclaimed_site_commands_go_to_another() -> (
    None
):
    q = queue()
    await q.agents.apply(hello("sa-1"), signer("sa-1", cert="cert_bad"))
    row = await command(q, target="site")
    assert (row.state, row.agent_id) == ("dispatched", "sa-1")
    q.pki.states["cert_bad"] = "valid"
    await q.agents.on_cert_event("cert_bad")  # a wake-up only: bc-pki says it is fine
    assert (await listed(q))["sa-1"] == (True, True, 1)
    q.pki.states["cert_bad"] = "revoked"
    await q.agents.on_cert_event("cert_bad")
    assert (await listed(q))["sa-1"] == (False, False, 0)
    assert q.states()[-1] == (row.id, "pending", "agent-revoked")
    assert q.dispatched_sites == [SITE]
    # its hellos and heartbeats change nothing any more; a new site agent takes its work
    again = await q.agents.apply(hello("sa-1"), signer("sa-1", cert="cert_bad"))
    assert again.boot_lease is False
    assert (await q.agents.apply(hello("sa-2"), signer("sa-2"))).boot_lease is True
    await q.sweeper.dispatch_pending(site_id=SITE)
    assert (await q.store.command_by_id(row.id)).agent_id == "sa-2"  # type: ignore[union-attr]


async def test_the_site_agent_route_names_a_connected_site_agent_by_site_or_by_node() -> None:
    q = queue()
    assert (await q.agents.site_agent(request(SiteAgentRequest(site_id=SITE)))).agent_id is None
    await q.agents.apply(hello("sa-1"), signer("sa-1"))
    row = await command(q)
    assert (await q.agents.site_agent(request(SiteAgentRequest(site_id=SITE)))).agent_id == "sa-1"
    assert (await q.agents.site_agent(request(SiteAgentRequest(node_id=row.node_id)))).agent_id == "sa-1"
    unknown = await q.agents.site_agent(request(SiteAgentRequest(node_id=new_id("node"))))
    assert unknown.agent_id is None


async def test_the_metrics_count_live_commands_connected_agents_and_batches_waiting() -> None:
    q = queue()
    await q.agents.apply(hello("sa-1"), signer("sa-1"))
    await command(q, target="site")
    done = await command(q)
    await q.claims.ack(ack(done))
    await q.store.cancel(done.id, "operator")  # claimed: cancelling, not live for the gauge
    await metrics.collect(q.store, silent_after_ms=q.config.silent_after_ms)

    def gauge(name: str, **labels: str) -> float | None:
        return REGISTRY.get_sample_value(name, labels)

    assert gauge("bc_commands_live", kind="node.inventory", state="dispatched", site=SITE) == 1.0
    assert gauge("bc_commands_live", kind="node.inventory", state="cancelling", site=SITE) is None
    assert gauge("bc_agents_connected", site=SITE, role="site") == 1.0
    assert gauge("bc_batches_awaiting_approval") == 0.0


async def test_a_storm_of_agent_events_leaves_the_store_room_for_the_api() -> None:
    q = queue(agent_event_slots=3)
    inside, most = 0, 0
    gate, full = asyncio.Event(), asyncio.Event()
    hello_of = q.store.agent_hello

    async def slow_hello(h: Any) -> bool:
        nonlocal inside, most
        inside += 1
        most = max(most, inside)
        if inside == 3:
            full.set()
        await gate.wait()
        inside -= 1
        return await hello_of(h)

    q.store.agent_hello = slow_hello  # type: ignore[method-assign]
    storm = [asyncio.ensure_future(q.agents.apply(hello(f"node_{i}"), signer(f"node_{i}", role="node")))
             for i in range(30)]  # fmt: skip
    await full.wait()
    for _ in range(50):  # the others wait their turn, however long the first ones take
        await asyncio.sleep(0)
    assert (inside, most) == (3, 3)  # the pool's other connections stay free for the API
    gate.set()
    await asyncio.gather(*storm)
    assert most == 3
    assert len(await listed(q)) == 30
