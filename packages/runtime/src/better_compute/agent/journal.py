"""The agent's journal: what it did with each command, kept across restarts.

It is what makes execution at most once. A command is journaled ``started`` (synced to disk)
before its handler runs; a delivery of a command the journal knows is never run again: a
finished one is reported again, one that was started by an earlier process (which died while
running it) is reported failed with reason ``interrupted`` — unless the command queue lets it
run again (an idempotent kind: the delivery is kept with the entry for that). The journal has
a random id, made with the file, that the agent's claims carry: when the journal is lost, the
command queue sees claims from another journal and settles what the lost one may have started as
``interrupted``.

SQLite in WAL mode with ``synchronous=FULL``: a journaled state survives a crash of the process
and of the machine. Writes go through one writer thread that commits whatever is waiting in one
transaction (group commit): one sync to disk covers many commands, and the event loop never
waits on the disk. Reads use their own connection. Entries are pruned a week after they settled.
"""

from __future__ import annotations

import asyncio
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

JournalState = Literal["refused", "started", "finished", "reported"]

_RETENTION_S: Final = 7 * 24 * 3600
_MAX_GROUP: Final = 512

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
# Added later: an older journal file gets the column at open.
_DELIVERY: Final = "ALTER TABLE commands ADD COLUMN delivery BLOB"
_COLUMNS: Final = "id, kind, state, status, reason, result, signature, not_after, delivery"
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
        writer = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        writer.execute("PRAGMA journal_mode=WAL")
        writer.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
        writer.execute(_SCHEMA)
        writer.execute(_META)
        if "delivery" not in {row[1] for row in writer.execute("PRAGMA table_info(commands)")}:
            writer.execute(_DELIVERY)
        # The journal's id, made once with the file: claims carry it, so the command queue tells
        # this journal from one that replaced it (the state folder was wiped, the disk was a RAM
        # disk) and never lets a command that may have started here run again.
        writer.execute(
            "INSERT OR IGNORE INTO meta (key, value) VALUES ('journal_id', ?)", (secrets.token_hex(16),)
        )
        self.id: str = str(writer.execute("SELECT value FROM meta WHERE key = 'journal_id'").fetchone()[0])
        writer.execute(
            "DELETE FROM commands WHERE state IN ('reported', 'refused') AND updated_at < ?",
            (time.time() - _RETENTION_S,),
        )
        self._writer = writer
        self._reader = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._queue: queue.SimpleQueue[tuple[Op, asyncio.Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write_loop, name="agent-journal", daemon=True)
        self._thread.start()
        self._closed = False

    def close(self) -> None:
        """Finish the writes asked for so far, then close. Safe twice."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=10)
        self._reader.close()
        self._writer.close()

    # -- the writer thread ----------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            group = [first]
            stop = False
            while len(group) < _MAX_GROUP:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                group.append(item)
            results: list[tuple[bool, Any]] = []
            try:
                self._writer.execute("BEGIN IMMEDIATE")
                for op, _fut in group:
                    try:
                        results.append((True, op(self._writer)))
                    except sqlite3.Error as exc:
                        results.append((False, exc))
                self._writer.execute("COMMIT")  # one sync to disk for the whole group
            except sqlite3.Error as exc:
                results = [(False, exc)] * len(group)
            for (_op, fut), (ok, value) in zip(group, results, strict=True):
                fut.get_loop().call_soon_threadsafe(_settle, fut, ok, value)
            if stop:
                return

    async def _write(self, op: Op) -> Any:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.put((op, fut))
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

    async def started(
        self, command_id: str, *, kind: str, not_after: float, delivery: bytes | None = None
    ) -> bool:
        """Mark it started; False when the journal knew it already (then never run it)."""

        def op(db: sqlite3.Connection) -> bool:
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
                " updated_at = ? WHERE id = ? AND state = 'refused'",
                (CANCELLED_BEFORE_START, now, command_id),
            )
            return cur.rowcount == 1

        return bool(await self._write(op))

    async def refused(self, command_id: str, *, kind: str, not_after: float, reason: str) -> None:
        """The command queue said not to run it (cancelled, expired, someone else's)."""

        def op(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT OR IGNORE INTO commands (id, kind, state, reason, not_after, updated_at)"
                " VALUES (?, ?, 'refused', ?, ?, ?)",
                (command_id, kind, reason, not_after, time.time()),
            )

        await self._write(op)

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

        await self._write(op)


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
    ident, kind, state, status, reason, result, signature, not_after, delivery = row
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
    )
