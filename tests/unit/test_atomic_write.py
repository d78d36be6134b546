"""``better_compute.files.atomic_write``: the one way a private file is written, and its users."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from better_compute.files import atomic_write

pytestmark = pytest.mark.unit


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_a_new_file_is_private_whole_and_leaves_nothing_beside_it(tmp_path: Path, umask: None) -> None:
    target = tmp_path / "key"
    atomic_write(target, "secret\n")
    assert (target.read_text(), _mode(target)) == ("secret\n", 0o600)
    atomic_write(target, b"other")
    assert (target.read_bytes(), _mode(target)) == (b"other", 0o600)
    atomic_write(tmp_path / "script", "#!/bin/sh\n", mode=0o755)  # asked-for bits survive the umask
    assert _mode(tmp_path / "script") == 0o755
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key", "script"]


def test_a_file_that_was_readable_by_all_becomes_private(tmp_path: Path) -> None:
    target = tmp_path / "creds.json"
    target.write_text("{}")
    target.chmod(0o644)
    atomic_write(target, '{"password": "pw"}')
    assert _mode(target) == 0o600


def test_exclusive_creates_once_and_leaves_the_first_file_alone(tmp_path: Path) -> None:
    target = tmp_path / "keys"
    atomic_write(target, "first", exclusive=True)
    with pytest.raises(FileExistsError):
        atomic_write(target, "second", exclusive=True)
    assert target.read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["keys"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "contexts.toml"
    target.write_text("old")

    def full(_fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space"):
        atomic_write(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["contexts.toml"]


# The copies it replaced created their temporary file with O_CREAT|O_TRUNC and mode 0600: a
# temporary file (or, for bcx sim's credentials, the file itself) left readable by all kept its mode,
# and the private key or password went into a file anyone could read. Seen failing before.


def test_an_enrollment_is_private_even_over_a_stale_temporary_file(tmp_path: Path) -> None:
    from better_compute.agent import Enrollment, load_enrollment, save_enrollment
    from better_compute.crypto import new_agent_key

    target = tmp_path / "enrollment.json"
    stale = tmp_path / "enrollment.json.tmp"
    stale.write_text("")
    stale.chmod(0o644)
    enrollment = Enrollment(
        agent_id="agent_1", cert_id="cert_1", site_id="s1", tenant_id="root", role="site",
        certificate_pem="-----BEGIN CERTIFICATE-----\n", private_key=new_agent_key(),
    )  # fmt: skip
    save_enrollment(target, enrollment)
    assert _mode(target) == 0o600
    loaded = load_enrollment(target)
    assert loaded is not None
    assert loaded.agent_id == "agent_1"


def test_bcx_sim_credentials_are_private_even_over_a_file_readable_by_all(tmp_path: Path) -> None:
    from better_compute.cli.sim_commands import _write_private

    target = tmp_path / "bmc-credentials.json"
    target.write_text("{}")
    target.chmod(0o644)
    _write_private(target, '{"username": "admin", "password": "pw"}\n')
    assert _mode(target) == 0o600


def test_bcx_contexts_are_private_even_over_a_stale_temporary_file(tmp_path: Path) -> None:
    from better_compute.cli.contexts import BcxConfig, save_config

    target = tmp_path / "config.toml"
    stale = tmp_path / "config.toml.tmp"
    stale.write_text("")
    stale.chmod(0o644)
    save_config(BcxConfig(path=target))
    assert _mode(target) == 0o600
