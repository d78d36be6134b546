"""The test OS image on a real (virtual) machine: built, signed into the image catalog (Ed25519),
and booted by QEMU from its virtio disk, after bcd's own ``image_write`` put it there (from what the
catalog says) with a NoCloud config drive holding the project's cloud-init
template rendered for a node (a single-use ``provisioned`` token bound to the node and the VM's
DMI product UUID). The installed OS's init runs the template's ``write_files`` and ``runcmd`` (curl
downloads bcd from this test's HTTP server, ``sha256sum -c`` checks it, ``bcd join`` joins), then
``bcd run --mode installed`` serves: a ``node.inventory`` sent through the real command queue comes
back node-signed with the VM's own DMI. A second boot from the same disk skips the join and serves
again with the same enrollment. Checked on the VM's console and disk file and through the real
pki and command queue (each its own process); KVM when it works here, TCG otherwise.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import http.server
import json
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from bcd.configdrive import ConfigDrive
from bcd.image import image_write
from bcd.system import Machine
from better_compute.clients import CommandQueueClient, EngineClient, PkiClient
from better_compute.config import Settings
from better_compute.core.ids import new_id
from better_compute.metal.signatures import sign_image
from better_compute.provision.templates import UserData, template_variables
from better_compute.provision.userdata import cloud_init
from better_compute.runtime.os_image import DEFAULT_OS_CMDLINE, build_os_image
from better_compute.runtime.ramdisk import default_cache_dir
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, until
from better_compute.testing.machines import DiskSpec, RecordingRunner, prepare_machine
from better_compute.testing.ramdisk import die_with_parent, kvm_works, qemu_accel
from better_compute.wire.cmdq import EnqueueCommand

pytestmark = [pytest.mark.e2e, pytest.mark.long, pytest.mark.timeout(1800)]

SITE = "lab-vm"
UUID = "7d1a4c52-9e0b-4c7e-8f3a-2b6d5e4f1a09"
SERIAL = "BC-TOS-0001"
SIGNER = ed25519.Ed25519PrivateKey.generate()
TOKEN = re.compile(r"bcjt_[A-Za-z0-9_-]{43}")
# what the template's runcmd downloads as bcd: the image carries bcd (PyInstaller --onedir under
# /opt/bcd, the ramdisk's part); this is its launcher, as the ramdisk's /bin/bcd is
LAUNCHER = b'#!/bin/sh\nexec /opt/bcd/bcd "$@"\n'


class VM:
    """QEMU booting its virtio disk file (no -kernel: the BIOS, syslinux's MBR, the disk); the
    ramdisk's ``RamdiskVM`` boots a kernel and initramfs instead. KVM only where the CPU shows
    vmx/svm (``qemu_accel``): here /dev/kvm opens but syslinux's real-mode code stops with a KVM
    emulation failure."""

    def __init__(self, folder: Path, disk: Path) -> None:
        self.folder, self.disk = folder, disk
        self.proc: subprocess.Popen[bytes] | None = None
        self.boots = 0

    @property
    def console(self) -> Path:
        return self.folder / f"console-{self.boots}.log"

    def start(self) -> None:
        self.boots += 1
        argv = ["qemu-system-x86_64", *qemu_accel(), "-m", "1024", "-smp", "2", "-display", "none",
                "-monitor", "none", "-serial", f"file:{self.console}", "-no-reboot",
                "-drive", f"file={self.disk},if=virtio,format=raw",
                "-netdev", "user,id=n0", "-device", "virtio-net-pci,netdev=n0,mac=52:54:00:7e:57:01",
                "-device", "virtio-rng-pci", "-smbios", f"type=1,uuid={UUID},serial={SERIAL}"]  # fmt: skip
        with open(self.folder / f"qemu-{self.boots}.log", "wb") as log:  # the child keeps its own copy
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=die_with_parent)  # fmt: skip

    def text(self) -> str:
        return self.console.read_text(errors="replace") if self.console.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def www(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    folder = tmp_path / "www"
    folder.mkdir()
    handler = type("Quiet", (http.server.SimpleHTTPRequestHandler,), {"log_message": lambda *_a: None})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(folder))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield folder, server.server_address[1]
    server.shutdown()
    server.server_close()


async def test_the_test_os_boots_from_its_disk_reads_its_config_drive_and_its_bcd_joins(
    tmp_path: Path, bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses,
    www: tuple[Path, int],
) -> None:  # fmt: skip
    t0 = time.monotonic()
    raw = SIGNER.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    config = tmp_path / "bc.toml"  # the catalog's allowlisted signer
    config.write_text(
        f'[images]\nsigners = [{{ id = "t-os", publicKey = "{base64.b64encode(raw).decode()}" }}]\n'
    )
    bc_processes.extra_env["BC_CONFIG"] = str(config)
    for service in ("bc-pki", "bc-secrets", "bc-command-queue", "bc-engine"):
        bc_processes.start(service)
    # this test's services answer under its own subject root: the image says so on its kernel line
    cmdline = f"{DEFAULT_OS_CMDLINE} bcd.subject_root={bc_settings.subject_root}"
    built = await asyncio.to_thread(
        build_os_image, tmp_path / "os", cache_dir=default_cache_dir(), cmdline=cmdline
    )
    await bc_processes.wait_ready()
    t_built = time.monotonic()
    folder, port = www
    (folder / "os.raw").write_bytes(built.image.read_bytes())
    (folder / "bcd").write_bytes(LAUNCHER)
    pki, cq = PkiClient(bc_api), CommandQueueClient(bc_api)
    # signed into the catalog like any image, and written from what the catalog says
    url = f"http://127.0.0.1:{port}/os.raw"
    signed = sign_image(SIGNER, name="bc-test-os", version="1", sha256=built.sha256, url=url)
    await bc_api.call("engine", "images.register", {
        "name": "bc-test-os", "version": "1", "url": url, "sha256": built.sha256, "format": "raw",
        "signer": "t-os", "signature": base64.b64encode(signed).decode(),
    })  # fmt: skip
    image = await EngineClient(bc_api).get_image(ref="bc-test-os@1")
    assert (image.sha256, image.signer_status) == (built.sha256, "allowlisted")

    node = new_id("node")
    token = await pki.issue_join_token(tenant_id="root", role="provisioned", site_id=SITE, ttl_seconds=1800,
                                       node_id=node, expect={"productUuid": UUID})  # fmt: skip
    nats_port = (bc_settings.nats_url or "").rsplit(":", 1)[1]
    settings = UserData(control_plane_url=f"nats://10.0.2.2:{nats_port}", bcd_url=f"http://10.0.2.2:{port}/bcd",
                        bcd_sha256=hashlib.sha256(LAUNCHER).hexdigest())  # fmt: skip
    variables = template_variables(node_id=node, join_token=token.token, user_data=settings)
    user_data = cloud_init({k: v for k, v in variables.items() if v is not None})

    # bcd's own image write (the ramdisk's code) puts the image and the config drive on the VM's disk
    root = prepare_machine(tmp_path / "ramdisk-root", disks=[DiskSpec("vda", 512 << 20)])
    machine = Machine(root=root, runner=RecordingRunner())  # type: ignore[arg-type]
    written = await asyncio.to_thread(
        image_write, machine, url=image.url, sha256=image.sha256, disk="/dev/vda",
        config_drive=ConfigDrive(user_data=user_data.encode(), node_id=node),
    )  # fmt: skip
    assert written["configDrive"]["partition"] == 3  # after the image's boot and state partitions
    disk = root / "dev/vda"

    vm = VM(tmp_path / "vm", disk)
    vm.folder.mkdir()
    try:
        vm.start()

        async def joined() -> bool:
            info = await pki.get_join_token(join_token_id=token.join_token_id)
            return info.uses == 1

        async def serving() -> bool:
            agents = await cq.agents(site_id=SITE, connected=True)
            return any(
                a.id == node and a.role == "provisioned" and "node.converge" in (a.kinds or [])
                for a in agents
            )

        ok: bool = await until(joined, timeout=600, interval=1.0, what="the installed OS's bcd joined")
        t_joined = time.monotonic()
        ok = await until(serving, timeout=300, interval=1.0, what="bcd serving in installed mode")
        t_serving = time.monotonic()
        console = vm.text()
        assert "bc-cloud-init: wrote /etc/bcd/join-token (0600)" in console
        assert "bc-cloud-init: runcmd 3" in console  # the template's fourth line: bcd join
        assert "bc-os: bcd run --mode installed" in console
        assert token.token not in console

        # it serves: an inventory through the real command queue, node-signed, the VM's own DMI
        inv = EnqueueCommand(node_id=node, site_id=SITE, kind="node.inventory", key="t:inv-1", target="node")
        cmd = await cq.enqueue(inv)

        async def settled() -> bool:
            return (await cq.get(id=cmd.id)).state in ("succeeded", "failed", "rejected")

        ok = await until(settled, timeout=300, interval=1.0, what="the inventory's result")
        done = await cq.get(id=cmd.id)
        assert (done.state, done.attested) == ("succeeded", True), done
        inventory = json.loads(done.result or b"{}")
        assert json.dumps(inventory).count(UUID) >= 1
        assert SERIAL in json.dumps(inventory)

        # a second boot from the same disk: no cloud-init, no join, the same node serving again
        vm.stop()
        vm.start()

        async def back() -> bool:
            return "bc-os: bcd run --mode installed" in vm.text() and await serving()

        ok = await until(back, timeout=600, interval=1.0, what="the second boot serving")
        assert ok
        t_second = time.monotonic()
        again = vm.text()
        assert "bc-cloud-init" not in again
        assert (await pki.get_join_token(join_token_id=token.join_token_id)).uses == 1
        print(f"os image {built.size} bytes; build {t_built - t0:.1f}s, first boot to joined "
              f"{t_joined - t_built:.1f}s, to serving {t_serving - t_built:.1f}s, second boot to serving "
              f"{t_second - t_serving:.1f}s; accel {'kvm' if kvm_works() else 'tcg'}")  # fmt: skip
    finally:
        vm.stop()
        for n in range(1, vm.boots + 1):
            print(f"--- console {n} ---")
            print((vm.folder / f"console-{n}.log").read_text(errors="replace")[-6000:])
