"""The four services as separate OS processes, seen through bcx."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import asyncpg

from better_compute.config import Settings
from better_compute.testing import ServiceProcesses, run_bcx

SERVICES = ["bc-engine", "bc-command-queue", "bc-pki", "bc-secrets"]


def settings_env(s: Settings) -> dict[str, str]:
    return {
        "BC_NATS_URL": s.nats_url or "",
        "BC_DATABASE_URL": s.database_url or "",
        "BC_SUBJECT_ROOT": s.subject_root,
    }


async def test_bcx_status_shows_the_four_services(
    bc_processes: ServiceProcesses, bc_settings: Settings
) -> None:
    for name in SERVICES:
        bc_processes.start(name)
    bc_processes.start("bc-engine")  # a second instance of one service
    await bc_processes.wait_ready()

    # --wait: a service busy starting (the second engine takes shards over) may answer $SRV.STATS
    # after bcx's default half second on a loaded machine, and would be missing from the list
    out = run_bcx(None, "status", "--json", "--wait", "3", env=settings_env(bc_settings))
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["services"]
    assert sorted(r["service"] for r in rows) == sorted([*SERVICES, "bc-engine"])
    assert {r["pid"] for r in rows} == {str(p.pid) for p in bc_processes.procs}
    assert all(r["version"] == "0.1.0" and r["uptime"] != "-" for r in rows)

    table = run_bcx(None, "status", "--wait", "3", env=settings_env(bc_settings))
    assert table.returncode == 0
    lines = table.stdout.splitlines()
    assert lines[0].split()[:3] == ["SERVICE", "INSTANCE", "VERSION"]
    assert sum(line.startswith("bc-engine ") for line in lines) == 2

    # bcx version: the client's, and each service's as its instances report it
    out = run_bcx(None, "version", "--json", "--wait", "3", env=settings_env(bc_settings))
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["client"]["version"] == "0.1.0"
    versions = {s["service"]: s["versions"] for s in doc["services"]}
    assert sorted(versions) == sorted(SERVICES)
    assert all(list(v) == ["0.1.0"] for v in versions.values())
    assert len(versions["bc-engine"]["0.1.0"]) == 2

    # each service applied its own migrations into its own schema
    conn = await asyncpg.connect(bc_settings.database_url)
    try:
        schemas = {
            r["schemaname"]
            for r in await conn.fetch(
                "SELECT schemaname FROM pg_tables WHERE tablename = 'schema_migrations'"
            )
        }
    finally:
        await conn.close()
    assert {"engine", "cmdq", "pki", "secrets"} <= schemas


async def test_bcx_version_shows_a_service_that_does_not_answer(
    bc_processes: ServiceProcesses, bc_settings: Settings
) -> None:
    bc_processes.start("bc-pki")
    await bc_processes.wait_ready()
    out = run_bcx(None, "version", env=settings_env(bc_settings))
    assert out.returncode == 1, out.stderr  # like bcx status: a known service has no instance
    rows = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()[1:]}
    assert rows["bcx"][:2] == ["(client)", "0.1.0"]
    assert rows["bc-pki"][:2] == ["0.1.0", "1"]
    for name in ("bc-engine", "bc-command-queue", "bc-secrets"):
        assert rows[name] == ["-", "not", "answering"], out.stdout


async def test_sigterm_stops_each_service_cleanly_within_5s(
    bc_processes: ServiceProcesses, bc_settings: Settings
) -> None:
    procs = [bc_processes.start(name) for name in SERVICES]
    await bc_processes.wait_ready()
    for p in procs:
        p.signal(signal.SIGTERM)
    codes = await asyncio.gather(*(p.wait_exit(5.0) for p in procs))
    assert codes == [0, 0, 0, 0], [p.output()[-2000:] for p in procs]
    for p in procs:
        assert '"event": "service_stopped"' in p.output()
    out = run_bcx(None, "status", "--json", env=settings_env(bc_settings))
    assert json.loads(out.stdout)["services"] == []


def test_a_service_without_nats_fails_with_a_clear_error(tmp_path: Path) -> None:
    env = {**os.environ, "BC_NATS_URL": "", "BC_STATE_DIR": str(tmp_path / "nothing")}
    out = subprocess.run(
        [sys.executable, "-m", "bc_pki"], capture_output=True, text=True, env=env, timeout=30
    )
    assert out.returncode == 1
    assert "UNAVAILABLE" in out.stderr + out.stdout
    assert "bcx dev up" in out.stderr + out.stdout
