"""The test kit's hub and leaf per site (``better_compute.testing.leaves``): a site's agents pull
from the hub's stream and reach its services through their leaf, and a cut link stays cut until
the test heals it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.js import api

from better_compute.service import nats_client
from better_compute.testing import until
from better_compute.testing.leaves import SiteLeaves


async def test_a_cut_leaf_reaches_nothing_until_healed_then_pulls_what_waited(tmp_path: Path) -> None:
    leaves = SiteLeaves(tmp_path / "nats", ["lab1", "lab2"]).start()
    try:
        hub = nats_client()  # its flush comes after its SUB
        await hub.connect(leaves.hub_url)
        js = hub.jetstream()
        await js.add_stream(api.StreamConfig(name="S", subjects=["bc.site.lab2.cmd.*"]))
        config = api.ConsumerConfig(
            durable_name="a1", filter_subject="bc.site.lab2.cmd.a1", ack_policy=api.AckPolicy.EXPLICIT
        )
        await js.add_consumer("S", config)

        async def answer(msg: nats.aio.msg.Msg) -> None:
            await msg.respond(b"heard " + msg.data)

        await hub.subscribe("bc.agent.>", cb=answer)
        await hub.flush()
        agent = await nats.connect(leaves.url("lab2"), max_reconnect_attempts=-1)
        pull = await agent.jetstream().pull_subscribe_bind(durable="a1", stream="S")
        await js.publish("bc.site.lab2.cmd.a1", b"before")
        (msg,) = await pull.fetch(1, timeout=5)  # the leaf maps $JS.API to the hub's domain
        assert msg.data == b"before"
        await msg.ack()
        assert (await agent.request("bc.agent.lab2.a1", b"1", timeout=5)).data == b"heard 1"

        leaves.gate("lab2").cut(3600)
        await until(lambda: not leaves.linked("lab2"), timeout=10, what="lab2's link down")
        await js.publish("bc.site.lab2.cmd.a1", b"during")
        with pytest.raises(nats.errors.NoRespondersError):
            await agent.request("bc.agent.lab2.a1", b"2", timeout=2)
        with pytest.raises(nats.js.errors.ServiceUnavailableError):
            await pull.fetch(1, timeout=2)
        # the hub does not advertise its own leaf port, so the leaf, which dials again every
        # second, cannot go around the gate: it stays down for two of its tries
        for _ in range(25):
            assert not leaves.linked("lab2"), "lab2's leaf linked around the gate"
            await asyncio.sleep(0.1)
        assert leaves.linked("lab1")

        leaves.gate("lab2").heal()
        await until(lambda: leaves.linked("lab2"), timeout=15, what="lab2's link back")

        async def pulled() -> bytes | None:
            try:
                (got,) = await pull.fetch(1, timeout=1)
            except (nats.errors.TimeoutError, nats.js.errors.Error):
                return None
            await got.ack()
            return bytes(got.data)

        assert await until(pulled, timeout=15, what="the command that waited") == b"during"
        await agent.close()
        await hub.close()
    finally:
        leaves.close()
