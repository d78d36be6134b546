"""The reference page's ``ubuntu-24.04-autoinstall`` document (the metal simulator's app has the
project's copy) is one Ubuntu's installer takes: its ``autoinstall:`` section passes Subiquity's
own published JSON schema (vendored, tests/support/schemas/SOURCES.md), and its late-commands,
run by a real shell against a target folder as Subiquity runs them against ``/target``, leave
the join token where the installed OS's bcd reads it."""

from __future__ import annotations

import json
import stat
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from better_compute.provision import render_template
from better_compute.testing.metal_sim.app import AUTOINSTALL_TEMPLATE

SCHEMA = Path(__file__).resolve().parents[1] / "support" / "schemas" / "subiquity-autoinstall-schema.json"
TOKEN = "bcjt_2b7e151628aed2a6abf7158809cf4f3c2b7e151628a"


def document() -> dict[str, object]:
    text = render_template(AUTOINSTALL_TEMPLATE, {"hostname": "node-01j0000", "joinToken": TOKEN})
    assert text.startswith("#cloud-config\n")
    doc: dict[str, object] = yaml.safe_load(text)
    return doc


def test_the_autoinstall_section_passes_subiquitys_schema() -> None:
    schema = json.loads(SCHEMA.read_text())
    section = document()["autoinstall"]
    jsonschema.validate(section, schema)  # raises, naming the path, when it does not
    identity = section["identity"]  # type: ignore[index]
    assert identity["password"].startswith("$6$")  # a crypt(3) SHA-512 hash, never a password


def test_the_schema_does_refuse_an_identity_without_username_and_password() -> None:
    schema = json.loads(SCHEMA.read_text())
    with pytest.raises(jsonschema.ValidationError, match="username"):
        jsonschema.validate({"version": 1, "identity": {"hostname": "h"}}, schema)


def test_the_late_commands_leave_the_token_for_the_installed_os(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()  # the installed system, as Subiquity mounts it: nothing of ours in it yet
    commands = document()["autoinstall"]["late-commands"]  # type: ignore[index]
    for command in commands:
        assert isinstance(command, str)
        done = subprocess.run(
            ["sh", "-ec", command.replace("/target", str(target))], capture_output=True, text=True
        )
        assert done.returncode == 0, (command.replace(TOKEN, "<token>"), done.stderr)
    token_file = target / "etc" / "bcd" / "join-token"
    assert token_file.read_text().strip() == TOKEN
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
