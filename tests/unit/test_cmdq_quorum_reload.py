"""The approvers file read again when it changes (``QuorumSource``), without servers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bc_command_queue.config import Quorum, QuorumSource, load_quorum
from better_compute.core.errors import BcError, ErrorCode
from better_compute.testing.approvers import approver_keys, write_approvers


def _replace(path: Path, text: str) -> None:
    staged = path.with_suffix(".next")
    staged.write_text(text)
    os.replace(staged, path)


def test_a_changed_approvers_file_is_in_force_and_a_broken_one_keeps_the_last(tmp_path: Path) -> None:
    keys = approver_keys(["alice", "bob", "carol"])
    path = write_approvers(tmp_path / "approvers.toml", keys)
    source = QuorumSource(load_quorum(path), path)
    assert not source.reload()  # unchanged
    content = path.read_text()

    _replace(path, content)  # the same approvers again: nothing changes
    assert not source.reload()

    write_approvers(tmp_path / "approvers.next", {**keys, **approver_keys(["dave"])}, threshold=3)
    os.replace(tmp_path / "approvers.next", path)
    assert source.reload()
    assert (source.quorum.threshold, sorted(source.quorum.approvers)) == (
        3,
        ["alice", "bob", "carol", "dave"],
    )

    _replace(path, "threshold = 9\n")  # wrong: said once, and the quorum in force stays
    with pytest.raises(BcError) as caught:
        source.reload()
    assert (caught.value.code, caught.value.details["path"]) == (
        ErrorCode.INVALID_CONFIG,
        "cmdq.quorum.approvers",
    )
    assert not source.reload()
    assert source.quorum.threshold == 3

    path.unlink()  # gone: said once too
    with pytest.raises(BcError):
        source.reload()
    assert not source.reload()
    assert sorted(source.quorum.approvers) == ["alice", "bob", "carol", "dave"]


def test_an_inline_quorum_has_no_file_to_read_again() -> None:
    source = QuorumSource(Quorum())
    assert not source.reload()
    assert not source.quorum.enabled
