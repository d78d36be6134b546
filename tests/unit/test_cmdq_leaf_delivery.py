"""Deliveries with the site streams on the sites' leaves (``cmdq.site_domain``): a site whose
leaf stream takes nothing (its link is down) is skipped, and the other sites' deliveries still go
out in the same pass; with the streams on the hub a failure still ends the pass (one JetStream
for every site). On the bus: tests/integration/test_cmdq_leaf_domains.py."""

from __future__ import annotations

from bc_command_queue.delivery import Deliveries
from bc_command_queue.rows import CommandRow
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id
from better_compute.wire.cmdq import EnqueueCommand
from cmdq_kit import Queue, queue, request


class CutStreams:
    """Site streams of which those of ``cut`` sites take nothing."""

    def __init__(self, cut: set[str], *, on_leaves: bool) -> None:
        self.cut = cut
        self.on_leaves = on_leaves
        self.tried: list[str] = []
        self.taken: list[str] = []

    async def publish(
        self, *, site_id: str, agent_id: str, command_id: str, body: bytes, generation: int
    ) -> tuple[int, bool]:
        self.tried.append(site_id)
        if site_id in self.cut:
            raise BcError(ErrorCode.UNAVAILABLE, "the site's stream did not take the command")
        self.taken.append(command_id)
        return len(self.taken), False


async def _queued(sites: list[str]) -> tuple[Queue, list[CommandRow]]:
    """A queue with one node command dispatched at each of ``sites``, and those rows."""
    q = queue()
    for n, site in enumerate(sites):
        await q.commands.enqueue(
            request(
                EnqueueCommand(
                    node_id=new_id("node"), site_id=site, kind="node.inventory", key=f"k{n}", target="node"
                )
            )
        )
    return q, q.deliveries.sent


async def test_a_cut_site_is_skipped_and_the_other_sites_deliveries_still_go() -> None:
    q, rows = await _queued(["lab3", "lab1", "lab3", "lab2", "lab3"])
    streams = CutStreams({"lab3"}, on_leaves=True)
    ok = await Deliveries(q.store, streams, q.log).deliver(rows)  # type: ignore[arg-type]
    assert ok is False  # the sweeper publishes lab3's later
    assert streams.taken == [r.id for r in rows if r.site_id != "lab3"]
    assert streams.tried.count("lab3") == 1  # one try per pass for the cut site


async def test_on_the_hub_a_stream_in_trouble_ends_the_pass() -> None:
    q, rows = await _queued(["lab3", "lab1"])
    streams = CutStreams({"lab3"}, on_leaves=False)
    assert await Deliveries(q.store, streams, q.log).deliver(rows) is False  # type: ignore[arg-type]
    assert streams.taken == []
