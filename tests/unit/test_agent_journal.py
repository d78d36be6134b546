"""The agent journal's id: made once with the file, kept across reopenings, new with a new file."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from better_compute.agent import Journal


def test_a_journal_keeps_its_id_and_a_new_journal_gets_another(tmp_path: Path) -> None:
    first = Journal(tmp_path / "journal.db")
    ident = first.id
    first.close()
    again = Journal(tmp_path / "journal.db")
    assert again.id == ident
    again.close()
    for leftover in tmp_path.glob("journal.db*"):  # the state folder is wiped
        leftover.unlink()
    fresh = Journal(tmp_path / "journal.db")
    assert fresh.id != ident
    assert len(fresh.id) == 32
    fresh.close()


async def test_a_cancel_of_a_command_the_journal_never_started_keeps_it_from_starting(tmp_path: Path) -> None:
    """Issue 22, gap 1: the agent's word that a cancelled command never ran is journaled, and
    the command can then never start (a claim that raced with the cancel loses)."""
    journal = Journal(tmp_path / "journal.db")
    try:
        assert await journal.cancelled("cmd_a")
        entry = journal.get("cmd_a")
        assert entry is not None
        assert (entry.state, entry.status) == ("finished", "rejected")
        assert entry.reason is not None
        assert entry.reason.startswith("cancelled")
        assert not await journal.started("cmd_a", kind="power.setPower", not_after=0.0)
        # started first: the run itself stops and reports, the journal changes nothing
        assert await journal.started("cmd_b", kind="power.setPower", not_after=0.0, delivery=b"{}")
        assert not await journal.cancelled("cmd_b")
        started = journal.get("cmd_b")
        assert started is not None
        assert (started.state, started.delivery) == ("started", b"{}")
        # a refused claim (cancelled after the claim) becomes the same word
        await journal.refused("cmd_c", kind="power.setPower", not_after=0.0, reason="cancelling")
        assert await journal.cancelled("cmd_c")
        refused = journal.get("cmd_c")
        assert refused is not None
        assert refused.state == "finished"
    finally:
        journal.close()


async def test_a_claim_is_journaled_with_its_id_before_it_goes_and_keeps_it_until_it_settles(
    tmp_path: Path,
) -> None:
    """The id a claim names is made and synced before the claim goes: a claim again (its answer
    lost, the process restarted) names the same id; a start, a refusal or a cancel replaces it."""
    path = tmp_path / "journal.db"
    journal = Journal(path)
    try:
        first = await journal.claiming("cmd_a", kind="power.setPower", not_after=0.0)
        assert first is not None
        assert len(first) == 24
        assert await journal.claiming("cmd_a", kind="power.setPower", not_after=0.0) == first
        assert journal.unsettled() == []  # nothing ran: nothing for a restart to report
        assert await journal.started("cmd_a", kind="power.setPower", not_after=0.0, delivery=b"{}")
        assert await journal.claiming("cmd_a", kind="power.setPower", not_after=0.0) is None
        assert not await journal.started("cmd_a", kind="power.setPower", not_after=0.0)

        other = await journal.claiming("cmd_b", kind="power.setPower", not_after=0.0)
        assert other not in (None, first)
        await journal.refused("cmd_b", kind="power.setPower", not_after=0.0, reason="running")
        refused = journal.get("cmd_b")
        assert refused is not None
        assert (refused.state, refused.reason) == ("refused", "running")
        assert await journal.claiming("cmd_b", kind="power.setPower", not_after=0.0) is None

        await journal.claiming("cmd_c", kind="power.setPower", not_after=0.0)
        assert await journal.cancelled("cmd_c")  # cancelled after its claim, never started
        await journal.claiming("cmd_e", kind="power.setPower", not_after=time.time() - 8 * 24 * 3600)
        cancelled = journal.get("cmd_c")
        assert cancelled is not None
        assert (cancelled.state, cancelled.status) == ("finished", "rejected")
        # a claim not taken for now (another agent's command): its entry goes, a later one is new
        waiting = await journal.claiming("cmd_f", kind="power.setPower", not_after=time.time() + 3600)
        await journal.unclaimed("cmd_f")
        assert journal.get("cmd_f") is None
        assert await journal.claiming("cmd_f", kind="power.setPower", not_after=time.time() + 3600) != waiting
        await journal.unclaimed("cmd_a")  # only a claiming entry goes
        assert journal.get("cmd_a") is not None
        held = await journal.claiming("cmd_d", kind="power.setPower", not_after=time.time() + 3600)
    finally:
        journal.close()
    reopened = Journal(path)  # the process restarted between its claim and the start
    try:
        assert await reopened.claiming("cmd_d", kind="power.setPower", not_after=time.time() + 3600) == held
        assert reopened.get("cmd_b") is not None
        # a claim never started whose deadline passed a week ago is pruned at open
        assert reopened.get("cmd_e") is None
    finally:
        reopened.close()


def test_a_journal_file_from_before_the_delivery_column_opens(tmp_path: Path) -> None:
    """Issue 22, gap 7: the delivery a re-run needs is a column added later; an older file gets
    it at open, its entries kept."""
    path = tmp_path / "journal.db"
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE commands (id TEXT PRIMARY KEY, kind TEXT NOT NULL, state TEXT NOT NULL,"
        " status TEXT, reason TEXT, result BLOB, signature BLOB, not_after REAL NOT NULL,"
        " updated_at REAL NOT NULL)"
    )
    db.execute(
        "INSERT INTO commands VALUES ('cmd_old', 'media.eject', 'started', NULL, NULL, NULL, NULL, 0, 0)"
    )
    db.commit()
    db.close()
    journal = Journal(path)
    try:
        entry = journal.get("cmd_old")
        assert entry is not None
        assert (entry.state, entry.delivery) == ("started", None)  # interrupted, as before
        # the smaller page size of new journals is for new files only: this one keeps its own
        assert journal._reader.execute("PRAGMA page_size").fetchone()[0] == 4096
    finally:
        journal.close()


async def test_many_journals_in_one_process_share_a_few_writers_and_keep_every_write(tmp_path: Path) -> None:
    """Issue 25 item 3: the metal simulator's lean host holds a journal per machine in one
    process; they share at most ``WRITER_THREADS`` writer threads, and each journal still gets
    every write it asked for, in order, durable when it returns and there after a close."""
    import asyncio
    import threading

    from better_compute.agent.journal import PAGE_SIZE, WRITER_THREADS

    journals = [Journal(tmp_path / f"m{i:02d}" / "journal.db") for i in range(3 * WRITER_THREADS)]
    try:
        assert journals[0]._reader.execute("PRAGMA page_size").fetchone()[0] == PAGE_SIZE
        writers = {t for t in threading.enumerate() if t.name == "agent-journal"}
        assert 1 <= len(writers) <= WRITER_THREADS

        async def command(journal: Journal, n: int) -> None:
            assert await journal.started(f"cmd_{n}", kind="node.wipe", not_after=0.0)
            await journal.finished(f"cmd_{n}", status="succeeded", reason=None, result=b"{}", signature=None)
            await journal.reported(f"cmd_{n}")

        await asyncio.gather(*(command(j, n) for j in journals for n in range(5)))
        for journal in journals:
            assert [journal.get(f"cmd_{n}").state for n in range(5)] == ["reported"] * 5  # type: ignore[union-attr]
        # a close finishes what was asked before it: the last write is there when reopened
        last = [asyncio.ensure_future(j.refused("cmd_late", kind="node.wipe", not_after=0.0, reason="x"))
                for j in journals]  # fmt: skip
        await asyncio.sleep(0)  # each asked (queued), none awaited yet
    finally:
        for journal in journals:
            journal.close()
    await asyncio.gather(*last)
    for i in range(len(journals)):
        again = Journal(tmp_path / f"m{i:02d}" / "journal.db")
        try:
            late = again.get("cmd_late")
            assert late is not None
            assert late.state == "refused"
        finally:
            again.close()
