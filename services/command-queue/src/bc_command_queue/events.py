"""A command's events, published in the order of its states.

Each state change is published on ``bc.events.command.<id>`` by the task that made it: a claim's
``running`` (its first progress) by the task of the progress event, the command's end by the task
of the result. Both are stored in order (a compare-and-set each), but the two tasks reach the
publisher in either order: on a loaded machine the ``running`` came out after the ``rejected``.

``CommandEvents`` stands between them. Every row carries ``version``, the number of its state
changes (a trigger counts them in PostgreSQL), and the publisher remembers the last version it
published for each recent command: a row older than that is a state the command has left, and
its event is dropped. Nothing is read from the database for it. The memory is bounded (the
oldest commands are forgotten first); the reordering it undoes lasts the few milliseconds between
a commit and its publication, far less than the time it takes that many commands to change.

This holds within an instance. Two instances (the agents' events are spread over them) each
order what they publish; a reader that needs more takes a terminal state as final, as the engine
does (nothing depends on an event: PostgreSQL has the truth).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from better_compute.wire.cmdq import EVENTS

from .rows import CommandRow
from .views import command_event

__all__ = ["REMEMBERED", "CommandEvents"]

REMEMBERED = 50_000
"""Commands whose last published version is kept (about 100 bytes each)."""

Publish = Callable[[str, str, Any], Awaitable[None]]


class CommandEvents:
    """Publishes each changed command's event unless a later state of it went out already."""

    def __init__(self, publish: Publish, *, remembered: int = REMEMBERED, log: Any = None) -> None:
        self._publish = publish
        self._remembered = remembered
        self._last: OrderedDict[str, int] = OrderedDict()
        self._lock = asyncio.Lock()
        self.log = log
        self.dropped = 0
        """Events not published because a later state of their command was (for tests, logs)."""

    async def changed(self, rows: Sequence[CommandRow]) -> None:
        """Publish the rows' events in turn; one whose command's later state was published is
        dropped. The check and the publication are one step, so no other task comes between."""
        async with self._lock:
            for row in rows:
                if not self._admit(row):
                    self.dropped += 1
                    if self.log is not None:
                        self.log.debug("command_event_dropped", command_id=row.id, state=row.state)
                    continue
                await self._publish(EVENTS, row.id, command_event(row))

    def _admit(self, row: CommandRow) -> bool:
        last = self._last.get(row.id)
        if last is not None and row.version < last:
            return False
        # the same version again (a late end re-told, a delivery to another agent) goes out too
        self._last[row.id] = row.version
        self._last.move_to_end(row.id)
        while len(self._last) > self._remembered:
            self._last.popitem(last=False)
        return True
