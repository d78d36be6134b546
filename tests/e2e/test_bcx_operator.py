"""bcx as a new operator meets it (issue 10 item 9): bcx is a subprocess, every service its own
process on a real nats-server and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import pytest

from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.pki import PkiClient
from better_compute.config import Settings
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, bcx, bcx_env, until
from better_compute.testing.agents import SimAgent, start_sim_agent
from engine_test_app import create_tables

ISO = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"


async def ok_json(settings: Settings, *args: str) -> Any:
    out = await bcx(settings, *args, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


async def set_flag(settings: Settings, flag: str) -> None:
    conn = await asyncpg.connect(settings.database_url)
    try:
        await conn.execute("INSERT INTO public.plg_test_flags VALUES ($1)", flag)
    finally:
        await conn.close()


@pytest.fixture
def settings(bc_settings: Settings) -> Settings:
    return msgspec.structs.replace(bc_settings, app="engine_test_app:app")


@pytest.fixture
async def engine(settings: Settings, bc_processes: ServiceProcesses) -> ServiceProcesses:
    bc_processes.settings = settings
    bc_processes.start("bc-engine")
    await bc_processes.wait_ready()
    await create_tables(settings.database_url)
    return bc_processes


async def create_profile(settings: Settings, tmp_path: Path, pid: str, steps: list[Any]) -> None:
    path = tmp_path / f"{pid}.json"
    path.write_text(json.dumps({"id": pid, "version": 1, "target": "metal", "role": "host", "steps": steps}))
    out = await bcx(settings, "profiles", "create", str(path))
    assert out.returncode == 0, out.stderr


async def test_global_flags_anywhere_and_iso_times(settings: Settings, engine: ServiceProcesses) -> None:
    node = (await bcx(settings, "nodes", "create", "--site", "eu1")).stdout.strip()
    for argv in (["--json", "nodes", "list"], ["nodes", "list", "--json"], ["nodes", "--json", "list"]):
        out = await bcx(settings, *argv)
        assert out.returncode == 0, (argv, out.stderr)
        assert [n["id"] for n in json.loads(out.stdout)["nodes"]] == [node]
    # --nats-url before the command wins over the environment's
    out = await bcx(
        settings,
        "--nats-url",
        settings.nats_url or "",
        "nodes",
        "list",
        env={"BC_NATS_URL": "nats://127.0.0.1:1"},
    )
    assert out.returncode == 0, out.stderr
    assert node in out.stdout

    wf = await ok_json(settings, "workflows", "start", "--profile", "test-chain", "--node", node)
    await until(lambda: _finished(settings, wf["id"]))
    got = await ok_json(settings, "workflows", "get", wf["id"])
    assert re.fullmatch(ISO, got["createdAt"]), got["createdAt"]
    assert re.fullmatch(ISO, got["finishedAt"])
    assert all(re.fullmatch(ISO, s["startedAt"]) for s in got["steps"])
    table = (await bcx(settings, "workflows", "get", wf["id"])).stdout.splitlines()
    assert re.search(rf"\bsucceeded\s+1\s+{ISO}\b", table[2]), table[2]
    listed = (await bcx(settings, "workflows", "list")).stdout.splitlines()
    assert re.search(rf"{ISO}$", listed[1]), listed[1]
    status = await ok_json(settings, "status", "--service", "bc-engine")
    assert re.fullmatch(ISO, status["services"][0]["started"])


async def _finished(settings: Settings, wf_id: str) -> bool:
    return (await ok_json(settings, "workflows", "get", wf_id))["state"] == "succeeded"


async def test_wait_on_start_retry_and_resume(
    settings: Settings, engine: ServiceProcesses, tmp_path: Path
) -> None:
    out = await bcx(settings, "workflows", "start", "--profile", "test-chain", "--wait")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert re.fullmatch(r"wf_\w+", lines[0]), lines[0]  # the id first, then the live step lines
    assert re.match(rf"{ISO}  step +0 ", lines[1]), lines[1]
    assert lines[-1] == f"workflow {lines[0]} succeeded"

    await create_profile(
        settings, tmp_path, "flaky", [{"use": "test.failUnlessFlag", "with": {"flag": "ok"}}]
    )
    wf = await ok_json(settings, "workflows", "start", "--profile", "flaky")
    assert (await bcx(settings, "workflows", "watch", wf["id"])).returncode == 1
    await set_flag(settings, "ok")
    out = await bcx(settings, "workflows", "retry", wf["id"], "--wait")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"{wf['id']} is running"
    assert re.search(r"step +0 test.failUnlessFlag +succeeded +attempt 2", out.stdout), out.stdout
    assert lines[-1] == f"workflow {wf['id']} succeeded"

    await create_profile(
        settings, tmp_path, "held", [{"use": "test.waitFlag", "with": {"flag": "go", "pollMs": 50}}]
    )
    wf = await ok_json(settings, "workflows", "start", "--profile", "held")
    assert (await bcx(settings, "workflows", "abort", wf["id"])).returncode == 0
    await set_flag(settings, "go")
    out = await bcx(settings, "workflows", "resume", wf["id"], "--wait", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines()]
    assert events[0]["id"] == wf["id"]  # what resume answered, then the live events
    assert any(e.get("step", {}).get("state") == "succeeded" for e in events)
    assert events[-1] == {"workflowId": wf["id"], "workflowState": "succeeded"}


async def test_watch_into_a_closed_pipe_ends_quietly(
    settings: Settings, engine: ServiceProcesses, tmp_path: Path
) -> None:
    await create_profile(
        settings, tmp_path, "held", [{"use": "test.waitFlag", "with": {"flag": "pipe", "pollMs": 50}}]
    )
    wf = await ok_json(settings, "workflows", "start", "--profile", "held")
    # `bcx workflows watch --json | head -1`: the reader goes away after one line
    read_end, write_end = os.pipe()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "better_compute.cli", "workflows", "watch", wf["id"], "--json",
        stdout=write_end, stderr=asyncio.subprocess.PIPE, env=bcx_env(settings),
    )  # fmt: skip
    os.close(write_end)
    try:
        with os.fdopen(read_end, "rb") as reader:
            first = await asyncio.to_thread(reader.readline)
        assert json.loads(first)["workflowId"] == wf["id"]
        await set_flag(settings, "pipe")  # the next step line meets the closed pipe
        _, stderr = await asyncio.wait_for(proc.communicate(), 60)
        code, err = proc.returncode, stderr.decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert code in (0, 141), err
    assert err == ""


async def test_status_fails_naming_the_services_that_do_not_answer(
    bc_settings: Settings, bc_processes: ServiceProcesses
) -> None:
    bc_processes.start("bc-pki")
    await bc_processes.wait_ready()
    out = await bcx(bc_settings, "status")
    assert out.returncode == 1, out.stdout
    assert "bc-pki" in out.stdout
    for name in ("bc-engine", "bc-command-queue", "bc-secrets"):
        assert name in out.stderr
    assert "bc-pki" not in out.stderr
    js = await bcx(bc_settings, "status", "--json")
    assert js.returncode == 1
    assert json.loads(js.stdout)["missing"] == ["bc-engine", "bc-command-queue", "bc-secrets"]
    only = await bcx(bc_settings, "status", "--service", "bc-pki")
    assert only.returncode == 0, only.stderr


async def test_a_revoked_agent_shows_as_revoked(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> None:
    bc_processes.extra_env.update(BC_CMDQ_HEARTBEAT="200ms", BC_CMDQ_SWEEP="100ms")
    bc_processes.start("bc-pki")
    bc_processes.start("bc-command-queue")
    await bc_processes.wait_ready()
    cq = CommandQueueClient(bc_api, timeout=3.0)
    sim: SimAgent | None = None
    try:
        sim, agent_id = await start_sim_agent(
            bc_settings, tmp_path / "agent", site_id="lab1", pki=PkiClient(bc_api), cq=cq
        )
        listed = await ok_json(bc_settings, "agents", "list")
        (agent,) = listed["agents"]
        assert agent["certState"] == "valid"
        assert re.fullmatch(ISO, agent["lastSeen"])
        revoke = await bcx(bc_settings, "certs", "revoke", agent["certId"], "--reason", "stolen laptop")
        assert revoke.returncode == 0, revoke.stderr
        table = (await bcx(bc_settings, "agents", "list")).stdout.splitlines()
        assert "CERT" in table[0].split()
        assert re.search(rf"^{agent_id}\s.*\brevoked\b", table[1]), table
        listed = await ok_json(bc_settings, "agents", "list")
        assert listed["agents"][0]["certState"] == "revoked"
    finally:
        if sim is not None:
            sim.close()


def test_dev_up_names_the_log_of_a_service_that_fails_at_start(tmp_path: Path) -> None:
    state = tmp_path / "dev"
    env = {k: v for k, v in os.environ.items() if k not in ("BC_NATS_URL", "BC_DATABASE_URL")}
    env.update(BC_STATE_DIR=str(state), BC_APP="no_such_plugin_module:app")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "better_compute.cli", *args],
            capture_output=True, text=True, env=env, timeout=180,
        )  # fmt: skip

    try:
        t0 = time.monotonic()
        up = run("dev", "up", "--service", "bc-engine", "--timeout", "60")
        took = time.monotonic() - t0
        assert up.returncode == 1, up.stdout + up.stderr
        log = state.resolve() / "logs" / "bc-engine-1.log"
        assert str(log) in up.stderr
        assert "no_such_plugin_module" in up.stderr  # the log's last lines, shown
        assert "Traceback" not in up.stderr.split(str(log))[0]  # bcx itself did not crash
        assert took < 45, f"took {took:.1f}s: it waited for the timeout"
    finally:
        run("dev", "down")
