"""An agent's consumer at its hello (``Streams.ensure_consumer``): a hello retried while its
consumer is being made waits for that creation rather than asking nats-server again, and a
consumer made a moment ago is not asked for again. nats-server takes each creation through its
JetStream API queue; a storm of hellos asking for them overflowed it in the 10,000-machine deploy
(bench/README.md "Agent events shed"). (On a real nats-server: tests/integration/
test_cmdq_consumer_limit.py, test_cmdq_delivery.py.)"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bc_command_queue import delivery
from bc_command_queue.delivery import Streams
from better_compute.testing.waiting import until
from better_compute.wire import Subjects


class JetStream:
    """nats-server's JetStream API as the queue uses it: each consumer creation is counted and
    held until ``gate`` opens."""

    def __init__(self) -> None:
        self.created: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def add_stream(self, config: Any) -> None:
        return None

    async def add_consumer(self, stream: str, config: Any) -> None:
        self.created.append(config.durable_name)
        await self.gate.wait()


class Nats:
    def __init__(self) -> None:
        self.js = JetStream()

    def jetstream(self, **_kw: Any) -> JetStream:
        return self.js


async def test_a_hello_retried_while_its_consumer_is_made_waits_for_that_creation() -> None:
    nc = Nats()
    streams = Streams(nc, Subjects())  # type: ignore[arg-type]
    nc.js.gate.clear()  # nats-server is slow with it
    first = asyncio.create_task(streams.ensure_consumer("lab1", "node_a"))
    await until(lambda: nc.js.created == ["node_a"])
    retried = asyncio.create_task(streams.ensure_consumer("lab1", "node_a"))
    other = asyncio.create_task(streams.ensure_consumer("lab1", "node_b"))
    await until(lambda: len(nc.js.created) == 2)
    nc.js.gate.set()
    names = await asyncio.wait_for(asyncio.gather(first, retried, other), 10)
    assert names[0] == names[1] != names[2]
    assert sorted(nc.js.created) == ["node_a", "node_b"]  # one creation each


async def test_a_consumer_made_a_moment_ago_is_not_asked_for_again_until_the_memory_lapses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nc = Nats()
    streams = Streams(nc, Subjects())  # type: ignore[arg-type]
    made = await streams.ensure_consumer("lab1", "node_a")
    assert await streams.ensure_consumer("lab1", "node_a") == made
    assert nc.js.created == ["node_a"]
    # the site's stream was lost (a publication found it gone): its consumers are made again
    streams.forget("lab1")
    await streams.ensure_consumer("lab1", "node_a")
    assert nc.js.created == ["node_a", "node_a"]
    monkeypatch.setattr(delivery, "_CONSUMER_KNOWN_S", 0.0)
    await streams.ensure_consumer("lab1", "node_a")
    assert nc.js.created == ["node_a"] * 3


async def test_a_failed_creation_fails_its_waiters_and_is_tried_again_at_the_next_hello() -> None:
    nc = Nats()
    streams = Streams(nc, Subjects())  # type: ignore[arg-type]
    calls = 0

    async def refuse(stream: str, config: Any) -> None:
        nonlocal calls
        calls += 1
        raise TimeoutError

    nc.js.add_consumer = refuse  # type: ignore[method-assign]
    with pytest.raises(Exception, match="consumer"):
        await streams.ensure_consumer("lab1", "node_a")
    with pytest.raises(Exception, match="consumer"):
        await streams.ensure_consumer("lab1", "node_a")
    assert calls == 2  # a failure is not remembered


async def test_after_a_reconnect_every_consumer_is_asked_for_again() -> None:
    # the server that came back may be a new one that lost them
    nc = Nats()
    nc.stats = {"reconnects": 0}  # type: ignore[attr-defined]
    streams = Streams(nc, Subjects())  # type: ignore[arg-type]
    await streams.ensure_consumer("lab1", "node_a")
    nc.stats["reconnects"] = 1  # type: ignore[attr-defined]
    await streams.ensure_consumer("lab1", "node_a")
    assert nc.js.created == ["node_a", "node_a"]


async def test_a_storm_of_hellos_has_at_most_the_bound_of_creations_at_nats_server() -> None:
    nc = Nats()
    streams = Streams(nc, Subjects())  # type: ignore[arg-type]
    nc.js.gate.clear()
    agents = [f"node_{i}" for i in range(delivery._CREATIONS_IN_FLIGHT + 8)]
    hellos = [asyncio.create_task(streams.ensure_consumer("lab1", a)) for a in agents]
    await until(lambda: len(nc.js.created) == delivery._CREATIONS_IN_FLIGHT)
    for _ in range(20):  # every hello has had its turn of the loop: the others wait in memory
        await asyncio.sleep(0)
    assert len(nc.js.created) == delivery._CREATIONS_IN_FLIGHT
    nc.js.gate.set()
    await asyncio.wait_for(asyncio.gather(*hellos), 10)
    assert sorted(nc.js.created) == sorted(agents)  # each made once, none lost
