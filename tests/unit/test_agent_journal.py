"""The agent journal's id: made once with the file, kept across reopenings, new with a new file."""

from __future__ import annotations

import sqlite3
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
    finally:
        journal.close()
