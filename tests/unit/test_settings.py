"""One settings loader: bc.toml sections, BC_* variables, the manifest's duration grammar."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import pytest

from better_compute.cli.pki_commands import parse_seconds
from better_compute.config import (
    Duration,
    SettingsSource,
    env_var,
    load_settings,
    parse_settings,
    setting_paths,
    settings_changes,
)
from better_compute.core.errors import BcError, ErrorCode

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_bc_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for path in setting_paths():
        monkeypatch.delenv(env_var(path), raising=False)
    monkeypatch.delenv("BC_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)


def test_sections_come_from_bc_toml_and_the_environment_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = tmp_path / "bc.toml"
    file.write_text('subject_root = "x"\n[cmdq]\nsweep = "250ms"\nheartbeat = "2s"\n[pki]\ncert_ttl = "7d"\n')
    monkeypatch.setenv("BC_CMDQ_HEARTBEAT", "3s")
    monkeypatch.setenv("BC_CMDQ_QUORUM_FILE", "/etc/bc/approvers.toml")
    monkeypatch.setenv("BC_SECRETS_KEY_FILE", "/etc/bc/secrets.key")
    s = load_settings(file)
    assert (s.subject_root, s.cmdq.sweep.ms, s.cmdq.heartbeat.ms) == ("x", 250, 3000)
    assert s.pki.cert_ttl == Duration(7 * 86_400_000)
    assert (s.cmdq.quorum.file, s.secrets.key_file) == ("/etc/bc/approvers.toml", "/etc/bc/secrets.key")
    assert s.cmdq.lost_after.ms == 120_000  # untouched: the default


@pytest.mark.parametrize(
    ("toml", "env", "path"),
    [
        ("[cmdq]\nsweep = 100\n", {}, "cmdq.sweep"),  # a bare number: no unit, not a duration
        ("", {"BC_CMDQ_SWEEP": "100"}, "cmdq.sweep"),
        ("", {"BC_CMDQ_SWEEP": "10ms"}, "cmdq.sweep"),  # under the 50 ms floor
        ("", {"BC_CMDQ_QUORUM_THRESHOLD": "two"}, "cmdq.quorum.threshold"),
        ("[cmdq]\nheartbeat_ms = 5000\n", {}, "cmdq.heartbeat_ms"),  # unknown key: a typo
        ("[cmdq.quorum]\nthreshold = 1\napprovers = [{ id = 3 }]\n", {}, "cmdq.quorum.approvers[0].id"),
        ('[cmdq]\nretention = "12h"\n', {}, "cmdq.retention"),  # kept in days
        ("[cmdq]\nstream_replicas = 0\n", {}, "cmdq.stream_replicas"),
        ("[engine]\nsite_admission = -1\n", {}, "engine.site_admission"),
        ("", {"BC_ENGINE_SITE_ADMISSION": "many"}, "engine.site_admission"),
        ("[cmdq]\nstream_max_consumers = -1\n", {}, "cmdq.stream_max_consumers"),  # 1000 to nats-server
        ("", {"BC_CMDQ_STREAM_MAX_CONSUMERS": "0"}, "cmdq.stream_max_consumers"),
        ("", {"BC_CMDQ_STREAM_MAX_CONSUMERS": "lots"}, "cmdq.stream_max_consumers"),
        ("[cmdq]\nstream_max_consumers = 2147483648\n", {}, "cmdq.stream_max_consumers"),
        ('[cmdq]\nconsumer_inactive = "500ms"\n', {}, "cmdq.consumer_inactive"),  # 0s or at least 1s
        ('[cmdq]\nagent_event_wait = "50ms"\n', {}, "cmdq.agent_event_wait"),  # 0s or at least 100ms
        ("", {"BC_CMDQ_AGENT_EVENTS_MAX": "-1"}, "cmdq.agent_events_max"),
        ("", {"BC_HEALTH_PORT": "eighty"}, "health_port"),
        ('[userdata]\nbcd_url = "ftp://x"\n', {}, "userdata.bcd_url"),
        ("", {"BC_USERDATA_BCD_SHA256": "ABC"}, "userdata.bcd_sha256"),
        ('[userdata]\nbcdUrl = "https://x"\n', {}, "userdata.bcdUrl"),  # keys are snake_case
    ],
)
def test_a_bad_setting_is_invalid_config_at_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, toml: str, env: dict[str, str], path: str
) -> None:
    file = tmp_path / "bc.toml"
    file.write_text(toml)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(BcError) as info:
        load_settings(file)
    assert (info.value.code, info.value.path) == (ErrorCode.INVALID_CONFIG, path)


def test_every_setting_has_its_variable_and_key_in_the_docs_and_the_example_parses() -> None:
    table = (ROOT / "docs" / "settings.md").read_text()
    for path in setting_paths():
        assert f"`{env_var(path)}`" in table, path
        assert f"`{path}`" in table, path
    example = tomllib.loads((ROOT / "deploy" / "bc.example.toml").read_text())
    settings = parse_settings(example)
    assert settings.cmdq.stream_replicas >= 1


def test_the_cli_reads_durations_with_the_manifest_grammar() -> None:
    assert [parse_seconds(t) for t in ("90s", "30m", "2h", "7d", "2000ms")] == [90, 1800, 7200, 604800, 2]
    for text in ("90", "1.5h", "500ms", "2 h"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_seconds(text)


def test_a_settings_source_sees_its_file_change_and_names_what_changed(tmp_path: Path) -> None:
    """What a running service reads again (issue 26): the file's change is seen, the settings read
    again keep the same overrides, and what changed is named by its path."""
    file = tmp_path / "bc.toml"
    file.write_text('[cmdq]\nsweep = "250ms"\n[[images.signers]]\nid = "a"\npublicKey = "k"\n')
    source = SettingsSource(file, subject_root="over")
    before = source.read()
    assert not source.changed()
    file.write_text('[cmdq]\nsweep = "300ms"\n[[images.signers]]\nid = "b"\npublicKey = "k"\n')
    assert source.changed()
    after = source.read()
    assert not source.changed()
    source.forget()  # what was read could not be applied (a server away): the next look reads it
    assert source.changed()
    assert source.read() == after
    assert after.subject_root == "over"
    assert settings_changes(before, after) == ["cmdq.sweep", "images.signers"]
    file.write_text('[cmdq]\nsweep = "soon"\n')
    with pytest.raises(BcError) as bad:
        source.read()
    assert bad.value.details["path"] == "cmdq.sweep"
    file.unlink()
    assert source.changed()
    assert SettingsSource().file is None  # no bc.toml here, none named: nothing to watch
