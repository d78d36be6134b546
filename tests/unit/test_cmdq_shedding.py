"""The command queue under an overload of agent events (``Agents.on_event``): what nobody waits
for any more is answered busy and never applied, and heartbeats go on being answered. The real
signed events through the real ``Agents``, on the in-memory store with its slots held. (The
10,000-machine deploy this is for: bench/README.md, "Agent events shed".)"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from better_compute.core.errors import BcError, ErrorCode
from better_compute.crypto import AgentIdentity, new_agent_key, sign_event
from better_compute.testing.waiting import until
from better_compute.wire import unwrap
from better_compute.wire.agent import AgentEvent, Heartbeat, Hello, Progress
from cmdq_kit import SITE, Queue, ack, command, queue, signer

_IDENTITY = AgentIdentity(cert_id="cert_x", agent_id="unused", private_key=new_agent_key())


class Signers:
    """Every signature checks; counts the checks (an event shed past the bound costs none)."""

    def __init__(self) -> None:
        self.checked = 0

    async def check_event(self, *, site: str, agent: str, kind: str, doc: Any, signature: bytes) -> Any:
        self.checked += 1
        return signer(agent, site=site, role="node")

    def evict(self, cert_id: str) -> None:
        pass


class Msg:
    """A request on ``bc.agent.<site>.<agent>.<kind>`` and the answer it got."""

    def __init__(self, agent: str, kind: str, event: AgentEvent) -> None:
        self.subject = f"bc.agent.{SITE}.{agent}.{kind}"
        self.data = sign_event(_IDENTITY, kind, event)
        self.reply = "_INBOX.test"
        self.answered = asyncio.Event()
        self.body = b""

    async def respond(self, body: bytes) -> None:
        self.body = body
        self.answered.set()

    def answer(self) -> Any:
        return unwrap(self.body)


def heartbeat(agent: str) -> Heartbeat:
    return Heartbeat(site=SITE, agent=agent, signer_id="cert_x", signed_at_ms=1, running=0)


async def say_hello(q: Queue, agent: str) -> None:
    hello = Msg(agent, "hello", Hello(site=SITE, agent=agent, signer_id="cert_x", signed_at_ms=1))
    await asyncio.wait_for(q.agents.on_event(hello), 10)  # type: ignore[arg-type]
    hello.answer()


def shedding_queue(**cfg: Any) -> tuple[Queue, Signers]:
    q = queue(agent_event_slots=1, **cfg)
    signers = Signers()
    q.agents.signers = signers  # type: ignore[assignment]
    return q, signers


def busy(msg: Msg) -> bool:
    try:
        msg.answer()
    except BcError as err:
        return err.code is ErrorCode.UNAVAILABLE and err.reason == "busy"
    return False


async def test_a_claim_that_waited_for_the_store_past_its_wait_is_answered_busy_and_not_taken() -> None:
    q, _ = shedding_queue(agent_event_wait_ms=300)
    row = await command(q)
    agent = row.agent_id or row.node_id
    await say_hello(q, agent)
    loop = asyncio.get_running_loop()
    slot = q.agents.claims.slots
    await slot.acquire()  # the store is busy with others' events
    claim = Msg(agent, "ack", ack(row))
    arrived = loop.time()
    claiming = asyncio.create_task(q.agents.on_event(claim, received=arrived))  # type: ignore[arg-type]
    # a heartbeat in the same storm needs no slot: answered meanwhile
    beat = Msg(agent, "heartbeat", heartbeat(agent))
    await q.agents.on_event(beat, received=loop.time())  # type: ignore[arg-type]
    assert msgspec.convert(beat.answer(), dict)["bootLease"] is False
    await until(lambda: loop.time() > arrived + 0.3)  # its agent has stopped waiting
    assert not claim.answered.is_set()
    slot.release()
    await asyncio.wait_for(claiming, 10)
    assert busy(claim)
    assert (await q.store.command_by_id(row.id)).state == "dispatched"  # type: ignore[union-attr]
    # the agent asks again and the store has time for it now
    again = Msg(agent, "ack", ack(row))
    await asyncio.wait_for(q.agents.on_event(again, received=loop.time()), 10)  # type: ignore[arg-type]
    assert msgspec.convert(again.answer(), dict)["proceed"] is True
    assert (await q.store.command_by_id(row.id)).state == "acked"  # type: ignore[union-attr]


async def test_past_the_events_in_hand_bound_a_claim_is_answered_busy_at_once_unchecked() -> None:
    q, signers = shedding_queue(agent_events_max=2)
    rows = [await command(q) for _ in range(3)]
    await say_hello(q, rows[2].agent_id or rows[2].node_id)
    checked = signers.checked
    loop = asyncio.get_running_loop()
    slot = q.agents.claims.slots
    await slot.acquire()
    held = [Msg(r.agent_id or r.node_id, "ack", ack(r)) for r in rows[:2]]
    waiting = [asyncio.create_task(q.agents.on_event(m, received=loop.time())) for m in held]  # type: ignore[arg-type]
    await until(lambda: q.agents.in_hand == 2 and signers.checked == checked + 2)
    third = Msg(rows[2].agent_id or rows[2].node_id, "ack", ack(rows[2]))
    await asyncio.wait_for(q.agents.on_event(third, received=loop.time()), 10)  # type: ignore[arg-type]
    assert busy(third)
    assert signers.checked == checked + 2  # shed before its signature was checked
    # a heartbeat is never shed, however many are in hand
    agent = rows[2].agent_id or rows[2].node_id
    beat = Msg(agent, "heartbeat", heartbeat(agent))
    await asyncio.wait_for(q.agents.on_event(beat, received=loop.time()), 10)  # type: ignore[arg-type]
    assert not busy(beat)
    slot.release()
    await asyncio.wait_for(asyncio.gather(*waiting), 10)
    assert [msgspec.convert(m.answer(), dict)["proceed"] for m in held] == [True, True]
    assert q.agents.in_hand == 0
    states = [(await q.store.command_by_id(r.id)).state for r in rows]  # type: ignore[union-attr]
    assert states == ["acked", "acked", "dispatched"]


async def test_a_progress_is_never_shed_however_late_it_reaches_the_store() -> None:
    # sent once and never again; the first is the command's running mark
    q, _ = shedding_queue(agent_event_wait_ms=100)
    row = await command(q)
    agent = row.agent_id or row.node_id
    assert (await q.agents.claims.ack(ack(row))).proceed
    loop = asyncio.get_running_loop()
    event = Progress(site=SITE, agent=agent, signer_id="cert_x", signed_at_ms=1, command_id=row.id)
    late = Msg(agent, "progress", event)
    await asyncio.wait_for(q.agents.on_event(late, received=loop.time() - 60), 10)  # type: ignore[arg-type]
    assert not busy(late)
    assert (await q.store.command_by_id(row.id)).state == "running"  # type: ignore[union-attr]


async def test_with_no_wait_and_no_bound_a_late_claim_is_still_taken() -> None:
    # cmdq.agent_event_wait = "0s", cmdq.agent_events_max = 0: nothing is shed
    q, _ = shedding_queue(agent_event_wait_ms=0, agent_events_max=0)
    rows = [await command(q) for _ in range(2)]
    for r in rows:
        await say_hello(q, r.agent_id or r.node_id)
    loop = asyncio.get_running_loop()
    claims = [Msg(r.agent_id or r.node_id, "ack", ack(r)) for r in rows]
    # arrived an hour ago, and more in hand than any bound would allow
    await asyncio.wait_for(
        asyncio.gather(*(q.agents.on_event(m, received=loop.time() - 3600) for m in claims)),  # type: ignore[arg-type]
        10,
    )
    assert [msgspec.convert(m.answer(), dict)["proceed"] for m in claims] == [True, True]
    assert [(await q.store.command_by_id(r.id)).state for r in rows] == ["acked", "acked"]  # type: ignore[union-attr]
