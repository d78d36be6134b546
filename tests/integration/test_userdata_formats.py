"""The built-in user-data templates pass their formats' own validators: ``cloud-init schema
--config-file`` (Debian's cloud-init) and ``ignition-validate`` (Debian's ignition), installed by
scripts/system-packages.sh. Never skipped: without the validators these tests fail."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest

from better_compute.provision import UserData, render_template, template_variables
from better_compute.provision.userdata import BUILTIN_TEMPLATES, IGNITION_VERSION

CLOUD_INIT_PYTHON = "/usr/bin/python3"  # the interpreter Debian's cloud-init runs on
SETTINGS = UserData(
    control_plane_url="https://gw.eu-1.example.com",
    bcd_url="https://downloads.example.com/bcd/0.2.0/bcd-linux-amd64",
    bcd_sha256="ab" * 32,
)
# Tokens a YAML or shell splice would trip over: quotes, a comment, a document marker, $(…).
TOKENS = [
    "bcjt_2b7e151628aed2a6abf7158809cf4f3c",
    'it\'s: a #token ---\\ "quoted" $(reboot) `id` {x} [y] & * ! % @',
    "ünïcødé-tøkën-✓",
]


def validate(argv: list[str], path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*argv, str(path)], capture_output=True, text=True, timeout=120)


def cloud_init_schema(path: Path) -> subprocess.CompletedProcess[str]:
    return validate(["cloud-init", "schema", "--config-file"], path)


def ignition_validate(path: Path) -> subprocess.CompletedProcess[str]:
    return validate(["ignition-validate"], path)


def rendered(kind: str, token: str) -> str:
    variables = template_variables(
        node_id="node_01J0000000000000000000000A", join_token=token, user_data=SETTINGS
    )
    return render_template(BUILTIN_TEMPLATES[kind], variables)


@pytest.mark.parametrize("token", TOKENS)
def test_rendered_cloud_init_passes_cloud_init_schema(tmp_path: Path, token: str) -> None:
    path = tmp_path / "user-data"
    path.write_text(rendered("cloud-init", token))
    done = cloud_init_schema(path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Valid cloud-config" in done.stdout
    # and it says what we meant: read as cloud-init reads it (PyYAML, with cloud-init's Python),
    # the token lands whole in the file bcd reads
    script = "import json, sys, yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))))"
    read = subprocess.run(
        [CLOUD_INIT_PYTHON, "-c", script, str(path)], capture_output=True, text=True, check=True
    )
    doc = json.loads(read.stdout)
    assert doc["write_files"][0] == {"path": "/etc/bcd/join-token", "permissions": "0600", "content": token}


@pytest.mark.parametrize("token", TOKENS)
def test_rendered_ignition_passes_ignition_validate(tmp_path: Path, token: str) -> None:
    path = tmp_path / "config.ign"
    path.write_text(rendered("ignition", token))
    done = ignition_validate(path)
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(path.read_text())
    assert doc["ignition"]["version"] == IGNITION_VERSION
    files = {f["path"]: f for f in doc["storage"]["files"]}
    assert unquote(files["/etc/bcd/join-token"]["contents"]["source"].removeprefix("data:,")) == token
    assert files["/etc/bcd/join-token"]["mode"] == 0o600


def test_the_validators_do_refuse_a_broken_document(tmp_path: Path) -> None:
    """These tests can fail: each validator refuses a document that is subtly wrong."""
    bad_ci = tmp_path / "bad-user-data"
    doc = json.loads(rendered("cloud-init", TOKENS[0]).split("\n", 1)[1])
    doc["write_files"][0]["permissions"] = 384  # an int where cloud-init wants an octal string
    doc["runcmd"] = "not a list"
    bad_ci.write_text("#cloud-config\n" + json.dumps(doc))
    done = cloud_init_schema(bad_ci)
    assert done.returncode != 0, done.stdout
    bad_ign = tmp_path / "bad.ign"
    doc = json.loads(rendered("ignition", TOKENS[0]))
    doc["storage"]["files"][0]["mode"] = "0644"  # a string where Ignition wants an integer
    bad_ign.write_text(json.dumps(doc))
    assert ignition_validate(bad_ign).returncode != 0
    doc["storage"]["files"][0]["mode"] = 0o644
    doc["ignition"]["version"] = "2.2.0"
    bad_ign.write_text(json.dumps(doc))
    assert ignition_validate(bad_ign).returncode != 0
