"""A command's events come out in the order of its states, whatever order the tasks that made the
changes reach the publisher in (docs/command-queue.md, Commands). The race is played here step by
step: the task of a claim's first progress stores ``running`` and is held before it publishes,
while the task of the command's result stores and publishes ``rejected``."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from bc_command_queue.events import CommandEvents
from bc_command_queue.rows import CommandRow
from bc_command_queue.runs import Runs
from better_compute.wire.cmdq import EVENTS, CommandEvent
from cmdq_kit import ack, command, progress, queue, result


class Bus:
    """What went out on ``bc.events.command.<id>``, in order."""

    def __init__(self) -> None:
        self.events: list[CommandEvent] = []

    async def publish(self, kind: str, ident: str, event: Any) -> None:
        assert (kind, ident) == (EVENTS, event.id)
        self.events.append(event)

    def states(self, command_id: str) -> list[str]:
        return [e.state for e in self.events if e.id == command_id]


async def test_a_running_stored_before_the_end_but_published_after_it_never_goes_out() -> None:
    q = queue()
    row = await command(q, kind="media.eject")
    await q.claims.ack(ack(row))
    bus = Bus()
    events = CommandEvents(bus.publish)
    held, release = asyncio.Event(), asyncio.Event()

    async def changed(rows: Sequence[CommandRow]) -> None:
        if rows[0].state == "running":  # the progress task: stored, not yet published
            held.set()
            await release.wait()
        await events.changed(rows)

    runs = Runs(store=q.store, pki=None, changed=changed, log=q.log)  # type: ignore[arg-type]
    started = asyncio.create_task(runs.progress(progress(row, "try 1")))
    await held.wait()
    assert (await q.store.command_by_id(row.id)).state == "running"  # type: ignore[union-attr]
    ended = await runs.result(result(row, "rejected", reason="no virtual media on this BMC"))
    assert (ended.recorded, ended.state) == (True, "rejected")
    release.set()
    await started

    assert bus.states(row.id) == ["rejected"]  # the end is the last word, no "running" after it
    assert events.dropped == 1


async def test_live_states_go_out_in_order_and_a_state_told_again_goes_out_again() -> None:
    q = queue()
    row = await command(q)
    await q.claims.ack(ack(row))
    acked = q.changed[-1]
    await q.runs.progress(progress(row))
    running = q.changed[-1]
    bus = Bus()
    events = CommandEvents(bus.publish)
    await events.changed([running])
    await events.changed([acked])  # behind its successor: dropped
    await events.changed([running])  # the same state again (a late end told again): goes out
    assert bus.states(row.id) == ["running", "running"]
    assert (row.version, acked.version, running.version) == (0, 1, 2)  # one a state change


async def test_the_order_is_kept_per_command_for_the_latest_commands_only() -> None:
    q = queue()
    dispatched = [await command(q) for _ in range(3)]
    for row in dispatched:
        await q.claims.ack(ack(row))
    acked = q.changed[-3:]
    bus = Bus()
    events = CommandEvents(bus.publish, remembered=2)
    await events.changed(acked)
    await events.changed([dispatched[0], dispatched[2]])  # each behind its successor
    # the memory is bounded: the first command was forgotten, its late event goes out; the last's not
    assert [(e.id, e.state) for e in bus.events] == [(r.id, "acked") for r in acked] + [
        (dispatched[0].id, "dispatched")
    ]
