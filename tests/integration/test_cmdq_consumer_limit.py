"""Every agent of a site gets its consumer on the site's stream, however many agents the site
has. nats-server 2.15 gives a stream without its own consumer limit a default of 1000: in the
10,000-machine bench (1000 machines and a site agent per site) the last machine of each site to
say hello got no consumer, its hello still answered with one, and its ``node.inventory`` stayed
``dispatched`` until its step timed out. A limit the stream reaches is played here small."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client as Nats
from nats.js import api

from bc_command_queue.delivery import MAX_CONSUMERS, Deliveries, Streams
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id
from better_compute.runtime.embedded import EmbeddedNats
from better_compute.service import connect
from better_compute.wire import Subjects
from better_compute.wire.cmdq import EnqueueCommand
from cmdq_kit import queue, request

SITE = "lab1"


@pytest.fixture
async def nc(tmp_path: Path) -> AsyncIterator[Nats]:
    server = EmbeddedNats(tmp_path / "nats")
    client = await connect(server.start(), name="bc-test")
    try:
        yield client
    finally:
        await client.close()
        server.stop()


async def _has_consumer(nc: Nats, stream: str, agent: str) -> bool:
    try:
        await nc.jetstream().consumer_info(stream, agent)
    except nats.js.errors.NotFoundError:
        return False
    return True


async def test_a_stream_an_older_version_made_takes_every_agent_of_the_site(nc: Nats) -> None:
    subjects = Subjects()
    stream = subjects.site_stream(SITE)
    # as an older version left it: no limit of its own, so the server's default holds (1000
    # in nats-server 2.15; 2 here)
    await nc.jetstream().add_stream(
        api.StreamConfig(
            name=stream, subjects=[subjects.site_cmd_all(SITE)],
            retention=api.RetentionPolicy.WORK_QUEUE, max_consumers=2,
        )
    )  # fmt: skip
    streams = Streams(nc, subjects)
    agents = ["site_a", "node_a", "node_b", "node_c"]
    for agent in agents:
        assert await streams.ensure_consumer(SITE, agent) == (stream, agent)
    assert [await _has_consumer(nc, stream, a) for a in agents] == [True] * 4
    info = await nc.jetstream().stream_info(stream)
    assert info.config.max_consumers == MAX_CONSUMERS


async def test_an_agent_the_stream_has_no_room_for_is_not_told_it_has_a_consumer(nc: Nats) -> None:
    streams = Streams(nc, Subjects(), max_consumers=2)
    await streams.ensure_consumer(SITE, "node_a")
    await streams.ensure_consumer(SITE, "node_b")
    with pytest.raises(BcError) as caught:
        await streams.ensure_consumer(SITE, "node_c")
    assert caught.value.code is ErrorCode.UNAVAILABLE
    assert "maximum consumers" in caught.value.message
    # its hello says so (and is tried again); one agent already there still binds
    assert await streams.ensure_consumer(SITE, "node_a") == (Subjects().site_stream(SITE), "node_a")


async def test_an_agent_saying_hello_again_and_again_gets_one_copy_of_its_command(nc: Nats) -> None:
    """Each hello publishes the agent's unclaimed commands again; the stream's duplicate window
    keeps that to the one copy (in the bench, a machine saying hello every second piled 1500
    copies of its one command on its subject)."""
    q = queue()
    await q.commands.enqueue(
        request(
            EnqueueCommand(
                node_id=new_id("node"), site_id=SITE, kind="node.inventory", key="k", target="node"
            )
        )
    )
    [row] = q.deliveries.sent
    assert row.agent_id is not None
    subjects = Subjects()
    deliveries = Deliveries(q.store, Streams(nc, subjects), q.log)
    assert await deliveries.publish(row)
    for _hello in range(5):
        assert await deliveries.deliver(await q.store.agent_commands_to_republish(row.agent_id), again=True)
    info = await nc.jetstream().stream_info(
        subjects.site_stream(SITE), subjects_filter=subjects.site_cmd(SITE, row.agent_id)
    )
    assert info.state.messages == 1


async def test_an_agent_pulling_keeps_its_consumer_and_an_older_consumer_takes_the_threshold(
    nc: Nats,
) -> None:
    """nats-server deletes a consumer nobody pulled from for ``cmdq.consumer_inactive``: never
    one whose agent is pulling (an idle agent holds its pull open). A consumer made before the
    setting (or with another value) takes it at its agent's next hello; ``0s`` takes it off."""
    subjects = Subjects()
    js = nc.jetstream()
    stream, _ = await Streams(nc, subjects, inactive_seconds=0).ensure_consumer(SITE, "node_a")
    assert (await js.consumer_info(stream, "node_a")).config.inactive_threshold is None
    await Streams(nc, subjects, inactive_seconds=1.0).ensure_consumer(SITE, "node_a")
    assert (await js.consumer_info(stream, "node_a")).config.inactive_threshold == 1.0
    pull = await js.pull_subscribe_bind(durable="node_a", stream=stream)
    with pytest.raises(nats.errors.TimeoutError):
        await pull.fetch(1, timeout=3.0)  # three thresholds with a pull open, as an idle agent's
    assert await _has_consumer(nc, stream, "node_a")
    await Streams(nc, subjects, inactive_seconds=0).ensure_consumer(SITE, "node_a")
    assert (await js.consumer_info(stream, "node_a")).config.inactive_threshold is None
