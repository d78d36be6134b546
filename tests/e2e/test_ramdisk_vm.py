"""The ramdisk the project builds boots a QEMU VM into bcd, which joins and answers.

``bcx ramdisk build``'s kernel and initramfs (built by the command, once per run; the build cache
makes a second run a copy) boot a VM straight from QEMU's ``-kernel``/``-initrd``: a blank virtio disk file, a
virtio NIC on user-mode networking (the guest reaches this machine's loopback, where the test's
nats-server listens, as 10.0.2.2), DMI product UUID and serial from ``-smbios``. KVM where it
works, TCG otherwise (never skipped). bc-pki and bc-command-queue run as processes. The VM's bcd
joins with a single-use node token bound to the VM's product UUID and MAC, answers
``node.inventory`` (node-signed, attested) with what the VM really has, writes an image onto its
disk and wipes it (both read off the VM's disk file). The VM dies with the test.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.pki import PkiClient
from better_compute.config import Settings
from better_compute.core.ids import new_id
from better_compute.runtime.ramdisk import RamdiskArtifacts, prepare_parts
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, run_bcx
from better_compute.testing.agents import until
from better_compute.testing.ramdisk import RamdiskVM, qemu_accel
from better_compute.wire.cmdq import EnqueueCommand

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SITE = "site-vm"
MAC = "52:54:00:bc:00:01"
UUID = "5b3c2b9e-1f4e-4a31-9d35-5a2a6f0e7d11"
SERIAL = "BC-VM-SERIAL-0001"
DISK_BYTES = 2 << 30
FAST_ENV = {"BC_CMDQ_HEARTBEAT": "500ms", "BC_CMDQ_SWEEP": "200ms"}


@pytest.fixture(scope="session")
def ramdisk(tmp_path_factory: pytest.TempPathFactory) -> RamdiskArtifacts:
    """What a user's ``bcx ramdisk build`` makes (once per run; the build cache makes a second
    run a copy)."""
    out = tmp_path_factory.mktemp("ramdisk")
    t0 = time.monotonic()
    done = run_bcx(None, "ramdisk", "build", "--out", str(out), "--json", timeout=900)
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    print(f"\nbcx ramdisk build: {time.monotonic() - t0:.1f}s ({done.stderr.strip().splitlines()[-1]})")
    made = RamdiskArtifacts(kernel=out / "vmlinuz", initrd=out / "initrd.img", manifest=out / "manifest.json")
    assert made.read_manifest()["initrd"]["sha256"] == shown["initrd"]["sha256"]
    return made


@pytest_asyncio.fixture(loop_scope="session")
async def services(bc_api: ApiClient, bc_processes: ServiceProcesses) -> AsyncIterator[ApiClient]:
    bc_processes.extra_env.update(FAST_ENV)
    bc_processes.start("bc-pki")
    bc_processes.start("bc-command-queue")
    await bc_processes.wait_ready()
    yield bc_api


@pytest.fixture
def image_server() -> Iterator[tuple[Path, int]]:
    """A folder served over HTTP on this machine's loopback (the VM's 10.0.2.2)."""
    folder = Path(tempfile.mkdtemp(prefix="vm-images-"))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield folder, server.server_address[1]
    server.shutdown()
    server.server_close()
    shutil.rmtree(folder)


@pytest.fixture
def vms() -> Iterator[list[RamdiskVM]]:
    started: list[RamdiskVM] = []
    yield started
    for vm in started:
        vm.close()


def _read(disk: Path, offset: int, size: int) -> bytes:
    """Bytes of the VM's disk file, as the host sees them."""
    with open(disk, "rb") as fh:
        fh.seek(offset)
        return fh.read(size)


def _guest_nats(settings: Settings) -> str:
    """The test's nats-server as the guest reaches it (QEMU's user network maps 10.0.2.2 to
    this machine's loopback)."""
    url = settings.nats_url or ""
    assert url.startswith("nats://127.0.0.1:"), url
    return url.replace("127.0.0.1", "10.0.2.2")


def test_the_packed_bcd_runs_on_this_machine_too(ramdisk: RamdiskArtifacts) -> None:
    """bcd as PyInstaller packed it into the ramdisk answers --help, claims and inventory here."""
    bcd = prepare_parts().bcd / "bcd"  # from the cache the build filled
    assert (bcd.parent / "_internal").is_dir()  # --onedir: nothing unpacked at each start
    helped = subprocess.run([str(bcd), "--help"], capture_output=True, text=True, timeout=60, check=False)
    assert helped.returncode == 0, helped.stderr
    assert "join" in helped.stdout
    assert "inventory" in helped.stdout
    claims = subprocess.run([str(bcd), "claims"], capture_output=True, text=True, timeout=60, check=False)
    assert claims.returncode == 0, claims.stderr
    source = subprocess.run(
        [sys.executable, "-m", "bcd", "claims"], capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(claims.stdout) == json.loads(source.stdout)  # the same as bcd from its sources
    inv = subprocess.run([str(bcd), "inventory"], capture_output=True, text=True, timeout=60, check=False)
    assert inv.returncode == 0, inv.stderr
    found = json.loads(inv.stdout)
    assert found["kernel"] == os.uname().release
    assert found["cpus"]["threads"] == os.cpu_count()


async def test_the_built_ramdisk_boots_a_vm_whose_bcd_joins_and_inventories_the_vm(
    ramdisk: RamdiskArtifacts,
    services: ApiClient,
    bc_settings: Settings,
    vms: list[RamdiskVM],
    image_server: tuple[Path, int],
    tmp_path: Path,
) -> None:
    manifest = ramdisk.read_manifest()
    assert manifest["kernel"]["size"] == ramdisk.kernel.stat().st_size
    assert manifest["initrd"]["size"] == ramdisk.initrd.stat().st_size
    assert set(manifest["packages"]) >= {"linux-image-amd64", "busybox-static"}
    pki, cq = PkiClient(services), CommandQueueClient(services, timeout=10.0)
    node = new_id("node")
    token = await pki.issue_join_token(
        tenant_id="root", role="node", site_id=SITE, ttl_seconds=900, node_id=node,
        expect={"productUuid": UUID, "mac": MAC},
    )  # fmt: skip
    cmdline = (
        f"console=ttyS0,115200n8 panic=-1 bcd.token={token.token} "
        f"bcd.control_plane={_guest_nats(bc_settings)} bcd.subject_root={bc_settings.subject_root}"
    )
    vm = RamdiskVM(
        folder=tmp_path / "vm", kernel=ramdisk.kernel, initrd=ramdisk.initrd, cmdline=cmdline,
        mac=MAC, product_uuid=UUID, serial=SERIAL, disk_bytes=DISK_BYTES,
    ).start()  # fmt: skip
    vms.append(vm)

    async def joined() -> bool:
        assert vm.alive(), f"the VM stopped; its console:\n{vm.console_text()[-3000:]}"
        return any(a.id == node and a.connected for a in await cq.agents(site_id=SITE))

    try:
        await until(joined, timeout=420, interval=0.5, what="the VM's bcd to join and connect")
    except AssertionError:
        raise AssertionError(f"no join; the VM's console:\n{vm.console_text()[-4000:]}") from None
    boot_to_join = time.monotonic() - vm.started_at
    (audit,) = await pki.list_joins(join_token_id=token.join_token_id)
    assert (audit.outcome, audit.agent_id) == ("joined", node)
    assert audit.claims is not None
    assert (audit.claims.product_uuid, audit.claims.serial) == (UUID, SERIAL)  # the VM's own DMI
    assert audit.claims.macs == [MAC]
    console = vm.console_text()
    assert "bcd_joined" in console, console[-3000:]  # bcd's own log line, on the VM's serial console
    assert "bcd run" in console, console[-3000:]

    view = await cq.enqueue(
        EnqueueCommand(
            node_id=node, site_id=SITE, kind="node.inventory", payload={}, key="inv", target="node"
        )
    )
    done = await cq.wait(id=view.id, timeout=120)
    assert (done.state, done.attested) == ("succeeded", True), done.reason  # node-signed, checked
    found = json.loads(done.result or b"{}")
    assert (found["productUuid"], found["serial"]) == (UUID, SERIAL)
    assert [(d["name"], d["sizeBytes"], d["boot"]) for d in found["disks"]] == [("vda", DISK_BYTES, False)]
    assert [(n["mac"], n["driver"]) for n in found["nics"]] == [(MAC, "virtio_net")]
    assert found["kernel"] == manifest["kernelRelease"]
    assert found["firmware"]["vendor"] == "QEMU"

    # the VM's bcd writes an image onto its virtio disk and wipes it: read off the disk file
    folder, port = image_server
    image = b"\xeb\x63\x90" + os.urandom((4 << 20) - 3)
    (folder / "image.raw").write_bytes(image)
    payload = {"url": f"http://10.0.2.2:{port}/image.raw", "sha256": hashlib.sha256(image).hexdigest(),
               "format": "raw", "disk": "/dev/vda"}  # fmt: skip
    view = await cq.enqueue(
        EnqueueCommand(node_id=node, site_id=SITE, kind="node.imageWrite", payload=payload, key="w",
                       target="node")
    )  # fmt: skip
    done = await cq.wait(id=view.id, timeout=180)
    assert (done.state, done.attested) == ("succeeded", True), done.reason
    assert _read(vm.disk, 0, len(image)) == image
    assert _read(vm.disk, len(image), 1 << 20) == bytes(1 << 20)  # nothing past the image
    view = await cq.enqueue(
        EnqueueCommand(node_id=node, site_id=SITE, kind="node.wipe", payload={"mode": "quick"}, key="wipe",
                       target="node")
    )  # fmt: skip
    done = await cq.wait(id=view.id, timeout=180)
    assert (done.state, done.attested) == ("succeeded", True), done.reason
    assert _read(vm.disk, 0, 1 << 20) == bytes(1 << 20)  # no boot sector, no table left
    assert _read(vm.disk, DISK_BYTES - (1 << 20), 1 << 20) == bytes(1 << 20)

    accel = "kvm" if "-enable-kvm" in qemu_accel() else "tcg"
    print(
        f"\nramdisk VM ({accel}): boot to join {boot_to_join:.1f}s; kernel {manifest['kernel']['size']} B,"
        f" initrd {manifest['initrd']['size']} B, bcd {manifest['bcd']['bytes']} B"
    )
