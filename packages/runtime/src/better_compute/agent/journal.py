"""The agent's journal: what it did with each command, kept across restarts.

It is what makes execution at most once. A command is journaled ``claiming``, with a random
claim id, before the agent claims it (the claim names the id and marks the command running at
the command queue; a claim again after a lost answer or a restart names the same id, while a
journal restored from an older copy, which has no entry, makes another and is refused), and
``started`` (synced to disk) before its handler runs; a delivery of a command the journal knows
is never run again: a finished one is reported again, one that was started by an earlier process
(which died while running it) is reported failed with reason ``interrupted`` — unless the
command queue lets it run again (an idempotent kind: the delivery is kept with the entry for
that). The journal has a random id, made with the file, that the agent's claims carry: when the
journal is lost, the command queue sees claims from another journal and settles what the lost
one may have started as ``interrupted``.

SQLite in WAL mode with ``synchronous=FULL``: a journaled state survives a crash of the process
and of the machine. Three writes whose loss in a crash of the machine (not of the process) costs
no safety are not synced on their own (``synchronous=NORMAL`` for a group of only those; the next
synced commit covers them): ``claiming`` (lost, the claim again names another id and is refused
``running``: the agent takes the command for one an earlier process started), ``reported``
(lost, the result is reported again, and the command queue does not record it twice) and
``refused`` (lost, the command is claimed and refused again). Writes go through a writer thread
that commits whatever is waiting for the journal in one transaction (group commit): one sync to
disk covers many commands, and the event loop never waits on the disk. Reads use their own
connection. Entries are pruned a week after they settled.

The writer threads are the process's, shared by its journals (at most ``WRITER_THREADS``; each
journal keeps to one, so its writes stay in order): a bcd or a site agent has one journal and
one writer, as ever, and the metal simulator's lean host (``bcd.lean``), thousands of machines'
journals in one process, does not pay a thread for each.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

__all__ = ["Journal", "JournalEntry", "JournalState"]

JournalState = Literal["claiming", "refused", "started", "finished", "reported"]

_RETENTION_S: Final = 7 * 24 * 3600
_MAX_GROUP: Final = 512
PAGE_SIZE: Final = 1024
"""A new journal file's page size. SQLite makes each connection's page cache with room for 20
pages at its first read: a journal (a few small rows) is two connections, and at SQLite's
4 KiB pages they cost ~270 KiB, ~150 KiB at 1 KiB (the lean host holds thousands)."""
WRITER_THREADS: Final = 8
"""Writer threads a process's journals share at most: a few, so one machine's slow sync to disk
does not hold every other journal's writes (the lean host's machines each sync their own file)."""

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS commands (
    id          TEXT PRIMARY KEY,
    kind        TEXT NOT NULL,
    state       TEXT NOT NULL,
    status      TEXT,
    reason      TEXT,
    result      BLOB,
    signature   BLOB,
    not_after   REAL NOT NULL,
    updated_at  REAL NOT NULL
)
"""
_META: Final = "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"
# Added later: an older journal file gets the columns at open.
_ADDED: Final = {"delivery": "BLOB", "claim": "TEXT"}
_COLUMNS: Final = "id, kind, state, status, reason, result, signature, not_after, delivery, claim"
CANCELLED_BEFORE_START: Final = "cancelled: the agent never started it"

Op = Callable[[sqlite3.Connection], Any]


@dataclass(frozen=True, kw_only=True)
class JournalEntry:
    id: str
    kind: str
    state: JournalState
    status: str | None
    reason: str | None
    result: bytes | None
    signature: bytes | None
    not_after: float
    delivery: bytes | None = None
    """The delivery as received, kept while the command runs (an idempotent one may run again
    from it after the process died)."""
    claim: str | None = None
    """The id its claims name (``Ack.claim_id``), made when it was journaled ``claiming``."""


class Journal:
    """One agent's journal, in a SQLite file.

    Args:
        path: the file (its folder is created).
        durable: sync each commit to disk (``synchronous=FULL``); off trades crash safety of
            the machine (not of the process) for speed.
    """

    def __init__(self, path: str | Path, *, durable: bool = True) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = str(path)
        self.durable = durable
        self._synced = durable
        """Whether the writer connection syncs its commits now (``synchronous=FULL``)."""
        writer = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        writer.execute(f"PRAGMA page_size={PAGE_SIZE}")  # a new file's; an older one keeps its own
        writer.execute("PRAGMA journal_mode=WAL")
        writer.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
        writer.execute(_SCHEMA)
        writer.execute(_META)
        have = {row[1] for row in writer.execute("PRAGMA table_info(commands)")}
        for column, sql_type in _ADDED.items():
            if column not in have:
                writer.execute(f"ALTER TABLE commands ADD COLUMN {column} {sql_type}")
        # The journal's id, made once with the file: claims carry it, so the command queue tells
        # this journal from one that replaced it (the state folder was wiped, the disk was a RAM
        # disk) and never lets a command that may have started here run again.
        writer.execute(
            "INSERT OR IGNORE INTO meta (key, value) VALUES ('journal_id', ?)", (secrets.token_hex(16),)
        )
        self.id: str = str(writer.execute("SELECT value FROM meta WHERE key = 'journal_id'").fetchone()[0])
        # Settled a week ago, or claimed and never started with its deadline a week gone (the
        # command went to another agent, or its claims were refused until it expired).
        writer.execute(
            "DELETE FROM commands WHERE (state IN ('reported', 'refused') AND updated_at < ?1)"
            " OR (state = 'claiming' AND not_after < ?1)",
            (time.time() - _RETENTION_S,),
        )
        self._writer = writer
        self._reader = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._writes = _Writers.take()
        self._closed = False

    def close(self) -> None:
        """Finish the writes asked for so far, then close. Safe twice."""
        if self._closed:
            return
        self._closed = True
        done = threading.Event()
        self._writes.queue.put((self, None, done, False))
        done.wait(timeout=10)
        _Writers.give_back(self._writes)
        self._reader.close()
        self._writer.close()

    # -- on the writer thread ------------------------------------------------------------------

    def _commit(self, group: list[tuple[Op, asyncio.Future[Any], bool]]) -> None:
        """The group's writes in one transaction, each future settled with its outcome; synced
        to disk when one of them must be."""
        results: list[tuple[bool, Any]] = []
        try:
            sync = self.durable and any(must for _op, _fut, must in group)
            if sync != self._synced:
                self._writer.execute(f"PRAGMA synchronous={'FULL' if sync else 'NORMAL'}")
                self._synced = sync
            self._writer.execute("BEGIN IMMEDIATE")
            for op, _fut, _must in group:
                try:
                    results.append((True, op(self._writer)))
                except sqlite3.Error as exc:
                    results.append((False, exc))
            self._writer.execute("COMMIT")  # one sync to disk for the whole group
        except sqlite3.Error as exc:
            results = [(False, exc)] * len(group)
        for (_op, fut, _must), (ok, value) in zip(group, results, strict=True):
            with contextlib.suppress(RuntimeError):  # its event loop is closed: nobody waits
                fut.get_loop().call_soon_threadsafe(_settle, fut, ok, value)

    async def _write(self, op: Op, *, sync: bool = True) -> Any:
        """``sync``: durable when it returns, else once the next synced commit is (it survives
        a crash of the process either way)."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._writes.queue.put((self, op, fut, sync))
        return await fut

    # -- reads ---------------------------------------------------------------------------

    def get(self, command_id: str) -> JournalEntry | None:
        row = self._reader.execute(f"SELECT {_COLUMNS} FROM commands WHERE id = ?", (command_id,)).fetchone()
        return _entry(row) if row else None

    def unsettled(self) -> list[JournalEntry]:
        """Commands started or finished but not reported: what a restart must finish."""
        rows = self._reader.execute(
            f"SELECT {_COLUMNS} FROM commands WHERE state IN ('started', 'finished') ORDER BY updated_at"
        ).fetchall()
        return [_entry(r) for r in rows]

    # -- writes, each durable when it returns ------------------------------------------------

    async def claiming(self, command_id: str, *, kind: str, not_after: float) -> str | None:
        """About to claim it: its claim id, new or the one journaled with it before (a claim
        again after a lost answer or a restart names the same). None when the journal knows it
        otherwise (started, settled: then never claim it)."""
        entry = self.get(command_id)
        if entry is not None:
            return entry.claim if entry.state == "claiming" else None
        made = secrets.token_hex(12)

        def op(db: sqlite3.Connection) -> bool:
            cur = db.execute(
                "INSERT OR IGNORE INTO commands (id, kind, state, not_after, updated_at, claim)"
                " VALUES (?, ?, 'claiming', ?, ?, ?)",
                (command_id, kind, not_after, time.time(), made),
            )
            return cur.rowcount == 1

        # a delivery is handled once at a time (``Agent._active``): nothing wrote it since the read
        return made if await self._write(op, sync=False) else None

    async def unclaimed(self, command_id: str) -> None:
        """The queue did not take the claim, for now (another agent's command, one waiting for
        its batch): the ``claiming`` entry goes; a later delivery claims afresh."""

        def op(db: sqlite3.Connection) -> None:
            db.execute("DELETE FROM commands WHERE id = ? AND state = 'claiming'", (command_id,))

        await self._write(op, sync=False)

    async def started(
        self, command_id: str, *, kind: str, not_after: float, delivery: bytes | None = None
    ) -> bool:
        """Mark it started (from ``claiming``, or new); False when the journal knew it otherwise
        (then never run it)."""

        def op(db: sqlite3.Connection) -> bool:
            cur = db.execute(
                "UPDATE commands SET state = 'started', delivery = ?, updated_at = ?"
                " WHERE id = ? AND state = 'claiming'",
                (delivery, time.time(), command_id),
            )
            if cur.rowcount == 1:
                return True
            cur = db.execute(
                "INSERT OR IGNORE INTO commands (id, kind, state, not_after, updated_at, delivery)"
                " VALUES (?, ?, 'started', ?, ?, ?)",
                (command_id, kind, not_after, time.time(), delivery),
            )
            return cur.rowcount == 1

        return bool(await self._write(op))

    async def cancelled(self, command_id: str) -> bool:
        """The command queue says the command was cancelled after this agent claimed it: if
        it never started here (unknown, or refused), it never will; its entry becomes a
        ``rejected`` result to report, the agent's word that nothing of it was sent. False when
        it started (then the run itself stops and reports)."""

        def op(db: sqlite3.Connection) -> bool:
            now = time.time()
            cur = db.execute(
                "INSERT OR IGNORE INTO commands (id, kind, state, status, reason, result, not_after,"
                " updated_at) VALUES (?, '', 'finished', 'rejected', ?, x'', ?, ?)",
                (command_id, CANCELLED_BEFORE_START, now + _RETENTION_S, now),
            )
            if cur.rowcount == 1:
                return True
            cur = db.execute(
                "UPDATE commands SET state = 'finished', status = 'rejected', reason = ?, result = x'',"
                " updated_at = ? WHERE id = ? AND state IN ('refused', 'claiming')",
                (CANCELLED_BEFORE_START, now, command_id),
            )
            return cur.rowcount == 1

        return bool(await self._write(op))

    async def refused(self, command_id: str, *, kind: str, not_after: float, reason: str) -> None:
        """The command queue said not to run it (cancelled, expired, someone else's)."""

        def op(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT INTO commands (id, kind, state, reason, not_after, updated_at)"
                " VALUES (?, ?, 'refused', ?, ?, ?) ON CONFLICT (id) DO UPDATE SET state = 'refused',"
                " reason = excluded.reason, updated_at = excluded.updated_at WHERE state = 'claiming'",
                (command_id, kind, reason, not_after, time.time()),
            )

        await self._write(op, sync=False)

    async def finished(
        self,
        command_id: str,
        *,
        status: str,
        reason: str | None,
        result: bytes,
        signature: bytes | None,
    ) -> None:
        def op(db: sqlite3.Connection) -> None:
            db.execute(
                "UPDATE commands SET state = 'finished', status = ?, reason = ?, result = ?,"
                " signature = ?, delivery = NULL, updated_at = ? WHERE id = ? AND state = 'started'",
                (status, reason, result, signature, time.time(), command_id),
            )

        await self._write(op)

    async def reported(self, command_id: str) -> None:
        def op(db: sqlite3.Connection) -> None:
            db.execute(
                "UPDATE commands SET state = 'reported', updated_at = ? WHERE id = ? AND state = 'finished'",
                (time.time(), command_id),
            )

        await self._write(op, sync=False)


_Item = tuple[Journal, Op | None, "asyncio.Future[Any] | threading.Event", bool]
"""A journal's write (``op``, its future), or its close (no ``op``, an event set once every
write asked for before it is done)."""


class _Writer:
    """A writer thread and its queue. Whatever is waiting when it wakes is committed in one
    transaction per journal, in the order it was asked for."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self.journals = 0
        self.thread = threading.Thread(target=self._loop, name="agent-journal", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            items = [self.queue.get()]
            while len(items) < _MAX_GROUP:
                try:
                    items.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            groups: dict[Journal, list[tuple[Op, asyncio.Future[Any], bool]]] = {}
            closes: list[threading.Event] = []
            for journal, op, waiter, sync in items:
                if op is None:
                    assert isinstance(waiter, threading.Event)
                    closes.append(waiter)
                else:
                    assert not isinstance(waiter, threading.Event)
                    groups.setdefault(journal, []).append((op, waiter, sync))
            for journal, group in groups.items():
                try:
                    journal._commit(group)
                except Exception as exc:  # a bug, not the disk: fail these writes, keep serving
                    for _op, fut, _sync in group:
                        with contextlib.suppress(RuntimeError):
                            fut.get_loop().call_soon_threadsafe(_settle, fut, False, exc)
            for done in closes:
                done.set()


class _Writers:
    """The process's writer threads: a journal takes the least busy one, a new one while there
    are fewer than ``WRITER_THREADS`` and each has a journal already."""

    _lock = threading.Lock()
    _all: list[_Writer] = []

    @classmethod
    def take(cls) -> _Writer:
        with cls._lock:
            idle = min(cls._all, key=lambda w: w.journals, default=None)
            if idle is None or (idle.journals > 0 and len(cls._all) < WRITER_THREADS):
                idle = _Writer()
                cls._all.append(idle)
            idle.journals += 1
            return idle

    @classmethod
    def give_back(cls, writer: _Writer) -> None:
        with cls._lock:
            writer.journals -= 1

    @classmethod
    def _forget(cls) -> None:
        """In a forked child: the parent's threads are not there (the fork servers fork bcds)."""
        cls._lock = threading.Lock()
        cls._all = []


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_Writers._forget)


def _settle(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if fut.done():
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


def _blob(value: object) -> bytes | None:
    return bytes(value) if isinstance(value, bytes | memoryview) else None


def _entry(row: tuple[object, ...]) -> JournalEntry:
    ident, kind, state, status, reason, result, signature, not_after, delivery, claim = row
    return JournalEntry(
        id=str(ident),
        kind=str(kind),
        state=str(state),  # type: ignore[arg-type]
        status=None if status is None else str(status),
        reason=None if reason is None else str(reason),
        result=_blob(result),
        signature=_blob(signature),
        not_after=float(not_after),  # type: ignore[arg-type]
        delivery=_blob(delivery),
        claim=None if claim is None else str(claim),
    )
