"""Machines that are VMs (``better_compute.testing.vmlab``), through every real process.

Each VM is a QEMU process (KVM when /dev/kvm opens, TCG otherwise; never skipped) with a blank
virtio disk file and QEMU's iPXE ROM on user-mode networking, behind a BMC nobody here wrote:
sushy-emulator (Redfish; its fake driver, whose external notifier drives QEMU) or pyghmi's BMC
server (IPMI). The site agent serves its boot scripts and cache at 10.0.2.2, where the guests
reach this machine's loopback. What is counted is what the machine and its BMC saw: the VM's
console and power events, the BMC's request log, the VM's disk file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import pytest
import pytest_asyncio

from better_compute.config import Settings
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, until
from better_compute.testing.metal_sim import FleetStack, fleet_stack
from better_compute.testing.metal_sim.stack import MediaServer
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
    bmc: Literal["redfish", "ipmi"], kernel: str, kernel_sha256: str,
) -> AsyncIterator[FleetStack]:  # fmt: skip
    env = ramdisk_env(kernel=kernel, kernel_sha256=kernel_sha256, nats_url=settings.nats_url or "")
    async with fleet_stack(
        tmp_path, settings, machines=0, vms=1, vm_bmc=bmc, app=VM_APP, env=env, processes=processes, api=api
    ) as stack:
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


@pytest.mark.parametrize("bmc", ["redfish", pytest.param("ipmi", marks=pytest.mark.long)])
async def test_inspect_network_boots_the_vm_into_its_entry_from_the_site_cache(
    bc_api: ApiClient, bc_processes: ServiceProcesses, bc_settings: Settings, tmp_path: Path,
    script_ramdisk: tuple[str, str], bmc: Literal["redfish", "ipmi"],
) -> None:  # fmt: skip
    """``inspect`` on a VM: the engine's boot entry, the BMC's network boot and power cycle,
    and the VM's own iPXE fetching its entry and kernel from the site agent at 10.0.2.2."""
    kernel, sha = script_ramdisk
    async with _vm_stack(
        tmp_path, bc_settings, bc_api, bc_processes, bmc=bmc, kernel=kernel, kernel_sha256=sha
    ) as stack:
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
