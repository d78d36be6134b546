"""``bcx sim up|status|down``: the metal simulator and a real site agent started by bcx as background
processes against a running stack (every service its own process), machines enrolled with their
Redfish BMC, a machine nobody enrolled showing up as discovered, and nothing left after down."""

from __future__ import annotations

import base64
import hashlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from better_compute.clients import EngineClient
from better_compute.config import Settings
from better_compute.runtime.embedded import free_port, pid_alive
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, bcx, until
from better_compute.testing.metal_sim.stack import MediaServer
from better_compute.testing.vmlab.app import ramdisk_env

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
    # as docs/fleet-demo.md says: the fleet app's ISO folder and URL, set for every sim up
    media = {
        "BC_SIM_MEDIA_DIR": str(stack.parent / "media"),
        "BC_SIM_MEDIA_URL": f"http://127.0.0.1:{free_port()}",
    }
    up = await bcx(bc_settings, "sim", "up", "--machines", "2", "--unenrolled", "1", "--site", SITE,
                   "--enroll", "--label", "rack=r7", "--json", "--state-dir", state, timeout=150,
                   env=media)  # fmt: skip
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
        assert node.name == m["name"]  # the simulator's name kept (issue 26)
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

    # a second site in the same shell: the first simulator serves the ISO folder for both (issue
    # 26: the second one tried the same port and died with a traceback; seen failing so)
    second = await bcx(bc_settings, "sim", "up", "--machines", "1", "--site", f"{SITE}2", "--no-discovery",
                       "--state-dir", state, timeout=150, env=media)  # fmt: skip
    assert second.returncode == 0, second.stderr
    assert f"ISOs: served by the simulator of site {SITE} at {media['BC_SIM_MEDIA_URL']}" in second.stdout
    assert "Traceback" not in (stack / "logs" / f"sim-{SITE}2.log").read_text()
    assert (await bcx(bc_settings, "sim", "down", "--site", f"{SITE}2", "--state-dir", state)).returncode == 0

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


# -- --vms: QEMU VMs behind their own BMC ------------------------------------------------------

VM_SITE = "simvms"
VM_APP = "better_compute.testing.vmlab.app:app"
# no built ramdisk: the "kernel" of the VMs' boot entry is an iPXE script that says so on the screen
SCRIPT_KERNEL = b"#!ipxe\necho bc-vmlab: the ramdisk kernel from the site cache runs\nexit\n"
SCRIPT_SAYS = "bc-vmlab: the ramdisk kernel from the site cache runs"


def _qemus(folder: str) -> list[int]:
    """The running QEMU processes of the VM whose folder is ``folder`` (found in /proc)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"qemu-system-x86_64") and any(folder.encode() in a for a in argv):
            found.append(int(proc.name))
    return found


@pytest_asyncio.fixture(loop_scope="session")
async def vm_stack(
    bc_settings: Settings, bc_processes: ServiceProcesses, tmp_path: Path
) -> AsyncIterator[Path]:
    """The services with the VM lab's app, whose ramdisk is ``SCRIPT_KERNEL`` served on loopback."""
    media = MediaServer()
    kernel = media.add("vmlinuz", SCRIPT_KERNEL)
    env = ramdisk_env(
        kernel=kernel, kernel_sha256=hashlib.sha256(SCRIPT_KERNEL).hexdigest(),
        nats_url=bc_settings.nats_url or "", subject_root=bc_settings.subject_root,
    )  # fmt: skip
    bc_processes.settings = msgspec.structs.replace(bc_settings, app=VM_APP)
    bc_processes.extra_env.update(BC_CMDQ_HEARTBEAT="200ms", BC_CMDQ_SWEEP="100ms", **env)
    for name in ("bc-pki", "bc-secrets", "bc-command-queue", "bc-engine"):
        bc_processes.start(name)
    await bc_processes.wait_ready(timeout=60)
    state = tmp_path / "state"
    try:
        yield state
    finally:
        await bcx(bc_settings, "sim", "down", "--state-dir", str(state), timeout=60)
        media.close()
        for log in sorted((state / "logs").glob("sim-*.log")):
            print(f"--- {log.name} ---", log.read_text(errors="replace")[-3000:], sep="\n")
        for console in sorted((state / "sim").rglob("console.log")):
            print(f"--- {console} ---", console.read_text(errors="replace")[-2000:], sep="\n")


@pytest.mark.long  # the VM boots its firmware and iPXE under TCG
@pytest.mark.timeout(300)
async def test_sim_up_with_a_vm_enrolls_it_behind_its_bmc_the_product_boots_it_and_down_leaves_no_qemu(
    vm_stack: Path, bc_settings: Settings, bc_api: ApiClient
) -> None:
    state = str(vm_stack)
    t0 = time.monotonic()
    up = await bcx(bc_settings, "sim", "up", "--machines", "0", "--vms", "1", "--site", VM_SITE, "--enroll",
                   "--json", "--state-dir", state, timeout=150)  # fmt: skip
    assert up.returncode == 0, up.stderr
    t_up = time.monotonic() - t0
    doc = json.loads(up.stdout)
    creds, mode = _private_json(Path(doc["bmcCredentialsFile"]))
    assert creds["password"] not in up.stdout + up.stderr
    assert mode & 0o077 == 0
    (vm,) = doc["machines"]
    assert (vm["name"], vm["power"]) == ("vm00", "off (VM)")
    assert vm["mac"].startswith("52:56:")  # the VM lab's, not the simulator's 52:54:
    assert not _qemus(vm["folder"])  # off: no QEMU yet

    # enrolled: a node with its MAC and its BMC, a sushy-emulator of its own holding the VM
    engine = EngineClient(bc_api)
    node = await engine.get_node(id=vm["node"])
    vm_labels = {"sim": "1", "vm": "1", "hw": "vm"}  # sim up labels its VMs hw=vm, its machines hw=sim
    assert (node.state, node.site_id, node.labels) == ("enrolled", VM_SITE, vm_labels)
    assert node.macs == [vm["mac"]]
    assert node.bmc is not None
    assert node.bmc["driver"] == "redfish"
    assert node.bmc["address"] != doc["bmcUrl"]  # not the simulated machines' emulator
    assert node.bmc["systemId"] == f"/redfish/v1/Systems/{vm['uuid']}"
    system = _redfish_get(node.bmc["address"] + node.bmc["systemId"], creds)
    assert (system["UUID"], system["PowerState"]) == (vm["uuid"], "Off")

    # the product boots it: inspect's boot entry at the site agent, the power cycle at its BMC,
    # and the VM's own iPXE fetching the entry and its kernel from the site agent at 10.0.2.2
    inspect = await bcx(bc_settings, "inspect", vm["node"], "--state-dir", state)
    assert inspect.returncode == 0, inspect.stderr
    console = Path(vm["folder"]) / "console.log"

    def booted() -> bool:
        return console.exists() and SCRIPT_SAYS in console.read_text(errors="replace")

    ok: bool = await until(booted, timeout=180, interval=0.5, what="the VM ran its boot entry's kernel")
    assert ok
    t_boot = time.monotonic() - t0 - t_up
    screen = console.read_text(errors="replace")
    assert f"Machine UUID {vm['uuid']}" in screen  # its firmware's DMI
    assert f"boot entry for {vm['mac']}" in screen
    running = _qemus(vm["folder"])
    assert len(running) == 1, running

    status = await bcx(bc_settings, "sim", "status", "--json", "--state-dir", state)
    assert status.returncode == 0, status.stderr
    (site,) = json.loads(status.stdout)["sites"]
    assert [(m["name"], m["power"], m["node"]) for m in site["machines"]] == [("vm00", "On", vm["node"])]

    down = await bcx(bc_settings, "sim", "down", "--json", "--state-dir", state, timeout=60)
    assert down.returncode == 0, down.stderr
    assert json.loads(down.stdout) == {"stopped": [VM_SITE]}
    assert not pid_alive(doc["simulator"]["pid"])
    assert not any(pid_alive(p) for p in running)
    assert not _qemus(vm["folder"])
    with pytest.raises(urllib.error.URLError):
        _redfish_get(node.bmc["address"] + "/redfish/v1/", creds)
    print(f"bcx sim up --vms 1: up {t_up:.1f} s, inspect to the VM's boot entry {t_boot:.1f} s")
