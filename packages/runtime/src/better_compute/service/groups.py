"""Group commit: the same statement for many items at once, one round trip and one commit.

What an event costs a service and PostgreSQL is mostly per statement (a round trip, waking a
backend, a commit with its WAL flush), not per row. ``GroupCommit`` sends the items that arrive
at the same moment as one statement over arrays: the command queue's claims, progress, results and
publication marks, the engine's step settles. A lone item goes after one turn of the event loop;
while ``in_flight`` groups are at the database the next ones gather, so a group grows with the
load (bench/README.md "Settles batched").

Each row of a group is applied on its own terms (a compare-and-set on its row, as the single
statement does), so a group is as safe as its rows one by one: a crash before its commit loses
every row of it, and each item's sender has no answer yet and does it again (an agent retries its
claims and results, an engine pass runs again); after the commit, none. A group that fails as a
whole may be tried again row by row (``row_by_row``), so one bad row (a value PostgreSQL refuses)
fails its own item only.

An item may carry a ``deadline`` (the event loop's clock): past it, its sender has stopped
waiting for the answer (an agent asks again after its request timeout), so an item still not at
the database when its group takes its slot is not sent and fails with ``LateError``. Under an
overload the store's time then goes to what someone still waits for, never to a backlog of
answers nobody reads (a retry storm that outlives the load).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar

__all__ = ["GroupCommit", "LateError", "slot_by"]

T = TypeVar("T")
R = TypeVar("R")


_Entry = tuple[T, "asyncio.Future[R]", float | None]
"""An item, its waiter's future and its deadline."""


class LateError(Exception):
    """The work's deadline passed before it got to the store: it was not done."""


@contextlib.asynccontextmanager
async def slot_by(slots: asyncio.Semaphore | None, deadline: float | None = None) -> AsyncIterator[None]:
    """One of ``slots`` held (none when None), for work that must start by ``deadline`` (the
    event loop's clock): raises ``LateError`` when the slot came too late, having released it."""
    if slots is None:
        _check_deadline(deadline)
        yield
        return
    async with slots:
        _check_deadline(deadline)
        yield


def _check_deadline(deadline: float | None) -> None:
    if deadline is not None and asyncio.get_running_loop().time() > deadline:
        raise LateError


class GroupCommit(Generic[T, R]):
    """Applies items together: ``await group(item)`` returns that item's answer.

    Args:
        apply: the statement over arrays; returns one answer per item, in order.
        key: what one group holds at most once (a command id, a workflow id: its row changes
            once a statement, and a row of a group still at the database never joins another
            group, so two groups of one process never wait on each other's locks).
        slots: taken by each group while at the database (its callers' share of the pool).
        in_flight: groups at the database at once.
        max_rows: items a group holds at most.
        row_by_row: whether a group that failed with this error is tried again row by row (an
            outage is not: each row would wait out the same outage alone).
        keep_abandoned: whether an item whose waiter gave up (was cancelled) before its group
            left still goes: yes for what records work already done (a step's settle), no for
            what asks for something (a claim nobody would hear the answer of).
    """

    def __init__(
        self,
        apply: Callable[[Sequence[T]], Awaitable[Sequence[R]]],
        *,
        key: Callable[[T], Hashable],
        slots: asyncio.Semaphore | None = None,
        in_flight: int = 2,
        max_rows: int = 64,
        row_by_row: Callable[[Exception], bool] = lambda _exc: True,
        keep_abandoned: bool = False,
    ) -> None:
        self.apply = apply
        self.key = key
        self.slots = slots
        self.in_flight = in_flight
        self.max_rows = max_rows
        self.row_by_row = row_by_row
        self.keep_abandoned = keep_abandoned
        self.groups = 0
        """Groups sent so far (one statement each, or one per row when a group failed)."""
        self._waiting: list[_Entry[T, R]] = []
        self._busy: set[Hashable] = set()  # keys of the groups at the database now
        self._flushers: set[asyncio.Task[None]] = set()  # held, so no task is collected mid-flight
        self._active = 0  # flushers that will still look at ``_waiting`` before they end

    async def __call__(self, item: T, *, deadline: float | None = None) -> R:
        """``item``'s answer; ``LateError`` when it was still waiting for the store at ``deadline``
        (the event loop's clock; None: never late)."""
        fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._waiting.append((item, fut, deadline))
        if self._active < self.in_flight:
            # counted here and uncounted by the flusher in the same turn as its last look at
            # ``_waiting``: an item is never left with no flusher to take it (a finished task
            # stays in ``_flushers`` until its done-callback runs, a turn later)
            self._active += 1
            task = asyncio.create_task(self._flush())
            self._flushers.add(task)
            task.add_done_callback(self._flushers.discard)
        return await fut

    async def _flush(self) -> None:
        try:
            await asyncio.sleep(0)  # the other items of this turn join
            await self._flush_waiting()
        finally:
            self._active -= 1

    def _take(self) -> list[_Entry[T, R]]:
        group: list[_Entry[T, R]] = []
        later: list[_Entry[T, R]] = []
        seen: set[Hashable] = set()
        for entry in self._waiting:
            if entry[1].done() and not self.keep_abandoned:
                continue  # a cancelled waiter's item goes nowhere
            k = self.key(entry[0])
            if len(group) < self.max_rows and k not in seen and k not in self._busy:
                seen.add(k)
                group.append(entry)
            else:
                later.append(entry)
        self._waiting = later
        self._busy |= seen
        return group

    async def _flush_waiting(self) -> None:
        while self._waiting:
            group = self._take()
            if not group:
                # every waiting item's key is in the other group at the database: that flusher
                # takes them when it is back (it looks at ``_waiting`` before it ends)
                return
            try:
                await self._send(group)
            finally:
                self._busy -= {self.key(item) for item, _, _ in group}

    async def _send(self, group: list[_Entry[T, R]]) -> None:
        self.groups += 1
        try:
            async with slot_by(self.slots):
                group = _in_time(group)
                if not group:
                    return
                answers = await self.apply([item for item, _, _ in group])
        except asyncio.CancelledError:
            _fail(group, asyncio.CancelledError())
            raise
        except Exception as exc:
            if len(group) == 1 or not self.row_by_row(exc):
                _fail(group, exc)
                return
            # the group as a whole failed: row by row, so a bad row fails its own item only
            # (and an outage fails each with its own error)
            for entry in group:
                await self._send([entry])
            return
        if len(answers) != len(group):  # a bug of the statement's: never leave a waiter hanging
            _fail(group, RuntimeError(f"{len(answers)} answers to a group of {len(group)}"))
            return
        for (_, fut, _), answer in zip(group, answers, strict=True):
            if not fut.done():
                fut.set_result(answer)


def _in_time(group: list[_Entry[T, R]]) -> list[_Entry[T, R]]:
    """The entries whose deadline has not passed; the others fail with ``LateError``."""
    now = asyncio.get_running_loop().time()
    kept: list[_Entry[T, R]] = []
    late: list[_Entry[T, R]] = []
    for entry in group:
        (late if entry[2] is not None and now > entry[2] else kept).append(entry)
    _fail(late, LateError())
    return kept


def _fail(group: list[_Entry[Any, Any]], exc: BaseException) -> None:
    for _, fut, _ in group:
        if not fut.done():
            fut.set_exception(exc)
            fut.exception()  # retrieved, even when its waiter is gone
