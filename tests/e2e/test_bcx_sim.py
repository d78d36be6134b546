"""``bcx sim up|status|down``: the metal simulator and a real site agent started by bcx as background
processes against a running stack (every service its own process), machines enrolled with their
Redfish BMC, a machine nobody enrolled showing up as discovered, and nothing left after down."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from better_compute.clients import EngineClient
from better_compute.config import Settings
from better_compute.runtime.embedded import pid_alive
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, bcx

pytestmark = pytest.mark.e2e

SITE = "simlab"


@pytest_asyncio.fixture(loop_scope="session")
async def stack(bc_settings: Settings, bc_processes: ServiceProcesses, tmp_path: Path) -> AsyncIterator[Path]:
    bc_processes.extra_env.update(BC_CMDQ_HEARTBEAT="200ms", BC_CMDQ_SWEEP="100ms")
    for name in ("bc-pki", "bc-secrets", "bc-command-queue", "bc-engine"):
        bc_processes.start(name)
    await bc_processes.wait_ready(timeout=60)  # a loaded machine starts four services slowly
    state = tmp_path / "state"
    try:
        yield state
    finally:
        # whatever a failed test left: bcx sim down is what an operator runs
        await bcx(bc_settings, "sim", "down", "--state-dir", str(state), timeout=60)
        for log in sorted((state / "logs").glob("sim-*.log")):
            print(f"--- {log.name} ---", log.read_text(errors="replace")[-3000:], sep="\n")


def _redfish_get(url: str, creds: dict[str, str]) -> dict[str, Any]:
    req = urllib.request.Request(url)
    auth = base64.b64encode(f"{creds['username']}:{creds['password']}".encode()).decode()
    req.add_header("Authorization", f"Basic {auth}")
    with urllib.request.urlopen(req, timeout=5) as resp:
        doc: dict[str, Any] = json.loads(resp.read())
        return doc


def _private_json(path: Path) -> tuple[dict[str, str], int]:
    return json.loads(path.read_text()), path.stat().st_mode


def _bcd_pids(ledger: Path) -> list[int]:
    """The bcds the machine's hardware saw started."""
    return [json.loads(x)["pid"] for x in ledger.read_text().splitlines() if '"bcd.started"' in x]


@pytest.mark.timeout(300)  # a simulator, a site agent and a discovery boot: slow on a loaded machine
async def test_sim_up_enrolls_its_machines_shows_a_stranger_as_discovered_and_down_leaves_nothing(
    stack: Path, bc_settings: Settings, bc_api: ApiClient
) -> None:
    state = str(stack)
    up = await bcx(bc_settings, "sim", "up", "--machines", "2", "--unenrolled", "1", "--site", SITE,
                   "--enroll", "--label", "rack=r7", "--json", "--state-dir", state, timeout=150)  # fmt: skip
    assert up.returncode == 0, up.stderr
    doc = json.loads(up.stdout)
    creds, mode = _private_json(Path(doc["bmcCredentialsFile"]))
    assert creds["password"] not in up.stdout + up.stderr  # the credential stays in its 0600 file
    assert mode & 0o077 == 0
    machines = doc["machines"]
    assert [m["name"] for m in machines] == [f"{SITE}-m000", f"{SITE}-m001", f"{SITE}-m002"]
    assert len({m["mac"] for m in machines}) == 3
    assert all(m["bmc"].startswith("redfish+http://127.0.0.1:") for m in machines)

    # the two enrolled ones are nodes with their BMC (the credential by reference) and MACs
    engine = EngineClient(bc_api)
    for m in machines[:2]:
        node = await engine.get_node(id=m["node"])
        labels = {"sim": "1", "hw": "sim", "rack": "r7"}
        assert (node.state, node.site_id, node.labels) == ("enrolled", SITE, labels)
        assert node.macs == m["macs"]
        assert node.bmc is not None
        assert (node.bmc["driver"], node.bmc["address"]) == ("redfish", doc["bmcUrl"])
        assert node.bmc["credentialsRef"].startswith("sec_")
        # and that BMC is a real Redfish endpoint holding this machine, off until someone acts
        system = _redfish_get(doc["bmcUrl"] + node.bmc["systemId"], creds)
        assert (system["UUID"], system["PowerState"]) == (m["uuid"], "Off")
    with pytest.raises(urllib.error.HTTPError):
        _redfish_get(
            machines[0]["bmc"].replace("redfish+http", "http"), {"username": "admin", "password": "x"}
        )

    # the third, nobody's, was switched on from the network: discovery made it a node, which
    # sim up waited for and shows
    stranger = machines[2]
    assert stranger["power"] == "on (discovered)"
    found = await engine.get_node(id=stranger["node"])
    assert (found.state, found.macs) == ("discovered", stranger["macs"])
    assert found.hardware is not None
    assert found.hardware["productUuid"] == stranger["uuid"]

    status = await bcx(bc_settings, "sim", "status", "--json", "--state-dir", state)
    assert status.returncode == 0, status.stderr
    (site,) = json.loads(status.stdout)["sites"]
    assert (site["site"], site["simulator"]["alive"], site["siteAgent"]["alive"]) == (SITE, True, True)
    powers = {m["name"]: m["power"] for m in site["machines"]}
    assert powers == {f"{SITE}-m000": "Off", f"{SITE}-m001": "Off", f"{SITE}-m002": "On"}
    assert {m["name"]: m["bcd"] for m in site["machines"]}[f"{SITE}-m002"] == "started"

    again = await bcx(bc_settings, "sim", "up", "--machines", "1", "--site", SITE, "--state-dir", state)
    assert again.returncode == 1
    assert "INVALID_STATE" in again.stderr
    assert "bcx sim down" in again.stderr

    # down: the simulator, its emulator and bcds, and the site agent are gone
    bcd_pids = _bcd_pids(Path(stranger["folder"]) / "ledger.jsonl")
    assert bcd_pids
    down = await bcx(bc_settings, "sim", "down", "--json", "--state-dir", state, timeout=60)
    assert down.returncode == 0, down.stderr
    assert json.loads(down.stdout) == {"stopped": [SITE]}
    assert not pid_alive(doc["simulator"]["pid"])
    assert not pid_alive(doc["siteAgent"]["pid"])
    assert not any(pid_alive(p) for p in bcd_pids)
    with pytest.raises(urllib.error.URLError):
        _redfish_get(doc["bmcUrl"] + "/redfish/v1/", creds)
    after = await bcx(bc_settings, "sim", "status", "--json", "--state-dir", state)
    assert json.loads(after.stdout) == {"sites": []}
