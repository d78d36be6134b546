"""The test OS image's cloud-init subset, run by the host's busybox exactly as the image runs it:
the JSON reader on the project's own rendered cloud-init template, write_files and runcmd, the
curl shim over busybox wget, and what it refuses."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from better_compute.provision.templates import template_variables
from better_compute.provision.userdata import cloud_init
from better_compute.runtime.os_image_init import CLOUD_INIT, CURL, JSON_AWK

pytestmark = pytest.mark.integration

BUSYBOX = "/bin/busybox"
APPLETS = ("sh", "awk", "cut", "sort", "grep", "head", "printf", "mkdir", "chmod", "dirname", "wget",
           "sha256sum", "cat", "echo", "umask")  # fmt: skip


@pytest.fixture
def box(tmp_path: Path) -> Path:
    """A bin folder of busybox applets, the scripts beside. (busybox sh runs its own applets
    before PATH, so nothing here may call one that changes the host: with $BC_CLOUD_ROOT set,
    bc-cloud-init writes the hostname under it and leaves the host's alone.)"""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for applet in APPLETS:
        (bin_dir / applet).symlink_to(BUSYBOX)
    for name, text in (("bc-cloud-init", CLOUD_INIT), ("curl", CURL)):
        (bin_dir / name).write_text(text)
    (tmp_path / "json.awk").write_text(JSON_AWK)
    for f in bin_dir.iterdir():
        if not f.is_symlink():
            f.chmod(0o755)
    return tmp_path


def run(box: Path, *argv: str, root: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": str(box / "bin"), "BC_CLOUD_AWK": str(box / "json.awk"), "BC_CLOUD_ROOT": str(root or "")}
    return subprocess.run([BUSYBOX, "sh", *argv], env=env, capture_output=True, text=True, timeout=60)


def flat(doc: Any, path: str = "") -> dict[str, str]:
    """What json.awk prints, computed from Python's json: PATH -> the value as printf %b reads it."""
    if isinstance(doc, dict):
        return {
            k: v for key, item in doc.items() for k, v in flat(item, f"{path}.{key}" if path else key).items()
        }
    if isinstance(doc, list):
        return {
            k: v
            for i, item in enumerate(doc)
            for k, v in flat(item, f"{path}.{i}" if path else str(i)).items()
        }
    return {path: json.dumps(doc) if not isinstance(doc, str) else doc}


def decode(value: str) -> str:
    return subprocess.run([BUSYBOX, "printf", "%b", value], capture_output=True, check=True).stdout.decode()


def test_json_awk_reads_the_projects_cloud_init_template(box: Path) -> None:
    variables = template_variables(node_id="node_01ABC", join_token="bcjt_" + "x" * 43, user_data=None)
    doc = cloud_init({**{k: v or "" for k, v in variables.items()},
                      "bcdUrl": "http://10.0.2.2:8080/b'cd", "bcdSha256": "ab" * 32,
                      "controlPlaneUrl": "nats://10.0.2.2:4222"})  # fmt: skip
    (box / "ud").write_text(doc)
    got = run(box, "-c", f"awk -f {box}/json.awk {box}/ud")
    assert got.returncode == 0, got.stderr
    lines = dict(line.split("\t", 1) for line in got.stdout.splitlines())
    expected = flat(json.loads(doc.split("\n", 1)[1]))
    assert lines.keys() == expected.keys()
    assert {k: decode(v) for k, v in lines.items()} == expected


def test_strings_with_escapes_unicode_and_percent_signs_come_out_byte_for_byte(box: Path) -> None:
    value = 'a "quoted" \\ back\\nslash\n\ttab % %s %b \\c ünï €\x01'
    (box / "ud").write_text("#cloud-config\n" + json.dumps({"k": [value, 12, True, None]}))
    got = run(box, "-c", f"awk -f {box}/json.awk {box}/ud")
    assert got.returncode == 0, got.stderr
    lines = dict(line.split("\t", 1) for line in got.stdout.splitlines())
    assert decode(lines["k.0"]) == value
    assert [lines["k.1"], lines["k.2"], lines["k.3"]] == ["12", "true", "null"]
    for bad in ('{"a": 1,}', '{"a": "open', '{"a": tru}', "[1] 2"):
        (box / "ud").write_text("#cloud-config\n" + bad)
        assert run(box, "-c", f"awk -f {box}/json.awk {box}/ud").returncode == 1, bad


def test_write_files_then_runcmd(box: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    content = "token\nwith 'quotes' and \\ and %d\n"
    doc = {
        "hostname": "node-01abc",
        "write_files": [{"path": "/etc/bcd/join-token", "permissions": "0600", "content": content},
                        {"path": "/etc/motd", "content": "hi"}],
        "runcmd": [f"echo one >> {tmp_path}/ran",
                   f"test -f {root}/etc/bcd/join-token && echo two >> {tmp_path}/ran"],
    }  # fmt: skip
    (box / "ud").write_text("#cloud-config\n" + json.dumps(doc, indent=2) + "\n")
    got = run(box, str(box / "bin/bc-cloud-init"), str(box / "ud"), root=root)
    assert got.returncode == 0, got.stderr
    token = root / "etc/bcd/join-token"
    assert token.read_text() == content
    assert oct(token.stat().st_mode & 0o777) == "0o600"
    assert oct((root / "etc/motd").stat().st_mode & 0o777) == "0o644"
    assert (tmp_path / "ran").read_text() == "one\ntwo\n"
    assert (root / "etc/hostname").read_text() == "node-01abc\n"


@pytest.mark.parametrize(
    ("doc", "said"),
    [
        ("#cloud-config\npackages: [curl]\n", "only JSON cloud-config"),
        ('#cloud-config\n{"packages": ["curl"]}\n', "module packages is not supported"),
        (
            '#cloud-config\n{"write_files": [{"path": "/x", "encoding": "b64", "content": "eA=="}]}',
            "encoding",
        ),
        ('#cloud-config\n{"runcmd": ["false", "echo never"]}', "runcmd 0 failed"),
        ("#!/bin/sh\necho hi\n", "not #cloud-config"),
    ],
)
def test_what_it_does_not_implement_is_refused(box: Path, tmp_path: Path, doc: str, said: str) -> None:
    (box / "ud").write_text(doc)
    got = run(box, str(box / "bin/bc-cloud-init"), str(box / "ud"), root=tmp_path / "root")
    assert got.returncode != 0
    assert said in got.stderr


@pytest.fixture
def served(tmp_path: Path) -> Iterator[str]:
    (tmp_path / "www").mkdir()
    (tmp_path / "www/bcd").write_bytes(b"#!/bin/sh\necho bcd\n")
    handler = type("Quiet", (http.server.SimpleHTTPRequestHandler,), {"log_message": lambda *a: None})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), lambda *a: handler(*a, directory=str(tmp_path / "www"))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_templates_download_lines_run_with_the_curl_shim(box: Path, tmp_path: Path, served: str) -> None:
    out = tmp_path / "bcd"
    sha = hashlib.sha256(b"#!/bin/sh\necho bcd\n").hexdigest()
    lines = f"curl -fsSL -o {out} '{served}/bcd' && echo '{sha}  {out}' | sha256sum -c - && chmod 0755 {out}"
    got = run(box, "-c", lines)
    assert got.returncode == 0, got.stderr
    assert os.access(out, os.X_OK)
    missing = run(box, "-c", f"curl -fsSL -o {tmp_path}/nope '{served}/nope'")
    assert missing.returncode != 0
    assert shutil.which("wget", path=str(box / "bin"))
