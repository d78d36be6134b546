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
import base64
import contextlib
import functools
import hashlib
import http.server
import json
import re
import struct
import subprocess
import threading
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import pytest
import pytest_asyncio
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from better_compute.clients import CommandQueueClient, PkiClient
from better_compute.config import Settings
from better_compute.runtime.os_image import DEFAULT_OS_CMDLINE, build_os_image
from better_compute.runtime.ramdisk import RamdiskArtifacts, build, default_cache_dir
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, bcx, until
from better_compute.testing.images import register_sim_image
from better_compute.testing.metal_sim import FleetStack, fleet_stack
from better_compute.testing.metal_sim.stack import MediaServer
from better_compute.testing.vmlab import LabVm
from better_compute.testing.vmlab.app import HOST_SECTION_PROFILE, ramdisk_env, userdata_env
from better_compute.testing.vmlab.redfish import RedfishVmBmc
from better_compute.wire.cmdq import CommandView

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


def public_key(pem: str) -> bytes:
    key = x509.load_pem_x509_certificate(pem.encode()).public_key()
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def read_at(disk: Path, offset: int, size: int) -> bytes:
    with open(disk, "rb") as fh:
        fh.seek(offset)
        return fh.read(size)


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


@pytest.mark.long  # the deploy lifecycle below covers every verb of it in make test
@pytest.mark.parametrize("bmc", ["redfish", "ipmi"])
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


@pytest.mark.long  # a real-kernel check of the virtual-media token path; the simulator's is in make test
@pytest.mark.timeout(900)
async def test_the_real_ramdisk_reads_its_join_token_from_the_virtual_cd_its_bmc_fetched(
    bc_api: ApiClient, bc_processes: ServiceProcesses, bc_settings: Settings, tmp_path: Path,
    ramdisk_served: dict[str, str],
) -> None:  # fmt: skip
    """Issue 23, virtual media: a VM whose BMC says ``tokenDelivery: media``. sushy-emulator
    downloads the site agent's one-time token image (``BCBOOT``) at InsertMedia, QEMU shows it to
    the VM as an IDE CD-ROM, iPXE boots the real ramdisk from the network with only
    ``bcd.token_from=media`` on its kernel line, and the ramdisk's bcd reads the token from
    ``/dev/sr0`` and joins: the VM is inspected, its medium ejected after the join."""
    env = ramdisk_env(
        nats_url=bc_settings.nats_url or "", subject_root=bc_settings.subject_root,
        cmdline="console=ttyS0,115200n8", **ramdisk_served,
    )  # fmt: skip
    async with _vm_stack(
        tmp_path, bc_settings, bc_api, bc_processes, bmc="redfish", env=env, vm_disk_bytes=DISK_BYTES
    ) as stack:
        vm, node_id = stack.vm(0), stack.vm_nodes[0]
        updated = await bcx(stack.settings, "nodes", "update", node_id, "--bmc-token-delivery", "media")
        assert updated.returncode == 0, updated.stdout + updated.stderr
        t0 = time.monotonic()
        await stack.engine.run_verb("inspect", node_id=node_id)
        await stack.node_reaches(node_id, "inspected", timeout=300, what="the VM inspected")
        print(f"inspect over virtual media: {time.monotonic() - t0:.1f} s")
        node = await stack.engine.get_node(id=node_id)
        assert isinstance(node.inventory, dict)
        assert node.inventory["productUuid"] == vm.uuid  # read by the real bcd off the VM's DMI
        power = vm.events("power")
        assert [(e["to"], e.get("boot"), e.get("cdrom")) for e in power] == [
            ("On", "network", True), ("Off", None, None),
        ]  # fmt: skip
        console = vm.console.read_text(errors="replace")
        assert "bcd.token_from=media" in console  # the kernel line the VM booted (printed)
        assert not TOKEN.search(console.encode())  # and no token on it, nor anywhere on screen
        asked = stack.lab.bmc_requests(0) if stack.lab else []
        assert any("InsertMedia" in r for r in asked), asked
        assert any("EjectMedia" in r for r in asked), asked
        for path in stack.log_files():
            assert not TOKEN.search(path.read_bytes()), path


# -- deploy: the test OS image written by the real bcd, booted from the VM's disk -----------

DEPLOY_DISK_BYTES = 384 << 20  # the test OS image is ~77 MiB; its config drive goes after it
OS_IMAGE = "bc-test-os@1"
# what the user data's runcmd downloads as bcd: the image carries bcd (PyInstaller --onedir under
# /opt/bcd, as the ramdisk does); this is its launcher, as the ramdisk's /bin/bcd is
LAUNCHER = b'#!/bin/sh\nexec /opt/bcd/bcd "$@"\n'


class CountingServer:
    """Serves a folder over HTTP on loopback (the guests reach it at 10.0.2.2) and keeps each
    request's path: what the machine fetched, counted where it was served.

    ``hold=(path, n)``: a GET of ``path`` sends its first ``n`` bytes, sets ``held`` and sends the
    rest only once ``go`` is set (at most two minutes later), as a link that stalls would: the
    reader is then in the middle of the file for as long as the test wants."""

    def __init__(self, folder: Path, *, hold: tuple[str, int] | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.requests = folder, []
        self.held, self.go = threading.Event(), threading.Event()
        seen, held, go = self.requests, self.held, self.go

        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *_args: object) -> None:
                pass

            def do_GET(self) -> None:
                seen.append(self.path)
                super().do_GET()

            def copyfile(self, source: Any, outputfile: Any) -> None:
                if hold is None or self.path != hold[0]:
                    super().copyfile(source, outputfile)
                    return
                outputfile.write(source.read(hold[1]))
                outputfile.flush()
                held.set()
                go.wait(120)
                with contextlib.suppress(OSError):  # the reader may be gone (its VM's power pulled)
                    super().copyfile(source, outputfile)

        self.server = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), functools.partial(Handler, directory=str(folder))
        )
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, name="vm-deploy-www", daemon=True).start()

    def guest_url(self, name: str) -> str:
        return f"http://10.0.2.2:{self.port}/{name}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("bmc", ["redfish", pytest.param("ipmi", marks=pytest.mark.long)])
@pytest.mark.timeout(1500)
async def test_a_vm_is_deployed_boots_its_installed_os_and_is_released_and_retired(
    bc_api: ApiClient, bc_processes: ServiceProcesses, bc_settings: Settings, tmp_path: Path,
    ramdisk_served: dict[str, str], bmc: Literal["redfish", "ipmi"],
) -> None:  # fmt: skip
    """enroll (Redfish or IPMI) -> inspect -> commission -> ``deploy`` (the shipped ``metal.deploy``, the
    test OS image signed into the catalog) -> the VM boots its disk into the installed OS, whose
    bcd joins with the provisioned token -> ``release`` -> ``retire``: checked at the VM's disk
    file, its console, its BMC and the HTTP server it fetched the image and bcd from."""
    t0 = time.monotonic()
    # the installed OS's kernel line names this test's subject root, as the ramdisk's does
    cmdline = f"{DEFAULT_OS_CMDLINE} bcd.subject_root={bc_settings.subject_root}"
    built = await asyncio.to_thread(
        build_os_image, tmp_path / "os", cache_dir=default_cache_dir(), cmdline=cmdline
    )
    t_built = time.monotonic()
    image = built.image.read_bytes()
    www = CountingServer(tmp_path / "www")
    (www.folder / "os.raw").write_bytes(image)
    (www.folder / "bcd").write_bytes(LAUNCHER)
    env = ramdisk_env(
        nats_url=bc_settings.nats_url or "", subject_root=bc_settings.subject_root,
        cmdline="console=ttyS0,115200n8 quiet", **ramdisk_served,
    ) | userdata_env(
        nats_url=bc_settings.nats_url or "", bcd_url=www.guest_url("bcd"),
        bcd_sha256=hashlib.sha256(LAUNCHER).hexdigest(),
    )  # fmt: skip
    try:
        async with _vm_stack(
            tmp_path, bc_settings, bc_api, bc_processes, bmc=bmc, env=env,
            vm_disk_bytes=DEPLOY_DISK_BYTES,
        ) as stack:  # fmt: skip
            vm, node_id = stack.vm(0), stack.vm_nodes[0]
            # signed into the catalog by the test key the VM lab's app trusts; served where the
            # VM's bcd fetches it
            await register_sim_image(stack.engine, OS_IMAGE, url=www.guest_url("os.raw"), data=image)
            times: dict[str, float] = {"build": round(t_built - t0, 1)}

            async def verb(name: str, resting: str, timeout: float, **kw: str) -> None:
                t = time.monotonic()
                await stack.engine.run_verb(name, node_id=node_id, **kw)  # type: ignore[arg-type]
                await stack.node_reaches(node_id, resting, timeout=timeout, what=f"the VM ({name})")
                times[name] = round(time.monotonic() - t, 1)

            # a filesystem on the blank disk, as a used machine has: the commission's wipe ends it
            await asyncio.to_thread(subprocess.run, ["mkfs.ext4", "-q", "-F", str(vm.disk)], check=True)
            assert ext4_signature(vm.disk)
            await verb("inspect", "inspected", 300)
            inv = (await stack.engine.get_node(id=node_id)).inventory
            assert isinstance(inv, dict)
            # read by the real bcd in the real ramdisk off the VM's DMI, block devices and NICs
            assert (inv["productUuid"], inv["serial"]) == (vm.uuid, vm.serial)
            assert {d["name"]: d["sizeBytes"] for d in inv["disks"]}.get("vda") == DEPLOY_DISK_BYTES
            assert vm.mac in [n.get("mac") for n in inv["nics"]]
            assert ext4_signature(vm.disk)  # inspecting wrote nothing
            await verb("commission", "ready", 300)
            assert not ext4_signature(vm.disk)  # the quick wipe, counted in the disk file
            deploying_since = time.time()
            await verb("deploy", "deployed", 900, image=OS_IMAGE)

            # the image at the start of the VM's disk: its boot code, its two partitions' entries and
            # its boot partition byte for byte; after them the config drive's entry, and the state
            # partition is the running OS's (it mounts it read-write and keeps its enrollment there)
            boot_start, boot_sectors = struct.unpack_from("<II", image, 446 + 8)
            state_start, state_sectors = struct.unpack_from("<II", image, 446 + 16 + 8)
            on_disk = read_at(vm.disk, 0, len(image))
            assert on_disk[:478] == image[:478]
            assert on_disk[510:512] == image[510:512] == b"\x55\xaa"
            boot = slice(boot_start * 512, (boot_start + boot_sectors) * 512)
            assert on_disk[boot] == image[boot]
            state_end = (state_start + state_sectors) * 512
            assert on_disk[state_end:] == image[state_end:]
            drive_start = struct.unpack_from("<I", on_disk, 446 + 32 + 8)[0]
            assert drive_start * 512 >= len(image)  # partition 3, the config drive, after the image
            pvd = read_at(vm.disk, drive_start * 512 + 16 * 2048, 2048)  # ISO9660's volume descriptor
            assert (pvd[1:6], pvd[40:46].upper()) == (b"CD001", b"CIDATA")
            # written once: fetched once from where it is served, one image write command
            assert www.requests.count("/os.raw") == 1, www.requests
            assert www.requests.count("/bcd") == 1, www.requests  # the user data's runcmd
            writes = await CommandQueueClient(stack.api).list_commands(
                node_id=node_id, kind="node.imageWrite"
            )
            assert [c.state for c in writes.commands] == ["succeeded"], writes
            # the VM booted its disk: the ramdisk from the network, then the disk (persistent)
            power = vm.events("power")
            boots = [e.get("boot") for e in power if e["to"] == "On"]
            assert boots[-2:] == ["network", "disk"], power
            screen = vm.console.read_text(errors="replace")  # every boot's, the last one's after
            installed = screen[screen.rindex(f"power on #{len(boots)}, boot disk ===") :]
            assert "bc-os: state on /dev/vda2" in installed
            assert "bc-cloud-init: wrote /etc/bcd/join-token (0600)" in installed

            def serving() -> bool:  # the join made the node deployed; then bcd serves
                screen = vm.console.read_text(errors="replace")
                return "bc-os: bcd run --mode installed" in screen[screen.rindex("boot disk ===") :]

            ok: bool = await until(serving, timeout=120, interval=0.5, what="the installed OS's bcd serving")
            assert ok
            # its bcd joined with the provisioned token of the user data, bound to this VM
            certs = await PkiClient(stack.api).list_certificates(agent_id=node_id, role="provisioned")
            fresh = [c for c in certs if c.created_at.timestamp() >= deploying_since - 1]
            assert len(fresh) == 1, certs
            claims = fresh[0].claims
            assert claims is not None
            assert claims.product_uuid == vm.uuid
            assert vm.mac in claims.macs
            # with a key of its own: not one the ramdisks' bcd joined with (role node)
            ramdisks = await PkiClient(stack.api).list_certificates(agent_id=node_id, role="node")
            assert len(ramdisks) >= 3  # inspect's, commission's, deploy's
            assert public_key(fresh[0].certificate_pem) not in {
                public_key(c.certificate_pem) for c in ramdisks
            }
            node = await stack.engine.get_node(id=node_id)
            assert node.state == "deployed"

            # a host section for the installed bcd: it converges it and reports the generation
            t = time.monotonic()
            await stack.engine.start_workflow(profile_id=HOST_SECTION_PROFILE, node_id=node_id)

            async def converged() -> bool:
                now = await stack.engine.get_node(id=node_id)
                return now.generation == node.generation + 1 == now.observed_generation

            ok = await until(converged, timeout=300, interval=1.0, what="the host section converged")
            assert ok
            times["hostSection"] = round(time.monotonic() - t, 1)
            # bcd answered with the installed OS's new key: its result signed, checked against the
            # provisioned certificate (the re-keyed node), not the ramdisk's
            converges = await CommandQueueClient(stack.api).list_commands(
                node_id=node_id, kind="node.converge"
            )
            assert [(c.state, c.attested) for c in converges.commands] == [("succeeded", True)], converges
            # the VM's screen never showed a join token, the installed OS's boot included
            assert not TOKEN.search(vm.console.read_bytes())

            await verb("release", "ready", 300)
            mbr = read_at(vm.disk, 0, 512)
            assert mbr[510:512] != b"\x55\xaa"  # the image's partition table is gone
            assert mbr != image[:512]
            assert www.requests.count("/os.raw") == 1
            # retire: the secure wipe erases what the quick one leaves (a mark mid-disk)
            write_at(vm.disk, MARK, DEPLOY_DISK_BYTES // 2)
            await verb("retire", "retired", 600)
            assert not holds(vm.disk, MARK, DEPLOY_DISK_BYTES // 2)
            power = vm.events("power")
            assert [e.get("boot") for e in power if e["to"] == "On"].count("disk") == 1, power
            assert power[-1]["to"] == "Off"
            print(f"VM lifecycle with deploy over {bmc} ({power[0]['accel']}): {times}, "
                  f"total {time.monotonic() - t0:.1f} s")  # fmt: skip
            changes = [r for r in stack.lab.bmc_requests(0) if not r.startswith("GET ")] if stack.lab else []
            print(f"{bmc} BMC changes: {changes}")
            # at the BMC: five one-time network boots (a verb's each) and deploy's one to the disk
            if bmc == "redfish":
                assert sum(r.startswith("PATCH ") for r in changes) == 6, changes
            else:
                devices = [r.split(":", 1)[1] for r in changes if r.startswith("set_boot_device:")]
                assert devices == ["network", "network", "network", "hd", "network", "network"], changes
            for path in stack.log_files():
                assert not TOKEN.search(path.read_bytes()), path
    finally:
        www.close()


# -- a crash in the middle of the image write ------------------------------------------------

MIB = 1 << 20
# a bcd that went silent after claiming the image write (its VM lost power) fails the command
# agent-lost after 20 s of silence, not the default 120 s; an agent is shown disconnected after 5 s
CRASH_ENV = {"BC_CMDQ_LOST_AFTER": "20s", "BC_CMDQ_SILENT_AFTER": "5s"}
CONFIG_DRIVE_ENTRY = slice(446 + 32, 446 + 48)  # MBR partition entry 3: bcd's config drive


class ImageOnDisk:
    """The image's bytes as they reach the VM's disk file: 4 KiB windows at every 5 % of the image
    (each moved on to where the image is not zero: the disk was blank before), and how many of
    them hold the image's bytes yet. The first MiB is not looked at: bcd writes it last."""

    def __init__(self, disk: Path, image: bytes) -> None:
        self.disk, self.image = disk, image
        self.windows: list[int] = []
        for i in range(1, 20):
            at = max(MIB, len(image) * i // 20) & ~4095
            while at + 4096 <= len(image) and not image[at : at + 4096].strip(b"\0"):
                at += 4096
            if at + 4096 <= len(image) and at not in self.windows:
                self.windows.append(at)
        self.seen: list[tuple[float, int]] = []
        self.t0 = time.monotonic()

    def written(self) -> int:
        with open(self.disk, "rb") as fh:
            n = 0
            for at in self.windows:
                fh.seek(at)
                n += fh.read(4096) == self.image[at : at + 4096]
        if not self.seen or self.seen[-1][1] != n:
            self.seen.append((round(time.monotonic() - self.t0, 2), n))
        return n

    def digest_as_written(self) -> str:
        """sha256 of the disk file over the image's length, bcd's config drive entry (partition
        3, which it adds to the image's table) put back as the image has it."""
        data = bytearray(read_at(self.disk, 0, len(self.image)))
        data[CONFIG_DRIVE_ENTRY] = self.image[CONFIG_DRIVE_ENTRY]
        return hashlib.sha256(data).hexdigest()


async def _image_write(stack: FleetStack, node_id: str) -> list[CommandView]:
    found = await CommandQueueClient(stack.api).list_commands(node_id=node_id, kind="node.imageWrite")
    return list(found.commands)


@pytest.mark.long
@pytest.mark.parametrize("crash", ["site-agent", "power"])
@pytest.mark.timeout(1200)
async def test_a_crash_in_the_middle_of_the_image_write_never_leaves_a_half_written_disk_deployed(
    bc_api: ApiClient, bc_processes: ServiceProcesses, bc_settings: Settings, tmp_path: Path,
    ramdisk_served: dict[str, str], crash: str,
) -> None:  # fmt: skip
    """``deploy`` of the test OS image; while the ramdisk's bcd writes it (counted in the VM's disk
    file: some of the image's bytes there, not all), the site agent is SIGKILLed (and started
    again once the write ended), or the VM's power is pulled at its BMC behind the product's
    back. Either the image ends up on the disk exactly and the node is ``deployed``, or the
    deploy fails and says why: never ``deployed`` with half an image."""
    t0 = time.monotonic()
    cmdline = f"{DEFAULT_OS_CMDLINE} bcd.subject_root={bc_settings.subject_root}"
    built = await asyncio.to_thread(
        build_os_image, tmp_path / "os", cache_dir=default_cache_dir(), cmdline=cmdline
    )
    image = built.image.read_bytes()
    # the image's server stalls after its first half (a MiB boundary: bcd reads MiB chunks), so
    # the test acts while bcd is in the middle of the write, however fast the rest would go
    # (under TCG the whole 77 MiB took under a second to reach the disk file)
    www = CountingServer(tmp_path / "www", hold=("/os.raw", len(image) // 2 & ~(MIB - 1)))
    (www.folder / "os.raw").write_bytes(image)
    (www.folder / "bcd").write_bytes(LAUNCHER)
    env = ramdisk_env(
        nats_url=bc_settings.nats_url or "", subject_root=bc_settings.subject_root,
        cmdline="console=ttyS0,115200n8 quiet", **ramdisk_served,
    ) | userdata_env(
        nats_url=bc_settings.nats_url or "", bcd_url=www.guest_url("bcd"),
        bcd_sha256=hashlib.sha256(LAUNCHER).hexdigest(),
    ) | CRASH_ENV  # fmt: skip
    times: dict[str, float] = {}
    try:
        async with _vm_stack(
            tmp_path, bc_settings, bc_api, bc_processes, bmc="redfish", env=env,
            vm_disk_bytes=DEPLOY_DISK_BYTES,
        ) as stack:  # fmt: skip
            vm, node_id = stack.vm(0), stack.vm_nodes[0]
            await register_sim_image(stack.engine, OS_IMAGE, url=www.guest_url("os.raw"), data=image)
            for name, resting in (("inspect", "inspected"), ("commission", "ready")):
                t = time.monotonic()
                await stack.engine.run_verb(name, node_id=node_id)  # type: ignore[arg-type]
                await stack.node_reaches(node_id, resting, timeout=300, what=f"the VM ({name})")
                times[name] = round(time.monotonic() - t, 1)
            on_disk = ImageOnDisk(vm.disk, image)
            assert on_disk.written() == 0  # the disk holds none of it yet

            t = time.monotonic()
            await stack.engine.run_verb("deploy", node_id=node_id, image=OS_IMAGE)
            total = len(on_disk.windows)

            def middle() -> bool:
                n = on_disk.written()
                assert n < total, f"the image write ended before the test saw its middle: {on_disk.seen}"
                return www.held.is_set() and n >= 3  # half of it sent, some of it on the disk

            async def writing() -> bool:
                node = await stack.engine.get_node(id=node_id)
                assert node.state == "deploying", (node.state, node.state_reason)
                return await asyncio.to_thread(middle)

            await until(writing, timeout=600, interval=0.05, what="the image write's middle in the disk file")
            watching = asyncio.create_task(_watch(on_disk))  # the rest of the disk file's story
            times["toMiddle"] = round(time.monotonic() - t, 1)
            (write,) = await _image_write(stack, node_id)
            print(f"mid-write: {on_disk.seen[-1][1]} of {total} windows, progress {write.progress!r}")
            assert write.state == "running", write

            if crash == "site-agent":
                await asyncio.to_thread(stack.agent.kill)  # SIGKILL: nothing of it runs on
                www.go.set()  # the rest of the image

                # the write goes on without it (bcd talks to the control plane, not to the site
                # agent) and ends with the image on the disk exactly
                async def written() -> CommandView | None:
                    (cmd,) = await _image_write(stack, node_id)
                    return cmd if cmd.state not in ("acked", "running", "dispatched", "pending") else None

                done = await until(written, timeout=300, interval=0.5, what="the image write's end")
                assert done.state == "succeeded", done
                assert on_disk.digest_as_written() == hashlib.sha256(image).hexdigest()
                # the power cycle to the disk needs the site agent: the deploy waits, and says so
                why = await until(
                    lambda: _why_has(stack, node_id, "no-agent"), timeout=60, interval=0.5,
                    what="why: no connected agent",
                )  # fmt: skip
                print(f"bcx why, the site agent away: {why}")
                assert (await stack.engine.get_node(id=node_id)).state == "deploying"
                assert [e.get("boot") for e in vm.events("power") if e["to"] == "On"][-1] == "network"
                stack.agent.start()
                await stack.node_reaches(node_id, "deployed", timeout=600, what="the VM (deploy)")
                times["deploy"] = round(time.monotonic() - t, 1)
                # written once: one fetch of the image, one image write command
                assert www.requests.count("/os.raw") == 1, www.requests
                writes = await _image_write(stack, node_id)
                assert [c.state for c in writes] == ["succeeded"], writes
                boots = [e.get("boot") for e in vm.events("power") if e["to"] == "On"]
                assert boots[-2:] == ["network", "disk"], boots
                # the image as written (the installed OS has since mounted its state partition)
                now = read_at(vm.disk, 0, len(image))
                assert now[:478] == image[:478]
                boot_start, boot_sectors = struct.unpack_from("<II", image, 446 + 8)
                boot = slice(boot_start * 512, (boot_start + boot_sectors) * 512)
                assert now[boot] == image[boot]
            else:
                # the plug pulled: the BMC switches the VM off at once, nobody told the product
                assert stack.lab is not None
                assert stack.lab.redfish is not None
                await asyncio.to_thread(_redfish_reset, stack.lab.redfish, vm.uuid, "ForceOff")
                await until(lambda: vm.events("power")[-1]["to"] == "Off", timeout=30, what="the VM off")
                cut = on_disk.written()
                assert cut < total, on_disk.seen
                failed = await stack.node_reaches(node_id, "failed", timeout=300, what="the VM (deploy)")
                times["deploy"] = round(time.monotonic() - t, 1)
                reason = failed.state_reason
                print(f"the node failed: {reason}")
                assert isinstance(reason, dict)
                assert reason["step"] == "deploy.deploy", reason
                assert "agent-lost" in reason["message"], reason
                (write,) = await _image_write(stack, node_id)
                assert (write.state, write.reason) == ("failed", "agent-lost"), write
                workflow = await stack.engine.get_workflow(id=reason["workflowId"])
                assert workflow.state == "failed", workflow
                why = await stack.engine.why(id=node_id)
                print(f"bcx why: {why.answer}")
                assert "agent-lost" in why.answer, why
                # the BMC did nothing wrong: the failed command was the bcd's
                assert "the last error of the node's bcd: node.imageWrite failed" in why.answer, why
                assert "BMC error" not in why.answer, why
                # the disk: never the image's boot sector (bcd writes the first MiB last), so
                # nothing boots half an image; and no more of it than when the power went
                mbr = read_at(vm.disk, 0, 512)
                assert mbr[510:512] != b"\x55\xaa", mbr[446:]
                assert on_disk.written() == cut
                assert on_disk.digest_as_written() != hashlib.sha256(image).hexdigest()
                assert [e.get("boot") for e in vm.events("power") if e["to"] == "On"].count("disk") == 0
                assert www.requests.count("/os.raw") == 1, www.requests
            watching.cancel()
            print(f"crash ({crash}) in the image write: {times}, the disk file {on_disk.seen}, "
                  f"total {time.monotonic() - t0:.1f} s")  # fmt: skip
    finally:
        www.go.set()
        www.close()


async def _watch(on_disk: ImageOnDisk) -> None:
    while True:
        await asyncio.to_thread(on_disk.written)
        await asyncio.sleep(0.1)


async def _why_has(stack: FleetStack, node_id: str, kind: str) -> str | None:
    why = await stack.engine.why(id=node_id)
    return why.answer if any(r.kind == kind for r in why.reasons) else None


def _redfish_reset(bmc: RedfishVmBmc, uuid: str, reset: str) -> None:
    """``ComputerSystem.Reset`` straight at the VM's BMC, as someone at the machine would."""
    creds = bmc.credentials
    req = urllib.request.Request(
        f"{bmc.url}/redfish/v1/Systems/{uuid}/Actions/ComputerSystem.Reset",
        data=json.dumps({"ResetType": reset}).encode(), method="POST",
        headers={"Content-Type": "application/json", "Authorization": "Basic " + base64.b64encode(
            f"{creds['username']}:{creds['password']}".encode()).decode()},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status in (200, 202, 204), resp.status
