"""The engine as its own process, driven through bcx as an operator would."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import pytest

from better_compute.config import Settings
from better_compute.testing import ServiceProcesses, bcx, until
from engine_test_app import create_tables


@pytest.fixture
def settings(bc_settings: Settings) -> Settings:
    return msgspec.structs.replace(bc_settings, app="engine_test_app:app")


async def start_engine(settings: Settings, procs: ServiceProcesses) -> None:
    procs.settings = settings
    procs.start("bc-engine")
    await procs.wait_ready()
    await create_tables(settings.database_url)


def write(tmp_path: Path, name: str, doc: dict[str, Any]) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


async def test_profiles_through_bcx(
    settings: Settings, bc_processes: ServiceProcesses, tmp_path: Path
) -> None:
    await start_engine(settings, bc_processes)
    base = {"id": "web", "target": "metal", "role": "host"}
    good = write(
        tmp_path, "good.json",
        {**base, "version": 1, "steps": [
            {"use": "test.noop"},
            {"use": "netboot.clearEntry", "on": "site", "with": {"mac": "52:54:00:00:00:01"}},
        ]},
    )  # fmt: skip
    bad = write(
        tmp_path, "bad.json",
        {**base, "version": 2, "steps": [{"use": "test.nope"}, {"use": "test.waitFlag", "with": {}}]},
    )  # fmt: skip

    code, out, err = await bcx(settings, "profiles", "validate", bad)
    assert code == 1
    assert "steps[0].use" in out
    assert "steps[1].with.flag" in out

    code, out, _ = await bcx(settings, "profiles", "create", good)
    assert (code, out.strip()) == (0, "stored web version 1 for tenant root")
    code, out, _ = await bcx(settings, "profiles", "render", "--id", "web")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["#", "ACTION", "ON", "MODE"]
    assert "driver.invoke" in lines[2]
    code, out, _ = await bcx(settings, "profiles", "list", "--json")
    ids = {(p["id"], p["tenantId"]) for p in json.loads(out)["profiles"]}
    assert {("web", "root"), ("test-chain", "builtin")} <= ids

    code, out, err = await bcx(settings, "profiles", "create", good)
    assert code == 1
    assert "error: CONFLICT" in err
    code, out, _ = await bcx(settings, "profiles", "create", good, "--json")
    assert json.loads(out)["error"]["details"]["path"] == "document.version"

    # what a profile's use can name, with its inputs (issue 10 item 10)
    code, out, err = await bcx(settings, "steps", "list")
    assert code == 0, err
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "flag*" in rows["test.waitFlag"]
    assert "action*: on|off|softOff|cycle|reset" in rows["power.setPower"]
    assert "site (driver)" in rows["media.eject"]


async def test_nodes_update_label_delete_through_bcx(
    settings: Settings, bc_processes: ServiceProcesses
) -> None:
    await start_engine(settings, bc_processes)
    code, out, err = await bcx(settings, "nodes", "create", "--site", "lab1", "--label", "rack=4")
    assert code == 0, err
    node = out.strip()
    code, out, err = await bcx(settings, "nodes", "update", node, "--site", "lab2", "--json")
    assert code == 0, err
    assert (json.loads(out)["siteId"], json.loads(out)["labels"]) == ("lab2", {"rack": "4"})
    code, out, err = await bcx(settings, "nodes", "label", node, "gpu=h100", "rack-", "--json")
    assert code == 0, err
    assert json.loads(out)["labels"] == {"gpu": "h100"}
    code, out, err = await bcx(settings, "nodes", "update", node, "--site", "lab 1!")
    assert code == 1
    assert "INVALID_INPUT" in err
    code, out, err = await bcx(settings, "nodes", "delete", node)
    assert (code, out.strip()) == (0, f"deleted {node}")
    code, out, err = await bcx(settings, "nodes", "get", node)
    assert code == 1
    assert "NOT_FOUND" in err


async def test_workflows_through_bcx(
    settings: Settings, bc_processes: ServiceProcesses, tmp_path: Path
) -> None:
    await start_engine(settings, bc_processes)
    code, node, _ = await bcx(settings, "nodes", "create", "--site", "eu1", "--label", "rack=r7")
    node = node.strip()
    assert code == 0
    assert node.startswith("node_")

    # start --wait shows each step as it happens and exits 0 on success
    code, out, err = await bcx(
        settings, "workflows", "start", "--profile", "test-chain", "--node", node, "--wait"
    )
    assert code == 0, err
    lines = out.splitlines()
    assert sum(" succeeded " in line for line in lines) == 6
    assert lines[-1].endswith("succeeded")

    # a failing workflow: watch --json prints one event a line and exits 1
    doc = {"id": "flaky", "version": 1, "target": "metal", "role": "host",
           "steps": [{"use": "test.failUnlessFlag", "with": {"flag": "ok"}}]}  # fmt: skip
    await bcx(settings, "profiles", "create", write(tmp_path, "flaky.json", doc))
    code, out, _ = await bcx(settings, "workflows", "start", "--profile", "flaky", "--json")
    wf_id = json.loads(out)["id"]
    code, out, _ = await bcx(settings, "workflows", "watch", wf_id, "--json")
    assert code == 1
    events = [json.loads(line) for line in out.splitlines()]
    assert events[-1] == {"workflowId": wf_id, "workflowState": "failed"}
    assert any(e.get("step", {}).get("state") == "failed" for e in events)

    conn = await asyncpg.connect(settings.database_url)
    try:
        await conn.execute("INSERT INTO public.plg_test_flags VALUES ('ok')")
    finally:
        await conn.close()
    code, out, _ = await bcx(settings, "workflows", "retry", wf_id)
    assert (code, out.strip()) == (0, f"{wf_id} is running")
    code, out, _ = await bcx(settings, "workflows", "watch", wf_id)
    assert code == 0
    code, out, _ = await bcx(settings, "workflows", "get", wf_id)
    assert "attempt" not in out.splitlines()[0]
    assert out.splitlines()[2].split()[:4] == ["0", "test.failUnlessFlag", "succeeded", "2"]

    code, out, _ = await bcx(settings, "workflows", "list", "--node", node)
    assert len(out.splitlines()) == 2  # header and the one workflow of that node
    code, out, _ = await bcx(settings, "workflows", "list", "--state", "succeeded", "--json")
    assert len(json.loads(out)["workflows"]) == 2

    code, _out, err = await bcx(settings, "workflows", "abort", wf_id)
    assert code == 1
    assert "INVALID_STATE" in err


async def test_an_aborted_workflow_says_where_it_stopped_and_what_to_do_next(
    settings: Settings, bc_processes: ServiceProcesses, tmp_path: Path
) -> None:
    """Issue 26: the abort reads as a sentence naming the step and the way on (resume), never
    ``INVALID_STATE: wrong image, stop``; seen failing on the old wording."""
    await start_engine(settings, bc_processes)
    doc = {"id": "held", "version": 1, "target": "metal", "role": "host",
           "steps": [{"use": "test.noop"}, {"use": "test.waitFlag", "with": {"flag": "never"}}]}  # fmt: skip
    await bcx(settings, "profiles", "create", write(tmp_path, "held.json", doc))
    code, out, err = await bcx(settings, "workflows", "start", "--profile", "held")
    assert code == 0, err
    wf_id = out.strip()

    async def waiting() -> bool:
        got = json.loads((await bcx(settings, "workflows", "get", wf_id, "--json")).stdout)
        return bool(got["steps"][1]["state"] == "running")

    await until(waiting, what="the second step running")
    code, out, err = await bcx(settings, "workflows", "abort", wf_id, "--reason", "wrong image, stop")
    assert code == 0, err
    assert out.strip() == (
        f"{wf_id} aborted at step 1 (test.waitFlag): wrong image, stop;"
        f" to carry on from that step: bcx workflows resume {wf_id}"
    )
    code, out, _ = await bcx(settings, "workflows", "get", wf_id)
    assert out.splitlines()[1] == (
        "aborted by an operator at step 1 (test.waitFlag): wrong image, stop;"
        f" to carry on from that step: bcx workflows resume {wf_id}"
    )
    assert "INVALID_STATE" not in out.splitlines()[1]
    code, _out, err = await bcx(settings, "workflows", "retry", wf_id)
    assert code == 1
    assert "resume" in err
