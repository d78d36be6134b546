"""The VM lab's pure parts: identities, what QEMU is asked for, the BMC's access log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from better_compute.testing.metal_sim.app import RAMDISK
from better_compute.testing.vmlab import VirtualMachine, VmSpec, guest_url, vm_identity
from better_compute.testing.vmlab.app import ramdisk_env, ramdisk_from_env, userdata_env, userdata_from_env
from better_compute.testing.vmlab.redfish import _ACCESS


def test_identities_are_unique_per_index_and_stable_per_seed() -> None:
    first = [vm_identity(3, i) for i in range(50)]
    assert first == [vm_identity(3, i) for i in range(50)]
    assert (
        len({u for u, _, _ in first}) == len({s for _, s, _ in first}) == len({m for _, _, m in first}) == 50
    )
    assert all(m.startswith("52:56:03:") for _, _, m in first)  # not the simulator's 52:54:…
    assert vm_identity(4, 0) != vm_identity(3, 0)


def test_the_guest_reaches_this_machines_loopback_as_10_0_2_2() -> None:
    assert guest_url("http://127.0.0.1:8080/x") == "http://10.0.2.2:8080/x"
    assert guest_url("nats://localhost:4222") == "nats://10.0.2.2:4222"


def test_qemu_boots_what_the_bmc_said_with_the_vms_own_identity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BC_VMLAB_ACCEL", "tcg")
    spec = VmSpec(name="vm00", folder=str(tmp_path), uuid="0d6c1e0a-4b0e-4c4c-9d1a-7d0b4c0e1f01",
                  serial="VM00000000", mac="52:56:00:00:00:01", boot_url="http://10.0.2.2:1/boot.ipxe",
                  disk_bytes=64 << 20)  # fmt: skip
    vm = VirtualMachine(spec)
    try:
        assert vm.disk.stat().st_size == 64 << 20
        assert vm.disk.stat().st_blocks == 0  # blank and sparse
        net = vm.argv("network", None)
        assert net[net.index("-boot") + 1].startswith("order=nc,")  # the network, then the disk
        assert net[net.index("-accel") + 1] == "tcg"
        smbios = net[net.index("-smbios") + 1]
        assert f"uuid={spec.uuid}" in smbios
        assert f"serial={spec.serial}" in smbios
        assert f"bootfile={spec.boot_url}" in net[net.index("-netdev") + 1]
        assert f"mac={spec.mac}" in net[net.index("-device") + 1]
        cd = vm.argv("cd", tmp_path / "medium.iso")
        assert cd[cd.index("-boot") + 1].startswith("order=dc,")
        assert f"file={tmp_path / 'medium.iso'},media=cdrom" in " ".join(cd)
        assert vm.argv("disk", None)[net.index("-boot") + 1].startswith("order=c,")
        assert VmSpec.from_json(spec.to_json()) == spec
    finally:
        vm.close()


def test_the_bmcs_access_log_is_read_through_werkzeugs_colours() -> None:
    log = (
        '127.0.0.1 - - [02/Dec/2026 00:51:44] "GET /redfish/v1/Systems/u1 HTTP/1.1" 200 -\n'
        '127.0.0.1 - - [02/Dec/2026 00:51:45] "\x1b[35m\x1b[1mPOST /redfish/v1/Systems/u1/Actions/'
        'ComputerSystem.Reset HTTP/1.1\x1b[0m" 204 -\n'
    )
    found = [" ".join(m.groups()) for m in _ACCESS.finditer(log)]
    assert found == [
        "GET /redfish/v1/Systems/u1 200",
        "POST /redfish/v1/Systems/u1/Actions/ComputerSystem.Reset 204",
    ]


def test_the_ramdisks_command_line_names_the_control_plane_as_the_guest_reaches_it() -> None:
    env = ramdisk_env(
        kernel="http://127.0.0.1:1/vmlinuz", nats_url="nats://127.0.0.1:4222", subject_root="bct7"
    )

    doc = json.loads(env["BC_VMLAB_RAMDISK"])
    assert doc["cmdline"].split() == [
        "console=ttyS0", "quiet", "bcd.subject_root=bct7", "bcd.control_plane=nats://10.0.2.2:4222",
    ]  # fmt: skip


def test_the_installed_os_user_data_names_the_control_plane_as_the_guest_reaches_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = userdata_env(
        nats_url="nats://127.0.0.1:4222", bcd_url="http://10.0.2.2:8080/bcd", bcd_sha256="ab" * 32
    )
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    settings = userdata_from_env()
    assert settings is not None
    assert (settings.control_plane_url, settings.bcd_url, settings.bcd_sha256) == (
        "nats://10.0.2.2:4222", "http://10.0.2.2:8080/bcd", "ab" * 32,
    )  # fmt: skip


def test_without_its_own_ramdisk_the_lab_boots_the_one_bcx_dev_up_serves_naming_the_guests_control_plane(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What ``make demo`` runs: ``bcx dev up`` hands the built ramdisk to the services as
    ``BC_RAMDISK_*`` and its NATS as ``BC_NATS_URL`` on loopback; the VM reaches it at 10.0.2.2."""
    monkeypatch.delenv("BC_VMLAB_RAMDISK", raising=False)
    monkeypatch.delenv("BC_CONFIG", raising=False)
    monkeypatch.setenv("BC_NATS_URL", "nats://127.0.0.1:4999")
    monkeypatch.setenv("BC_RAMDISK_KERNEL", "http://127.0.0.1:81/k")
    monkeypatch.setenv("BC_RAMDISK_KERNEL_SHA256", "a" * 64)
    monkeypatch.setenv("BC_RAMDISK_INITRD", "http://127.0.0.1:81/i")
    monkeypatch.setenv("BC_RAMDISK_INITRD_SHA256", "b" * 64)
    monkeypatch.setenv("BC_RAMDISK_CMDLINE", "console=tty0 console=ttyS0,115200n8")

    ramdisk = ramdisk_from_env()
    assert (ramdisk.kernel, ramdisk.initrd, ramdisk.kernel_sha256) == (
        "http://127.0.0.1:81/k", "http://127.0.0.1:81/i", "a" * 64,
    )  # fmt: skip
    # quiet: the kernel prints no command line (the boot entry's bcd.token=) on the console
    assert ramdisk.cmdline.split() == [
        "console=tty0", "console=ttyS0,115200n8", "quiet", "bcd.control_plane=nats://10.0.2.2:4999",
    ]  # fmt: skip

    monkeypatch.delenv("BC_RAMDISK_KERNEL")
    assert ramdisk_from_env().kernel == RAMDISK.kernel  # nothing built: the simulated one
