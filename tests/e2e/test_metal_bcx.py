"""bcx metal: enroll with a BMC credential from a file (stored through bc-secrets, never echoed),
nodes show, the verbs and bulk; bcx a subprocess, every service its own process."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest_asyncio
from test_bcx_operator import bcx, ok_json

from better_compute.clients import CommandQueueClient, EngineClient, PkiClient, SecretsClient
from better_compute.config import Settings
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, bcx_env, until
from better_compute.testing.agents import SimAgent, start_sim_agent
from better_compute.testing.images import register_sim_image
from engine_test_app import create_tables

PASSWORD = "pw-Zq8-never-shown"


@pytest_asyncio.fixture(loop_scope="session")
async def settings(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> AsyncIterator[Settings]:
    settings = msgspec.structs.replace(bc_settings, app="metal_test_app:app")
    bc_processes.settings = settings
    bc_processes.extra_env.update(BC_CMDQ_HEARTBEAT="200ms", BC_CMDQ_SWEEP="100ms")
    for name in ("bc-pki", "bc-secrets", "bc-command-queue", "bc-engine"):
        bc_processes.start(name)
    await bc_processes.wait_ready()
    await create_tables(settings.database_url)
    await register_sim_image(EngineClient(bc_api))  # the image the deploys name
    sim: SimAgent
    sim, _agent = await start_sim_agent(
        settings, tmp_path / "agent", site_id="lab1", pki=PkiClient(bc_api), cq=CommandQueueClient(bc_api)
    )
    try:
        yield settings
    finally:
        sim.close()


async def _state(api: ApiClient, node: str, state: str) -> bool:
    doc = await api.call("engine", "nodes.get", {"id": node})
    assert doc["state"] != "failed", doc["stateReason"]
    return bool(doc["state"] == state)


async def test_enroll_reads_the_credential_from_a_file_and_never_echoes_it(
    settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> None:
    creds = tmp_path / "bmc.json"
    creds.write_text(json.dumps({"username": "admin", "password": PASSWORD}))
    bmc = "redfish://10.9.8.7:8443/redfish/v1/Systems/1"
    out = await bcx(settings, "nodes", "enroll", "--site", "lab1", "--mac", "52:54:00:12:34:56",
                    "--label", "rack=r1", "--bmc", bmc, "--bmc-credentials-file", str(creds))  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert PASSWORD not in out.stdout + out.stderr
    node = re.match(r"^(node_\w+) enrolled  site lab1$", out.stdout.splitlines()[0])
    assert node is not None, out.stdout
    assert re.search(r"bmc redfish https://10\.9\.8\.7:8443 \(sec_\w+\)", out.stdout), out.stdout

    doc = await ok_json(settings, "nodes", "show", node[1])
    ref = doc["bmc"]["credentialsRef"]
    assert doc["bmc"] == {
        "driver": "redfish",
        "address": "https://10.9.8.7:8443",
        "systemId": "/redfish/v1/Systems/1",
        "credentialsRef": ref,
        "insecure": False,
    }
    # stored through bc-secrets as the node's own secret: the value the site agent will read
    assert json.loads(await SecretsClient(bc_api).get(ref=ref)) == {"username": "admin", "password": PASSWORD}

    shown = await bcx(settings, "nodes", "show", node[1])
    assert "state       enrolled" in shown.stdout
    assert "bmc         redfish https://10.9.8.7:8443 /redfish/v1/Systems/1" in shown.stdout

    # a wrong password is fixed in place: a new credential for the same BMC, then a new BMC
    creds.write_text(json.dumps({"username": "admin", "password": PASSWORD + "-2"}))
    fixed = await bcx(settings, "nodes", "update", node[1], "--bmc-credentials-file", str(creds))
    assert fixed.returncode == 0, fixed.stderr
    assert PASSWORD not in fixed.stdout + fixed.stderr
    doc = await ok_json(settings, "nodes", "get", node[1])
    assert doc["bmc"]["address"] == "https://10.9.8.7:8443"  # the same BMC
    assert doc["bmc"]["systemId"] == "/redfish/v1/Systems/1"
    assert doc["bmc"]["credentialsRef"] != ref
    got = json.loads(await SecretsClient(bc_api).get(ref=doc["bmc"]["credentialsRef"]))
    assert got["password"] == PASSWORD + "-2"
    moved = await bcx(settings, "nodes", "update", node[1], "--bmc", "ipmi://10.9.8.8:623",
                      "--bmc-credentials-file", str(creds))  # fmt: skip
    assert moved.returncode == 0, moved.stderr
    assert re.search(r"bmc ipmi 10\.9\.8\.8:623 \(sec_\w+\)", moved.stdout), moved.stdout
    assert (await ok_json(settings, "nodes", "get", node[1]))["bmc"]["driver"] == "ipmi"
    nothing = await bcx(settings, "nodes", "update", node[1])
    assert nothing.returncode == 1
    assert "INVALID_INPUT" in nothing.stderr
    # a credential inside the URL is refused, and not repeated back either
    inline = f"redfish://admin:{PASSWORD}@10.0.0.1"
    bad = await bcx(settings, "nodes", "enroll", "--site", "lab1", "--bmc", inline)
    assert bad.returncode != 0
    assert "INVALID_INPUT" in bad.stderr
    assert PASSWORD not in bad.stdout + bad.stderr
    for proc in bc_processes.procs:
        assert PASSWORD not in proc.output(), proc.instance


async def test_verbs_show_and_bulk_through_bcx(settings: Settings, bc_api: ApiClient) -> None:
    made = await ok_json(settings, "nodes", "enroll", "--site", "lab1", "--bmc", "sim://bmc-1",
                         "--label", "rack=r2")  # fmt: skip
    node = made["id"]
    refused = await bcx(settings, "deploy", node, "--image", "ubuntu@24.04")
    assert refused.returncode != 0
    assert f"node {node} is enrolled; deploy needs ready" in refused.stderr

    out = await bcx(settings, "inspect", node)
    assert out.returncode == 0, out.stderr
    assert re.match(rf"^{node} inspecting: workflow wf_\w+ \(t\.inspect@1\)$", out.stdout.strip())
    await until(lambda: _state(bc_api, node, "inspected"))
    assert (await bcx(settings, "commission", node)).returncode == 0
    await until(lambda: _state(bc_api, node, "ready"))
    started = await ok_json(settings, "deploy", node, "--image", "ubuntu@24.04")
    assert started["state"] == "deploying"
    await until(lambda: _state(bc_api, node, "deployed"))
    shown = (await bcx(settings, "nodes", "show", node)).stdout
    for line in ("state       deployed", "power       on", "image       ubuntu@24.04", "host        sysctl",
                 "generation  2 (observed 1)"):  # fmt: skip
        assert line in shown, shown

    others = [(await ok_json(settings, "nodes", "enroll", "--site", "lab1", "--label", "rack=r2"))["id"]
              for _ in range(2)]  # fmt: skip
    bulk = await bcx(settings, "bulk", "adopt", "--selector", "site=lab1,rack=r2")
    assert bulk.returncode == 0, bulk.stderr
    assert "2 started, 1 refused" in bulk.stdout
    assert f"node {node} is deployed; adopt needs" in bulk.stdout
    for other in others:
        await until(lambda other=other: _state(bc_api, other, "deployed"))  # type: ignore[misc]
    as_json = await ok_json(settings, "bulk", "release", "--node", others[0], "--node", node)
    assert sorted(s["nodeId"] for s in as_json["started"]) == sorted([others[0], node])


async def test_a_node_in_maintenance_runs_nothing_and_bulk_skips_it(
    settings: Settings, bc_api: ApiClient
) -> None:
    """Issue 26: ``bcx nodes maintenance on|off``: no verb or workflow starts on the node, a bulk
    skips it and says so, list and show show it, the audit names who set it."""
    held, free = [
        (await ok_json(settings, "nodes", "enroll", "--site", "lab1", "--label", "rack=r26"))["id"]
        for _ in range(2)
    ]
    on = await bcx(
        settings, "nodes", "maintenance", "on", held, "--reason", "PSU swap", env={"BC_ACTOR": "ann@ops"}
    )
    assert on.returncode == 0, on.stderr
    assert on.stdout.strip() == f"{held} in maintenance: PSU swap (set by ann@ops)"
    doc = await ok_json(settings, "nodes", "show", held)
    assert (doc["maintenance"]["reason"], doc["maintenance"]["by"]) == ("PSU swap", "ann@ops")
    shown = (await bcx(settings, "nodes", "show", held)).stdout
    assert "maintenance PSU swap (set by ann@ops" in shown, shown
    listed = (await bcx(settings, "nodes", "list", "--selector", "rack=r26")).stdout
    assert "enrolled (maintenance)" in listed, listed

    refused = await bcx(settings, "inspect", held, "--json")
    assert refused.returncode != 0
    err = json.loads(refused.stdout)["error"]
    assert (err["code"], err["details"]["reason"], err["details"]["path"]) == (
        "INVALID_STATE", "node-in-maintenance", "nodeId",
    )  # fmt: skip
    assert f"node {held} is in maintenance: PSU swap" in err["message"]
    started = await bcx(settings, "workflows", "start", "--profile", "t.inspect", "--node", held, "--json")
    assert started.returncode != 0
    assert json.loads(started.stdout)["error"]["details"]["reason"] == "node-in-maintenance"

    bulk = await ok_json(settings, "bulk", "inspect", "--selector", "site=lab1,rack=r26")
    assert [s["nodeId"] for s in bulk["started"]] == [free]
    assert [(r["nodeId"], r["reason"]) for r in bulk["refused"]] == [(held, "node-in-maintenance")]

    off = await bcx(settings, "nodes", "maintenance", "off", held)
    assert off.returncode == 0, off.stderr
    assert (await ok_json(settings, "nodes", "show", held))["maintenance"] is None
    assert (await bcx(settings, "inspect", held)).returncode == 0

    audit = await ok_json(settings, "audit", "--who", "ann@ops")
    got = [(e["action"], e["target"]) for e in audit["entries"]]
    assert ("nodes.maintenance", held) in got, got


def _error(out: Any) -> dict[str, Any]:
    assert out.returncode != 0, out.stdout
    err: dict[str, Any] = json.loads(out.stdout)["error"]
    return err


async def test_a_node_name_is_unique_in_its_site_shown_and_taken_for_the_id(
    settings: Settings, bc_api: ApiClient
) -> None:
    """Issue 26: ``--name`` at enroll and on ``nodes update``, unique per site (CONFLICT at
    ``name``), shown by list, show, the verb and its watch, why; bcx takes it for the id."""
    made = await ok_json(settings, "nodes", "enroll", "--site", "lab1", "--name", "lab1-m001",
                         "--bmc", "sim://bmc-n1", "--label", "rack=rn", "--no-validate")  # fmt: skip
    node = made["id"]
    assert made["name"] == "lab1-m001"
    err = _error(await bcx(settings, "nodes", "enroll", "--site", "lab1", "--name", "lab1-m001", "--json"))
    assert (err["code"], err["details"]["path"], err["details"]["nodeId"]) == ("CONFLICT", "name", node)
    err = _error(await bcx(settings, "nodes", "enroll", "--site", "lab1", "--name", "Bad_Name", "--json"))
    assert (err["code"], err["details"]["path"]) == ("INVALID_INPUT", "name")

    listed = (await bcx(settings, "nodes", "list", "--selector", "rack=rn")).stdout.splitlines()
    assert listed[0].split()[:4] == ["NODE", "NAME", "SITE", "STATE"], listed
    assert listed[1].split()[:4] == [node, "lab1-m001", "lab1", "enrolled"], listed
    shown = await bcx(settings, "nodes", "show", "lab1-m001")
    assert shown.returncode == 0, shown.stderr
    assert f"node        {node}" in shown.stdout
    assert "name        lab1-m001" in shown.stdout

    # a lifecycle verb by name, waited for: its lines and summary name the node
    out = await bcx(settings, "inspect", "lab1-m001", "--wait", "--timeout", "60")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith(f"{node} (lab1-m001) inspecting: workflow wf_"), out.stdout
    summary = next(line for line in out.stdout.splitlines() if line.startswith("lab1-m001 "))
    assert summary.split()[1] == "inspected", out.stdout
    why = await bcx(settings, "why", "lab1-m001")
    assert why.stdout.startswith(f"node {node} (lab1-m001)  workflow wf_"), why.stdout

    # renamed: the old name names nothing; another site may use a name, then site/name picks
    renamed = await bcx(settings, "nodes", "update", "lab1-m001", "--name", "m9")
    assert renamed.returncode == 0, renamed.stderr
    assert renamed.stdout.startswith(f"{node}  name m9  site lab1"), renamed.stdout
    err = _error(await bcx(settings, "nodes", "show", "lab1-m001", "--json"))
    assert (err["code"], err["details"]["path"]) == ("NOT_FOUND", "id")
    other = (await bc_api.call("engine", "metal.enroll", {"siteId": "lab2", "name": "m9"}))["id"]
    err = _error(await bcx(settings, "nodes", "show", "m9", "--json"))
    assert (err["code"], err["details"]["reason"]) == ("INVALID_INPUT", "ambiguous-name")
    assert "lab1/m9" in err["message"]
    assert (await ok_json(settings, "nodes", "show", "lab2/m9"))["id"] == other
    # moved into a site where the name is taken: refused, nothing changed
    err = _error(await bcx(settings, "nodes", "update", "lab2/m9", "--site", "lab1", "--json"))
    assert (err["code"], err["details"]["path"]) == ("CONFLICT", "name")
    assert (await bc_api.call("engine", "nodes.get", {"id": other}))["siteId"] == "lab2"
    cleared = await ok_json(settings, "nodes", "update", "lab2/m9", "--no-name")
    assert cleared["name"] is None
    assert (await ok_json(settings, "nodes", "show", "m9"))["id"] == node


async def test_power_and_boot_device_are_audited_workflows_that_leave_the_state(
    settings: Settings, bc_api: ApiClient
) -> None:
    """Issue 26: ``bcx nodes power on|off|cycle`` and ``boot-device set`` run their shipped
    one-step profiles as workflows (audited, followed by --watch/--wait); the node keeps its
    lifecycle state; maintenance, no BMC and a running workflow refuse them."""
    node = (await ok_json(settings, "nodes", "enroll", "--site", "lab1", "--name", "lab1-p001",
                          "--bmc", "sim://bmc-p1", "--label", "rack=rp", "--no-validate"))["id"]  # fmt: skip
    # nodes list -w (kubectl get -w): the list, then a row per change of a listed node
    watch = subprocess.Popen(  # noqa: ASYNC220 (read line by line from a thread below)
        [sys.executable, "-m", "better_compute.cli", "nodes", "list", "-w", "-l", "rack=rp",
         "--timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=bcx_env(settings),
    )  # fmt: skip
    try:
        assert watch.stdout is not None
        head, first = [await asyncio.to_thread(watch.stdout.readline) for _ in range(2)]
        assert head.split()[:5] == ["NODE", "NAME", "SITE", "STATE", "POWER"], head
        assert first.split()[:5] == [node, "lab1-p001", "lab1", "enrolled", "unknown"], first
        out = await bcx(settings, "nodes", "power", "on", "lab1-p001", "--watch", "--timeout", "60",
                        env={"BC_ACTOR": "pat@ops"})  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        while (line := await asyncio.to_thread(watch.stdout.readline)) and line.split()[4] != "on":
            assert line.split()[0] == node, line
    finally:
        watch.kill()
        watch.communicate()
    lines = out.stdout.splitlines()
    assert re.match(r"^lab1-p001 power\.on: workflow wf_\w+$", lines[0]), lines
    assert any("lab1-p001  running" in line and "power.setPower" in line for line in lines), lines
    final = next(line for line in lines if line.startswith("lab1-p001  wf_"))
    assert final.split()[2] == "succeeded", lines
    doc = await bc_api.call("engine", "nodes.get", {"id": node})
    assert (doc["state"], doc["powerState"]) == ("enrolled", "on")

    out = await bcx(settings, "nodes", "boot-device", "set", "lab1-p001", "pxe", "--wait", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    pxe, end = (json.loads(line) for line in out.stdout.splitlines())  # what started; its end
    assert (pxe["action"], pxe["nodeState"], pxe["profile"]["id"]) == (
        "bootDevice.pxe", "enrolled", "metal.boot-pxe",
    )  # fmt: skip
    assert (end["summary"]["workflowId"], end["summary"]["state"]) == (pxe["workflowId"], "succeeded")
    sent = (await bcx(settings, "commands", "list", "--node", "lab1-p001")).stdout.splitlines()
    kinds = {line.split()[3]: line.split()[1:3] for line in sent[1:]}  # NODE is "node_… (name)"
    assert {"power.setPower", "management.setBootDevice"} <= set(kinds), sent
    assert kinds["power.setPower"] == [node, "(lab1-p001)"], sent
    audit = await ok_json(settings, "audit", "--who", "pat@ops")
    got = [(e["action"], e["detail"].get("nodeId"), e["detail"].get("action")) for e in audit["entries"]]
    assert got == [("metal.power", node, "on")]  # its target: the workflow, as a verb's

    # refused: in maintenance (the message says what to do), without a BMC, while a workflow runs
    await bc_api.call("engine", "nodes.maintenance", {"id": node, "on": True, "reason": "fan swap"})
    err = _error(await bcx(settings, "nodes", "power", "off", "lab1-p001", "--json"))
    assert (err["code"], err["details"]["reason"], err["details"]["path"]) == (
        "INVALID_STATE", "node-in-maintenance", "nodeId",
    )  # fmt: skip
    assert f"node {node} is in maintenance: fan swap; power it off once it is out" in err["message"]
    bare = (await bc_api.call("engine", "metal.enroll", {"siteId": "lab1"}))["id"]
    err = _error(await bcx(settings, "nodes", "power", "cycle", bare, "--json"))
    assert (err["code"], err["details"]["reason"]) == ("INVALID_STATE", "no-bmc")
    await bc_api.call("engine", "nodes.maintenance", {"id": node, "on": False})
    held = await bc_api.call("engine", "metal.inspect", {"nodeId": node, "profile": "t.hold"})
    # a site with no agent: the watch line says so (bcx why's reason); past --timeout the summary
    # shows where it stands, then TIMEOUT, exit 1
    far = {"siteId": "lab9", "name": "far", "bmc": {"driver": "sim", "address": "bmc-far"}}
    await bc_api.call("engine", "metal.enroll", far)
    out = await bcx(settings, "nodes", "power", "cycle", "lab9/far", "--watch", "--timeout", "3")
    assert out.returncode == 1, out.stdout + out.stderr
    assert any(
        "far  running" in line and "(waits: no connected agent at site lab9" in line
        for line in out.stdout.splitlines()
    ), out.stdout
    final = out.stdout.splitlines()[-1].split()
    assert (final[0], final[2]) == ("far", "running"), out.stdout
    assert out.stderr.startswith("error: TIMEOUT: workflow wf_"), out.stderr
    assert "did not end in 3s (still running; it waits: no connected agent at site lab9" in out.stderr
    err = _error(await bcx(settings, "nodes", "power", "off", node, "--json"))
    assert (err["code"], err["details"]["reason"], err["details"]["workflowId"]) == (
        "INVALID_STATE", "node-busy", held["workflowId"],
    )  # fmt: skip
