from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import structlog

from better_compute.config import load_settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.logging import configure_logging, get_logger, register_secret


@pytest.fixture
def log_lines() -> io.StringIO:
    buf = io.StringIO()
    configure_logging(json=True, stream=buf, level="debug")
    yield buf
    structlog.reset_defaults()


def test_sensitive_keys_are_redacted(log_lines: io.StringIO) -> None:
    get_logger(workflow_id="wf_1").info("token_issued", join_token="abc.def.ghi", password="hunter22")
    line = json.loads(log_lines.getvalue())
    assert line["event"] == "token_issued"
    assert line["workflow_id"] == "wf_1"
    assert line["join_token"] == "[redacted]"
    assert line["password"] == "[redacted]"


def test_registered_secret_values_are_cut_from_any_string(log_lines: io.StringIO) -> None:
    secret = "s3cr3t-value-0b5e1f"
    register_secret(secret)
    get_logger().error("render_failed", message=f"template failed near {secret}!", nested={"x": [secret]})
    out = log_lines.getvalue()
    assert secret not in out
    assert "template failed near [redacted]!" in out


def test_json_is_chosen_off_a_terminal(log_lines: io.StringIO) -> None:
    buf = io.StringIO()
    configure_logging(stream=buf)
    get_logger().info("hello", n=1)
    assert json.loads(buf.getvalue())["n"] == 1


def test_settings_layer_file_env_and_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "bc.toml"
    cfg.write_text('nats_url = "nats://file:1"\nsubject_root = "fromfile"\nhealth_port = 9\n')
    monkeypatch.setenv("BC_SUBJECT_ROOT", "fromenv")
    s = load_settings(cfg, nats_url="nats://flag:2")
    assert (s.nats_url, s.subject_root, s.health_port) == ("nats://flag:2", "fromenv", 9)


def test_bad_settings_are_invalid_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BC_HEALTH_PORT", raising=False)
    cfg = tmp_path / "bc.toml"
    cfg.write_text('health_port = "many"\n')
    with pytest.raises(BcError) as e:
        load_settings(cfg)
    assert (e.value.code, e.value.path) == (ErrorCode.INVALID_CONFIG, "health_port")
    cfg.write_text("natz_url = 1\n")
    with pytest.raises(BcError) as e:
        load_settings(cfg)
    assert e.value.code is ErrorCode.INVALID_CONFIG
    cfg.write_text("not toml [")
    with pytest.raises(BcError) as e:
        load_settings(cfg)
    assert e.value.path == str(cfg)


def test_the_registry_keeps_the_most_recent_values(log_lines: io.StringIO) -> None:
    from better_compute import logging as bc_logging

    first = "tok-first-0000000000"
    register_secret(first)
    for i in range(bc_logging.MAX_REGISTERED_SECRETS):
        register_secret(f"tok-filler-{i:010d}")
    latest = "tok-latest-9999999999"
    register_secret(latest)
    assert len(bc_logging._secrets) == bc_logging.MAX_REGISTERED_SECRETS
    get_logger().info("x", a=f"{first} {latest}")
    line = log_lines.getvalue()
    assert latest not in line
    assert first in line  # aged out: bounded, as documented
