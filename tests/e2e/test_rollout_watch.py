"""Live rollout progress (``bcx nodes watch``, ``bcx bulk … --watch``) as an operator sees it in a
pipe: bcx a subprocess, every service its own process, a simulated site agent answering, the
verbs mapped onto test profiles (``metal_test_app``). The view follows the nodes through their
``…ing`` state to the end and closes with a summary naming the step that failed."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from better_compute.clients import CommandQueueClient, PkiClient
from better_compute.config import Settings
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, bcx, bcx_env
from better_compute.testing.agents import SimAgent, start_sim_agent
from engine_test_app import create_tables

pytestmark = pytest.mark.e2e

BMC = {"driver": "sim", "address": "bmc-watch"}
_BMC_HOSTS = itertools.count(1)


def _bmc() -> dict[str, str]:
    """A BMC of its own for each node: one BMC, one node (issue 23)."""
    return {**BMC, "address": f"bmc-watch-{next(_BMC_HOSTS)}"}


@pytest_asyncio.fixture(loop_scope="session")
async def settings(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> AsyncIterator[Settings]:
    settings = msgspec.structs.replace(bc_settings, app="metal_test_app:app")
    bc_processes.settings = settings
    bc_processes.extra_env.update(BC_CMDQ_HEARTBEAT="200ms", BC_CMDQ_SWEEP="100ms")
    for name in ("bc-pki", "bc-command-queue", "bc-engine"):
        bc_processes.start(name)
    await bc_processes.wait_ready(timeout=60)  # a loaded machine starts four services slowly
    await create_tables(settings.database_url)
    sim: SimAgent
    sim, _agent = await start_sim_agent(
        settings, tmp_path / "agent", site_id="lab1", pki=PkiClient(bc_api), cq=CommandQueueClient(bc_api)
    )
    try:
        yield settings
    finally:
        sim.close()


async def _lines(proc: subprocess.Popen[str], until_count: int) -> list[str]:
    """The first ``until_count`` lines the process printed."""
    assert proc.stdout is not None
    return [await asyncio.to_thread(proc.stdout.readline) for _ in range(until_count)]


@pytest.mark.timeout(240)
async def test_the_watch_follows_each_node_to_its_end_and_sums_up_naming_the_failed_step(
    settings: Settings, bc_api: ApiClient
) -> None:
    ids = []
    for _ in range(3):
        node = await bc_api.call(
            "engine", "metal.enroll", {"siteId": "lab1", "labels": {"w": "1"}, "bmc": _bmc()}
        )
        ids.append(node["id"])
    watch = subprocess.Popen(  # noqa: ASYNC220 (read line by line from a thread below)
        [sys.executable, "-m", "better_compute.cli", "nodes", "watch", "--selector", "site=lab1,w=1",
         "--verb", "inspect", "--json", "--timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=bcx_env(settings),
    )  # fmt: skip
    try:
        # where each one stands first; then the operator starts the rollout
        first = [json.loads(line) for line in await _lines(watch, 3)]
        assert sorted((d["node"], d["state"]) for d in first) == sorted((i, "enrolled") for i in ids)
        for node in ids[:2]:
            await bc_api.call("engine", "metal.inspect", {"nodeId": node})
        await bc_api.call("engine", "metal.inspect", {"nodeId": ids[2], "profile": "t.failing"})
        out, err = await asyncio.to_thread(watch.communicate, timeout=90)
    finally:
        if watch.poll() is None:
            watch.kill()
    assert watch.returncode == 1, err  # one failed
    events = [json.loads(line) for line in out.splitlines()]
    *changes, last = events
    # it showed them moving, live: each was seen inspecting, with the step it ran
    assert {d["node"] for d in changes if d["state"] == "inspecting"} == set(ids)
    # (a step that fails at once may settle between two of the watch's lines: the summary below
    # names it either way)
    assert any(d["step"] for d in changes if d["state"] == "inspecting")
    summary = {r["node"]: r for r in last["summary"]}
    assert {n: r["state"] for n, r in summary.items()} == {
        ids[0]: "inspected",
        ids[1]: "inspected",
        ids[2]: "failed",
    }
    assert last["counts"] == {"inspected": 2, "failed": 1}
    failed = summary[ids[2]]
    assert failed["failedStep"] == "test.failUnlessFlag"
    assert ": " in failed["error"]  # CODE: message
    assert all(r["seconds"] is not None and r["seconds"] >= 0 for r in summary.values())
    assert (summary[ids[0]]["failedStep"], summary[ids[0]]["error"]) == (None, None)

    # bulk --watch, in a pipe: plain lines while it runs, then the summary table
    ids = []
    for _ in range(2):
        node = await bc_api.call(
            "engine", "metal.enroll", {"siteId": "lab1", "labels": {"w": "2"}, "bmc": _bmc()}
        )
        ids.append(node["id"])
    got = await bcx(settings, "bulk", "inspect", "--selector", "site=lab1,w=2", "--watch", "--timeout", "60",
                    timeout=90)  # fmt: skip
    assert got.returncode == 0, got.stdout + got.stderr
    lines = got.stdout.splitlines()
    assert "2 started, 0 refused" in lines
    # plain lines while it ran (no terminal codes in a pipe), then the summary table
    assert not any("\x1b[" in line for line in lines)
    assert any(ids[0] in line and "inspecting" in line for line in lines)
    head = lines.index(next(line for line in lines if line.startswith("NODE") and "FINAL STATE" in line))
    table: dict[str, Any] = {line.split()[0]: line.split()[1:] for line in lines[head + 1 : head + 3]}
    assert {n: row[0] for n, row in table.items()} == {ids[0]: "inspected", ids[1]: "inspected"}
    assert all(row[-1] == "-" for row in table.values())  # no failed step
    assert lines[-1].startswith("2 nodes in ")
    assert lines[-1].endswith(": 2 inspected")


@pytest.mark.timeout(180)
async def test_a_single_nodes_verb_waits_or_watches_and_a_timeout_still_sums_up(
    settings: Settings, bc_api: ApiClient
) -> None:
    ids = []
    for _ in range(2):
        node = await bc_api.call(
            "engine", "metal.enroll", {"siteId": "lab1", "labels": {"w": "3"}, "bmc": _bmc()}
        )
        ids.append(node["id"])
    # --wait: the start line, then only the summary once the node rests
    got = await bcx(settings, "inspect", ids[0], "--wait", "--timeout", "60", timeout=90)
    assert got.returncode == 0, got.stdout + got.stderr
    lines = got.stdout.splitlines()
    assert lines[0].startswith(f"{ids[0]} inspecting: workflow wf_")
    head = next(i for i, line in enumerate(lines) if line.startswith("NODE") and "FINAL STATE" in line)
    assert head == 1  # no progress lines with --wait
    assert lines[head + 1].split()[:2] == [ids[0], "inspected"]
    assert lines[-1].endswith(": 1 inspected")
    # --watch --json: the start, each change, the summary
    got = await bcx(settings, "inspect", ids[0], "--watch", "--json", "--timeout", "60", timeout=90)
    assert got.returncode == 0, got.stdout + got.stderr
    events = [json.loads(line) for line in got.stdout.splitlines()]
    assert events[0]["nodeId"] == ids[0]
    assert events[-1]["counts"] == {"inspected": 1}
    # a verb that does not end in time: its line says what bcx why says it waits for (issue 26),
    # the summary where it stands, then TIMEOUT, exit 1
    got = await bcx(
        settings, "inspect", ids[1], "--profile", "t.hold", "--watch", "--timeout", "3", timeout=60
    )
    assert got.returncode == 1
    lines = got.stdout.splitlines()
    assert any(
        line.split()[1:3] == [ids[1], "inspecting"]
        and "0 test.waitFlag (waits: the step says: the test holds it (flag hold))" in line
        for line in lines
    ), lines
    assert lines[-2].split()[:2] == [ids[1], "inspecting"]
    assert lines[-1].endswith(": 1 inspecting")
    assert got.stderr.startswith("error: TIMEOUT: the rollout did not end in 3s: 1 of 1 still moving"), (
        got.stderr
    )
