"""Machines that are VMs (``better_compute.testing.vmlab``), through every real process.

Each VM is a QEMU process (KVM when /dev/kvm opens, TCG otherwise; never skipped) with a blank
virtio disk file and QEMU's iPXE ROM on user-mode networking, behind a BMC nobody here wrote:
sushy-emulator (Redfish; its fake driver, whose external notifier drives QEMU) or pyghmi's BMC
server (IPMI). The site agent serves its boot scripts and cache at 10.0.2.2, where the guests
reach this machine's loopback. What is counted is what the machine and its BMC saw: the VM's
console and power events, the BMC's request log, the VM's disk file.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import pytest
import pytest_asyncio

from better_compute.config import Settings
from better_compute.runtime.ramdisk import RamdiskArtifacts, build
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, until
from better_compute.testing.metal_sim import FleetStack, fleet_stack
from better_compute.testing.metal_sim.stack import MediaServer
from better_compute.testing.vmlab import LabVm
from better_compute.testing.vmlab.app import ramdisk_env

pytestmark = pytest.mark.e2e

VM_APP = "better_compute.testing.vmlab.app:app"
# Until the project's ramdisk is built here: an iPXE script as the "kernel". iPXE runs it as an
# image when the boot entry boots, and it says so on the VM's console.
SCRIPT_KERNEL = b"#!ipxe\necho bc-vmlab: the ramdisk kernel from the site cache runs\nexit\n"
SCRIPT_SAYS = "bc-vmlab: the ramdisk kernel from the site cache runs"


def _agent_events(stack: FleetStack) -> list[str]:
    names = []
    for line in stack.agent.output().splitlines():
        if line.startswith("{"):
            try:
                names.append(str(json.loads(line).get("event")))
            except ValueError:
                continue
    return names


@pytest_asyncio.fixture(loop_scope="session")
async def script_ramdisk() -> AsyncIterator[tuple[str, str]]:
    media = MediaServer()
    try:
        yield media.add("vmlinuz", SCRIPT_KERNEL), hashlib.sha256(SCRIPT_KERNEL).hexdigest()
    finally:
        media.close()


@contextlib.asynccontextmanager
async def _vm_stack(
    tmp_path: Path, settings: Settings, api: ApiClient, processes: ServiceProcesses, *,
    bmc: Literal["redfish", "ipmi"], env: dict[str, str], vm_disk_bytes: int = 2 << 30,
) -> AsyncIterator[FleetStack]:  # fmt: skip
    async with fleet_stack(
        tmp_path, settings, machines=0, vms=1, vm_bmc=bmc, app=VM_APP, env=env, processes=processes, api=api,
        vm_disk_bytes=vm_disk_bytes,
    ) as stack:  # fmt: skip
        try:
            yield stack
        finally:
            vm = stack.vm(0)
            print("--- vm events ---", *vm.events(), sep="\n")
            print(
                "--- vm console ---",
                vm.console.read_text(errors="replace")[-3000:] if vm.console.exists() else "",
            )
            print(stack.tails())


@pytest.mark.long  # the lifecycle below covers it in make test; this one needs no built ramdisk
@pytest.mark.parametrize("bmc", ["redfish", "ipmi"])
async def test_inspect_network_boots_the_vm_into_its_entry_from_the_site_cache(
    bc_api: ApiClient, bc_processes: ServiceProcesses, bc_settings: Settings, tmp_path: Path,
    script_ramdisk: tuple[str, str], bmc: Literal["redfish", "ipmi"],
) -> None:  # fmt: skip
    """``inspect`` on a VM: the engine's boot entry, the BMC's network boot and power cycle,
    and the VM's own iPXE fetching its entry and kernel from the site agent at 10.0.2.2."""
    kernel, sha = script_ramdisk
    env = ramdisk_env(kernel=kernel, kernel_sha256=sha, nats_url=bc_settings.nats_url or "")
    async with _vm_stack(tmp_path, bc_settings, bc_api, bc_processes, bmc=bmc, env=env) as stack:
        vm, node_id = stack.vm(0), stack.vm_nodes[0]
        t0 = time.monotonic()
        await stack.engine.run_verb("inspect", node_id=node_id)

        async def booted() -> bool | None:
            node = await stack.engine.get_node(id=node_id)
            assert node.state != "failed", node.state_reason
            return SCRIPT_SAYS in vm.console.read_text(errors="replace") if vm.console.exists() else False

        ran: bool | None = await until(booted, timeout=90, what="the VM ran its boot entry's kernel")
        assert ran
        ons = vm.events("power")
        print(f"inspect to the entry's kernel on the VM ({ons[0]['accel']}): {time.monotonic() - t0:.1f} s")
        screen = vm.console.read_text(errors="replace")
        assert f"Machine UUID {vm.uuid}" in screen  # its firmware's DMI: -smbios type=1
        assert f"boot entry for {vm.mac}" in screen
        assert [(e["to"], e.get("boot")) for e in ons][:1] == [("On", "network")]
        served = _agent_events(stack)
        assert served.count("netboot_entry_served") == 1
        assert "cache_served" in served
        asked = stack.lab.bmc_requests(0) if stack.lab else []
        if bmc == "redfish":
            assert any(r.startswith("PATCH ") for r in asked), asked  # the boot override
            assert any("ComputerSystem.Reset" in r and r.startswith("POST ") for r in asked), asked
        else:
            assert "set_boot_device:network" in asked, asked
            assert any(r in ("power_cycle", "power_reset", "power_on") for r in asked), asked


# -- the lifecycle, with the project's ramdisk -----------------------------------------------

EXT4_MAGIC_AT = 1024 + 0x38  # the superblock's s_magic, 0xEF53 little-endian
DISK_BYTES = 256 << 20  # the secure wipe writes all of it: under TCG about 12 s per 100 MiB
MARK = b"bc-vmlab: a byte the secure wipe must reach"
TOKEN = re.compile(rb"bcjt_[A-Za-z0-9_-]{43}")


@pytest.fixture(scope="session")
def ramdisk(tmp_path_factory: pytest.TempPathFactory) -> RamdiskArtifacts:
    """The project's ramdisk (``bcx ramdisk build``; its parts are cached, so this is a copy once
    they were built on this machine)."""
    return build(tmp_path_factory.mktemp("ramdisk"))


@pytest_asyncio.fixture(loop_scope="session")
async def ramdisk_served(ramdisk: RamdiskArtifacts) -> AsyncIterator[dict[str, str]]:
    """``ramdisk_env`` for the built ramdisk, its files served over HTTP on loopback (where the
    site agent fills its cache from)."""
    manifest = ramdisk.read_manifest()
    media = MediaServer(ramdisk.kernel.parent)
    try:
        yield {
            "kernel": f"{media.url}/{manifest['kernel']['file']}",
            "kernel_sha256": manifest["kernel"]["sha256"],
            "initrd": f"{media.url}/{manifest['initrd']['file']}",
            "initrd_sha256": manifest["initrd"]["sha256"],
        }
    finally:
        media.close()


def ext4_signature(disk: Path) -> bool:
    with open(disk, "rb") as fh:
        fh.seek(EXT4_MAGIC_AT)
        return fh.read(2) == b"\x53\xef"


def write_at(disk: Path, data: bytes, offset: int) -> None:
    with open(disk, "r+b") as fh:
        fh.seek(offset)
        fh.write(data)


def holds(disk: Path, data: bytes, offset: int) -> bool:
    with open(disk, "rb") as fh:
        fh.seek(offset)
        return fh.read(len(data)) == data


async def _lifecycle(stack: FleetStack, vm: LabVm, node_id: str) -> dict[str, float]:
    """enroll (done) -> inspect -> commission -> retire, checked at the VM and its disk file."""
    times: dict[str, float] = {}
    # a filesystem on the blank disk, as a used machine has: the commission's wipe must end it
    await asyncio.to_thread(subprocess.run, ["mkfs.ext4", "-q", "-F", str(vm.disk)], check=True)
    assert ext4_signature(vm.disk)

    async def verb(name: str, resting: str, timeout: float) -> None:
        t0 = time.monotonic()
        await stack.engine.run_verb(name, node_id=node_id)
        await stack.node_reaches(node_id, resting, timeout=timeout, what=f"the VM ({name})")
        times[name] = round(time.monotonic() - t0, 1)

    await verb("inspect", "inspected", 300)
    node = await stack.engine.get_node(id=node_id)
    inv = node.inventory
    assert isinstance(inv, dict)
    # read by the real bcd in the real ramdisk off the VM's DMI, block devices and NICs
    assert (inv["productUuid"], inv["serial"]) == (vm.uuid, vm.serial)
    assert {d["name"]: d["sizeBytes"] for d in inv["disks"]}.get("vda") == DISK_BYTES
    assert vm.mac in [n.get("mac") for n in inv["nics"]]
    assert ext4_signature(vm.disk)  # inspecting wrote nothing

    await verb("commission", "ready", 300)
    assert not ext4_signature(vm.disk)  # the quick wipe, counted in the disk file

    write_at(vm.disk, MARK, DISK_BYTES // 2)  # what the quick wipe leaves and the secure one must not
    await verb("retire", "retired", 600)
    assert not holds(vm.disk, MARK, DISK_BYTES // 2)
    assert vm.events("power")[-1]["to"] == "Off"
    return times


@pytest.mark.parametrize("bmc", ["redfish", pytest.param("ipmi", marks=pytest.mark.long)])
@pytest.mark.timeout(900)
async def test_a_vm_is_inspected_commissioned_and_retired_by_the_real_ramdisk(
    bc_api: ApiClient, bc_processes: ServiceProcesses, bc_settings: Settings, tmp_path: Path,
    ramdisk_served: dict[str, str], bmc: Literal["redfish", "ipmi"],
) -> None:  # fmt: skip
    env = ramdisk_env(
        nats_url=bc_settings.nats_url or "", subject_root=bc_settings.subject_root,
        # quiet: the kernel does not print its command line (with the ramdisk's bcd.token=) on the
        # VM's screen; the ramdisk's init still says what it does
        cmdline="console=ttyS0,115200n8 quiet", **ramdisk_served,
    )  # fmt: skip
    async with _vm_stack(
        tmp_path, bc_settings, bc_api, bc_processes, bmc=bmc, env=env, vm_disk_bytes=DISK_BYTES
    ) as stack:
        vm, node_id = stack.vm(0), stack.vm_nodes[0]
        times = await _lifecycle(stack, vm, node_id)
        power = vm.events("power")
        print(f"VM lifecycle over {bmc} ({power[0]['accel']}): {times}")
        # each verb network-booted the VM once and switched it off at its end, at the VM...
        assert [(e["to"], e.get("boot")) for e in power] == [("On", "network"), ("Off", None)] * 3
        # ...and at its BMC: each verb's boot override, power cycle and power off, no more
        asked = stack.lab.bmc_requests(0) if stack.lab else []
        changes = [r for r in asked if not r.startswith("GET ")]
        print(f"{bmc} BMC requests: {len(asked)}, changes: {changes}")
        if bmc == "redfish":
            assert sum("ComputerSystem.Reset" in r for r in changes) == 6, changes
        else:
            assert changes.count("set_boot_device:network") == 3, changes
        # no join token on any log: services, site agent, BMCs, the VM's console and QEMU's
        for path in stack.log_files():
            assert not TOKEN.search(path.read_bytes()), path
