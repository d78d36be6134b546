"""The agent journal's id: made once with the file, kept across reopenings, new with a new file."""

from __future__ import annotations

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
