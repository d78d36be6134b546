"""Group commit (``better_compute.service.groups.GroupCommit``): items that arrive together (the
command queue's agent events, the engine's step settles) go to the store as one statement, and
each still gets its own answer, or its own error. (On PostgreSQL, with a row it refuses:
tests/integration/test_cmdq_store_contract.py; a queue killed between groups:
tests/integration/test_cmdq_groups_crash.py; the engine's settles:
tests/integration/test_engine_store.py and tests/unit/test_reconciler_units.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from better_compute.service.groups import GroupCommit, LateError
from better_compute.testing.waiting import until


class Db:
    """A statement over arrays: each item doubled; an item ``bad`` fails the whole statement;
    ``gate`` (when set) holds every statement until released."""

    def __init__(self) -> None:
        self.statements: list[list[str]] = []
        self.gate: asyncio.Event | None = None
        self.down = False

    async def apply(self, items: Sequence[str]) -> list[str]:
        self.statements.append(list(items))
        if self.gate is not None:
            await self.gate.wait()
        if self.down:
            raise ConnectionError("the database is away")
        if any(i.startswith("bad") for i in items):
            raise ValueError("a value the database refuses")
        return [i * 2 for i in items]


def group(db: Db, **kw: object) -> GroupCommit[str, str]:
    return GroupCommit(
        db.apply, key=lambda i: i.split("#")[0], row_by_row=lambda exc: not isinstance(exc, ConnectionError),
        **kw,  # type: ignore[arg-type]
    )  # fmt: skip


async def test_events_of_the_same_moment_go_as_one_statement_and_each_gets_its_own_answer() -> None:
    db = Db()
    g = group(db)
    assert await asyncio.gather(*(g(x) for x in "abcde")) == ["aa", "bb", "cc", "dd", "ee"]
    assert db.statements == [list("abcde")]
    assert await g("z") == "zz"  # a lone one goes at once, alone
    assert db.statements[-1] == ["z"]


async def test_a_group_with_one_bad_row_fails_that_row_only() -> None:
    db = Db()
    g = group(db)
    got = await asyncio.gather(g("a"), g("bad"), g("c"), return_exceptions=True)
    assert got[0] == "aa"
    assert got[2] == "cc"
    assert isinstance(got[1], ValueError)
    # the group once, then each row alone
    assert db.statements == [["a", "bad", "c"], ["a"], ["bad"], ["c"]]


async def test_an_outage_fails_the_group_without_trying_each_row_alone() -> None:
    db = Db()
    db.down = True
    g = group(db)
    got = await asyncio.gather(g("a"), g("b"), return_exceptions=True)
    assert all(isinstance(e, ConnectionError) for e in got)
    assert db.statements == [["a", "b"]]
    db.down = False
    assert await g("a") == "aa"  # and the next group goes as ever


async def test_while_two_groups_are_out_the_next_gather_and_a_row_is_in_one_group_at_a_time() -> None:
    db = Db()
    db.gate = asyncio.Event()
    g = group(db, in_flight=2)
    first = [asyncio.create_task(g(x)) for x in ("a", "b")]
    await asyncio.sleep(0.01)
    second = [asyncio.create_task(g(x)) for x in ("c", "a#again")]
    await asyncio.sleep(0.01)
    # two groups at the database; the copy of a (its row is in the first group) waits
    assert db.statements == [["a", "b"], ["c"]]
    third = [asyncio.create_task(g(x)) for x in ("d", "e", "f")]
    await asyncio.sleep(0.01)
    assert len(db.statements) == 2  # no third group while two are out: they gather
    db.gate.set()
    answers = await asyncio.gather(*first, *second, *third)
    assert answers == ["aa", "bb", "cc", "a#againa#again", "dd", "ee", "ff"]
    assert sorted(map(sorted, db.statements[2:])) == [["a#again", "d", "e", "f"]]
    assert g.groups == 3


async def test_a_group_holds_at_most_max_rows() -> None:
    db = Db()
    g = group(db, max_rows=3)
    await asyncio.gather(*(g(str(i)) for i in range(7)))
    assert [len(s) for s in db.statements] == [3, 3, 1]


@pytest.mark.parametrize("cancelled_first", [True, False])
async def test_a_waiter_that_gives_up_leaves_the_others_answered(cancelled_first: bool) -> None:
    db = Db()
    db.gate = asyncio.Event()
    g = group(db)
    tasks = [asyncio.create_task(g(x)) for x in "abc"]
    await asyncio.sleep(0)
    tasks[0 if cancelled_first else 2].cancel()
    db.gate.set()
    got = await asyncio.gather(*tasks, return_exceptions=True)
    answered = [r for r in got if isinstance(r, str)]
    assert len(answered) == 2


async def test_a_group_that_fails_fails_each_of_its_rows_when_not_tried_row_by_row() -> None:
    db = Db()
    g: GroupCommit[str, str] = GroupCommit(db.apply, key=lambda i: i, row_by_row=lambda _exc: False)
    got = await asyncio.gather(g("a"), g("bad"), g("c"), return_exceptions=True)
    assert all(isinstance(e, ValueError) for e in got)
    assert db.statements == [["a", "bad", "c"]]


@pytest.mark.parametrize("keep_abandoned", [False, True])
async def test_an_item_whose_waiter_gave_up_before_its_group_left_goes_only_when_kept(
    keep_abandoned: bool,
) -> None:
    """A claim nobody waits for any more is not taken; a settle whose pass was cancelled is
    still written (the step's work is done)."""
    db = Db()
    db.gate = asyncio.Event()
    g = group(db, in_flight=1, keep_abandoned=keep_abandoned)
    first = asyncio.create_task(g("a"))
    await until(lambda: db.statements == [["a"]])
    gave_up, waits = asyncio.create_task(g("b")), asyncio.create_task(g("c"))
    await until(lambda: len(g._waiting) == 2)
    gave_up.cancel()
    db.gate.set()
    assert (await first, await waits) == ("aa", "cc")
    with pytest.raises(asyncio.CancelledError):
        await gave_up
    assert db.statements[1:] == ([["b", "c"]] if keep_abandoned else [["c"]])


async def test_a_group_cancelled_at_the_database_cancels_its_waiters_and_the_next_still_goes() -> None:
    db = Db()
    db.gate = asyncio.Event()
    g = group(db, in_flight=1)
    waiters = [asyncio.create_task(g(x)) for x in "ab"]
    await until(lambda: db.statements == [["a", "b"]])
    (flusher,) = g._flushers
    flusher.cancel()  # what a crash mid-statement is to this process: no row answered
    got = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(e, asyncio.CancelledError) for e in got)
    db.gate.set()
    assert await g("a") == "aa"


async def test_a_statement_that_answers_too_few_rows_fails_its_group_rather_than_hang() -> None:
    async def short(items: Sequence[str]) -> list[str]:
        return list(items[1:])

    g: GroupCommit[str, str] = GroupCommit(short, key=lambda i: i)
    got = await asyncio.gather(g("a"), g("b"), return_exceptions=True)
    assert all(isinstance(e, RuntimeError) for e in got)


async def test_a_group_takes_a_slot_while_at_the_database() -> None:
    db = Db()
    db.gate = asyncio.Event()
    slots = asyncio.Semaphore(1)
    g = group(db, slots=slots)
    first = asyncio.create_task(g("a"))
    await until(lambda: db.statements == [["a"]])
    assert slots.locked()
    second = asyncio.create_task(g("b"))
    await until(lambda: g.groups == 2)  # the second group is out, waiting for the slot
    assert db.statements == [["a"]]
    db.gate.set()
    assert (await first, await second) == ("aa", "bb")
    assert not slots.locked()


async def test_an_item_still_waiting_for_a_slot_at_its_deadline_is_not_sent_and_fails_late() -> None:
    db = Db()
    db.gate = asyncio.Event()
    slots = asyncio.Semaphore(1)
    g = group(db, slots=slots)
    loop = asyncio.get_running_loop()
    first = asyncio.create_task(g("a"))
    await until(lambda: db.statements == [["a"]])  # holds the only slot
    deadline = loop.time() + 0.2
    late = asyncio.create_task(g("b", deadline=deadline))
    patient = asyncio.create_task(g("c"))
    await until(lambda: loop.time() > deadline)  # its sender has stopped waiting
    db.gate.set()
    assert await first == "aa"
    with pytest.raises(LateError):
        await late
    assert await patient == "cc"
    assert db.statements == [["a"], ["c"]]  # "b" never reached the database
    assert not slots.locked()
