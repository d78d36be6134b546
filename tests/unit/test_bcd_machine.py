"""bcd on prepared machine trees: claims, inventory, wipe, image write, modes (units: test_bcd_units.py)."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import json
import os
import shutil
import struct
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zstandard
from msgspec import to_builtins

from bcd.__main__ import main as bcd_main
from bcd.bus import adopt_config_drive, carried_bus
from bcd.configdrive import ConfigDrive
from bcd.converger import Converger
from bcd.daemon import detect_mode, node_handlers
from bcd.disks import MIB, signatures, wipe
from bcd.hardware import boot_disk, boot_disks, claims, inventory
from bcd.image import SYNC_EVERY, image_write
from bcd.system import Machine
from better_compute.agent import Command, CommandRejected
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id
from better_compute.testing.machines import DiskSpec, RecordingRunner, RunAnswer, prepare_machine

pytestmark = pytest.mark.unit


def machine(tmp_path: Path, runner: RecordingRunner | None = None, **kw: Any) -> Machine:
    return Machine(root=prepare_machine(tmp_path / "root", **kw), runner=runner or RecordingRunner())  # type: ignore[arg-type]


# -- claims and inventory -----------------------------------------------------------------


def test_claims_come_from_dmi_and_the_physical_nics(tmp_path: Path) -> None:
    runner = RecordingRunner(
        programs={"nvidia-smi"},
        answers={"nvidia-smi": lambda argv: RunAnswer(stdout="GPU-bbb\nGPU-aaa\n")},
    )
    m = machine(tmp_path, runner, macs=("52:54:00:AA:00:02", "52:54:00:aa:00:01"), serial="SER-9")
    got = claims(m)
    assert got.product_uuid == "4c4c4544-0042-3510-8052-b4c04f4e3432"
    assert got.serial == "SER-9"
    assert got.macs == ["52:54:00:aa:00:01", "52:54:00:aa:00:02"]  # lo is not a claim
    assert got.gpu_uuids == ["GPU-aaa", "GPU-bbb"]
    assert got.hostname == "sim-node"


def test_a_board_without_a_real_serial_claims_none(tmp_path: Path) -> None:
    m = machine(tmp_path, serial="To Be Filled By O.E.M.")
    assert claims(m).serial is None


def test_inventory_of_a_prepared_tree(tmp_path: Path) -> None:
    m = machine(
        tmp_path,
        disks=(DiskSpec("sda", size=64 << 20, rotational=True, serial="WD-1"), DiskSpec("nvme0n1")),
        root_disk="sda",
        cpus=8,
    )
    (m.root / "sys/block/loop0/device").mkdir(parents=True)  # not a disk
    inv = inventory(m)
    inv = to_builtins(inv)
    assert inv["cpus"]["threads"] == 8
    assert inv["cpus"]["virtualization"] is True
    assert inv["memory"]["totalBytes"] == 16 << 30
    disks = {d["name"]: d for d in inv["disks"]}
    assert set(disks) == {"sda", "nvme0n1"}
    assert (
        disks["sda"].items()
        >= {"sizeBytes": 64 << 20, "serial": "WD-1", "rotational": True, "boot": True}.items()
    )
    assert disks["nvme0n1"]["rotational"] is False
    assert inv["nics"][0].items() >= {"mac": "52:54:00:12:34:56", "link": True, "speedMbps": 25000}.items()
    assert inv["firmware"]["biosVersion"] == "1.2.3"


def test_inventory_of_this_machine_reads_only() -> None:
    inv = inventory(Machine())
    inv = to_builtins(inv)
    assert inv["cpus"]["threads"] == os.cpu_count()
    assert inv["memory"]["totalBytes"] > 0
    assert inv["nics"], "this machine has a NIC"
    if shutil.which("lsblk"):
        assert inv["disks"], "lsblk sees a disk here, so must bcd"
        assert all(d["sizeBytes"] for d in inv["disks"])


# -- wipe ---------------------------------------------------------------------------------


def _mbr(path: Path, start_sector: int, sectors: int) -> None:
    entry = struct.pack("<B3sB3sII", 0x80, b"\x00" * 3, 0x83, b"\x00" * 3, start_sector, sectors)
    with open(path, "r+b") as fh:
        fh.seek(446)
        fh.write(entry)
        fh.seek(510)
        fh.write(b"\x55\xaa")


def _sigs(path: Path) -> list[str]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return signatures(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def test_wipe_erases_every_table_and_superblock_wipefs_would_find(tmp_path: Path) -> None:
    m = machine(tmp_path, disks=(DiskSpec("vdb", size=96 << 20), DiskSpec("vdc", size=96 << 20)))
    vdb, vdc = m.root / "dev/vdb", m.root / "dev/vdc"
    # vdb: a DOS table with an ext4 partition at 1 MiB, and a stray btrfs mirror superblock at 64 MiB
    _mbr(vdb, 2048, (90 << 20) // 512)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "offset=1048576", str(vdb), "40M"], check=True)
    with open(vdb, "r+b") as fh:
        fh.seek((64 << 20) + 0x40)
        fh.write(b"_BHRfS_M")
    # vdc: ext4 on the whole disk
    subprocess.run(["mkfs.ext4", "-q", "-F", str(vdc)], check=True)
    assert _sigs(vdb) == ["dos", "ext4@1048576"]
    if shutil.which("wipefs"):
        assert "ext4" in subprocess.run(["wipefs", "-n", str(vdc)], capture_output=True, text=True).stdout
    report = wipe(m, disks=["/dev/vdb", "/dev/vdc"])
    report = to_builtins(report)
    assert [d["disk"] for d in report["disks"]] == ["/dev/vdb", "/dev/vdc"]
    assert report["disks"][0]["signaturesErased"] == ["dos", "ext4@1048576"]
    assert report["disks"][0]["partitions"] == 1
    assert _sigs(vdb) == []
    assert _sigs(vdc) == []
    data = vdb.read_bytes()
    assert b"_BHRfS_M" not in data
    assert data[-MIB:] == bytes(MIB)
    if shutil.which("wipefs"):
        for disk in (vdb, vdc):
            shown = subprocess.run(["wipefs", "-n", str(disk)], capture_output=True, text=True).stdout
            assert shown.strip() == "", shown


def test_wipe_refuses_the_disk_bcd_runs_from_and_skips_it_when_wiping_all(tmp_path: Path) -> None:
    m = machine(tmp_path, disks=(DiskSpec("vda"), DiskSpec("vdb")), root_disk="vda")
    for name in ("vda", "vdb"):
        with open(m.root / f"dev/{name}", "r+b") as fh:
            fh.write(b"\xffbootloader")
    assert boot_disk(m) == "vda"
    with pytest.raises(CommandRejected) as info:
        wipe(m, disks=["/dev/vdb", "/dev/vda"])
    assert info.value.reason.startswith("boot-disk")
    assert (m.root / "dev/vdb").read_bytes()[:11] == b"\xffbootloader"  # refused before touching any
    report = wipe(m, disks=None)
    report = to_builtins(report)
    assert report["disks"][0]["disk"] == "/dev/vdb"
    assert report["disks"][1] == {"disk": "/dev/vda", "skipped": "bcd runs from this disk"}
    assert (m.root / "dev/vda").read_bytes()[:11] == b"\xffbootloader"
    assert (m.root / "dev/vdb").read_bytes()[:11] == bytes(11)


def test_a_root_on_lvm_over_raid_protects_every_disk_beneath_it(tmp_path: Path) -> None:
    m = machine(tmp_path, disks=(DiskSpec("vda"), DiskSpec("vdb"), DiskSpec("vdc")))
    (m.root / "proc/mounts").write_text("/dev/mapper/vg-root / ext4 rw 0 0\n")
    (m.root / "dev/mapper").mkdir()
    (m.root / "dev/mapper/vg-root").symlink_to("../dm-0")
    for holder, parts in {"dm-0": ["md0"], "md0": ["vda2", "vdb2"]}.items():
        for part in parts:
            (m.root / f"sys/class/block/{holder}/slaves/{part}").mkdir(parents=True)
    assert boot_disks(m) == {"vda", "vdb"}
    for disk in ("/dev/vda", "/dev/vdb"):
        with pytest.raises(CommandRejected, match="boot-disk"):
            wipe(m, disks=[disk])
    report = wipe(m, disks=None)
    report = to_builtins(report)
    assert [d["disk"] for d in report["disks"] if "skipped" not in d] == ["/dev/vdc"]


def test_wipe_of_a_disk_that_is_not_there_names_it(tmp_path: Path) -> None:
    with pytest.raises(BcError) as info:
        wipe(machine(tmp_path), disks=["/dev/sdz"])
    assert (info.value.code, info.value.path) == (ErrorCode.INVALID_INPUT, "disks[0]")


# -- image write ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache() -> Iterator[tuple[Path, str]]:
    """A site cache stand-in: files served over HTTP on loopback."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="bcd-cache-"))
    handler = lambda *a, **kw: http.server.SimpleHTTPRequestHandler(*a, directory=str(folder), **kw)  # noqa: E731
    http.server.SimpleHTTPRequestHandler.log_message = lambda *a: None  # type: ignore[method-assign]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield folder, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    shutil.rmtree(folder)


def _image(size: int) -> bytes:
    block = hashlib.sha256(b"image").digest() * 64  # 2 KiB
    head = b"\xeb\x63\x90" + bytes(507) + b"\x55\xaa"  # a boot sector
    return (head + block * (size // len(block) + 1))[:size]


@pytest.mark.parametrize("fmt", ["raw", "raw.gz", "raw.zst"])
def test_image_write_streams_verifies_and_reads_back(
    tmp_path: Path, cache: tuple[Path, str], fmt: str
) -> None:
    folder, base = cache
    raw = _image(3 * MIB + 12345)
    packed = {"raw": raw, "raw.gz": gzip.compress(raw), "raw.zst": zstandard.ZstdCompressor().compress(raw)}[
        fmt
    ]
    (folder / f"img-{fmt}").write_bytes(packed)
    m = machine(
        tmp_path, disks=(DiskSpec("vda", size=16 << 20), DiskSpec("vdb", size=16 << 20)), root_disk="vda"
    )
    seen: list[tuple[str, float | None]] = []
    got = image_write(
        m, url=f"{base}/img-{fmt}", sha256=hashlib.sha256(packed).hexdigest(), fmt=fmt,
        progress=lambda msg, pct: seen.append((msg, pct)),
    )  # fmt: skip
    got = to_builtins(got)
    assert got.items() >= {"disk": "/dev/vdb", "verified": True, "bytesWritten": len(raw)}.items()
    assert got["writtenSha256"] == hashlib.sha256(raw).hexdigest()
    assert (m.root / "dev/vdb").read_bytes()[: len(raw)] == raw
    assert seen
    assert seen[-1][0] == "verifying"


def test_the_image_reaches_the_disk_as_it_is_written_not_all_at_the_end(
    tmp_path: Path, cache: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # without the flush the page cache held the whole image until the final fsync: in the VM lab
    # a 77 MiB image reached the VM's disk file in 0.2 s at its end, so a power cut at "writing
    # 90%" left none of it on the disk (tests/e2e/test_vm_lifecycle.py, the crash mid-write)
    folder, base = cache
    raw = _image(SYNC_EVERY * 3 + 5 * MIB)
    (folder / "big.img").write_bytes(raw)
    m = machine(tmp_path, disks=(DiskSpec("vdb", size=len(raw) + 4 * MIB),))
    unsynced, most = [0], [0]
    pwrite, fdatasync, fsync = os.pwrite, os.fdatasync, os.fsync

    def counting_pwrite(fd: int, data: bytes, offset: int) -> int:
        unsynced[0] += len(data)
        most[0] = max(most[0], unsynced[0])
        return pwrite(fd, data, offset)

    def synced(real: Any) -> Any:
        def call(fd: int) -> None:
            unsynced[0] = 0
            real(fd)

        return call

    monkeypatch.setattr(os, "pwrite", counting_pwrite)
    monkeypatch.setattr(os, "fdatasync", synced(fdatasync))
    monkeypatch.setattr(os, "fsync", synced(fsync))
    got = image_write(m, url=f"{base}/big.img", sha256=hashlib.sha256(raw).hexdigest())
    got = to_builtins(got)
    assert got["bytesWritten"] == len(raw)
    assert (m.root / "dev/vdb").read_bytes()[: len(raw)] == raw
    assert most[0] <= SYNC_EVERY + MIB  # never more than that written and not yet on the disk


@pytest.mark.parametrize("fmt", ["raw.gz", "raw.zst"])
def test_an_image_of_several_members_or_frames_is_written_whole(
    tmp_path: Path, cache: tuple[Path, str], fmt: str
) -> None:
    # pigz and zstd -T write several gzip members / zstd frames; gzip -d and zstd -d read them all
    folder, base = cache
    raw = _image(3 * MIB)
    parts = [raw[: MIB + 5], raw[MIB + 5 : 2 * MIB], raw[2 * MIB :]]
    pack = gzip.compress if fmt == "raw.gz" else zstandard.ZstdCompressor().compress
    packed = b"".join(pack(p) for p in parts)
    (folder / f"multi-{fmt}").write_bytes(packed)
    m = machine(tmp_path, disks=(DiskSpec("vdb", size=8 << 20),))
    got = image_write(m, url=f"{base}/multi-{fmt}", sha256=hashlib.sha256(packed).hexdigest(), fmt=fmt)
    got = to_builtins(got)
    assert got["bytesWritten"] == len(raw)
    assert (m.root / "dev/vdb").read_bytes()[: len(raw)] == raw


def test_a_corrupted_image_fails_with_both_digests_and_leaves_the_disk_unbootable(
    tmp_path: Path, cache: tuple[Path, str]
) -> None:
    folder, base = cache
    raw = _image(2 * MIB)
    expected = hashlib.sha256(raw).hexdigest()
    corrupted = bytearray(raw)
    corrupted[MIB + 7] ^= 0xFF
    (folder / "corrupt.img").write_bytes(bytes(corrupted))
    m = machine(tmp_path, disks=(DiskSpec("vdb", size=8 << 20),))
    disk = m.root / "dev/vdb"
    with open(disk, "r+b") as fh:  # what a previous install left: a bootable disk
        fh.write(_image(MIB))
    with pytest.raises(BcError) as info:
        image_write(m, url=f"{base}/corrupt.img", sha256=expected, disk="/dev/vdb")
    actual = hashlib.sha256(bytes(corrupted)).hexdigest()
    assert expected in info.value.message
    assert actual in info.value.message
    assert (
        info.value.details.items()
        >= {"expected": expected, "actual": actual, "reason": "digest-mismatch"}.items()
    )
    data = disk.read_bytes()
    assert data[:MIB] == bytes(MIB)
    assert data[-MIB:] == bytes(MIB)


def test_image_write_refuses_the_boot_disk_and_unknown_formats(
    tmp_path: Path, cache: tuple[Path, str]
) -> None:
    _, base = cache
    m = machine(tmp_path, disks=(DiskSpec("vda"), DiskSpec("vdb")), root_disk="vda")
    with pytest.raises(CommandRejected, match="boot-disk"):
        image_write(m, url=f"{base}/x", sha256="0" * 64, disk="/dev/vda")
    with pytest.raises(CommandRejected, match="qcow2 is not supported"):
        image_write(m, url=f"{base}/x", sha256="0" * 64, fmt="qcow2", disk="/dev/vdb")


# -- modes --------------------------------------------------------------------------------------


def test_the_ramdisk_serves_disks_and_the_installed_os_the_converger(tmp_path: Path) -> None:
    m = machine(tmp_path)
    assert detect_mode(m) == "installed"
    (m.root / "proc/cmdline").write_text("console=ttyS0 bcd.mode=ramdisk\n")
    assert detect_mode(m) == "ramdisk"
    assert sorted(node_handlers(m, "ramdisk")) == ["node.imageWrite", "node.inventory", "node.wipe"]
    assert sorted(node_handlers(m, "installed", converger=Converger(m))) == [
        "node.converge",
        "node.inventory",
    ]
    with pytest.raises(BcError) as info:
        detect_mode(m, "rescue")
    assert info.value.path == "mode"


def test_user_data_goes_on_a_config_drive_and_a_drive_that_cannot_be_added_leaves_no_bootable_disk(
    tmp_path: Path, cache: tuple[Path, str]
) -> None:
    folder, base = cache
    m = machine(
        tmp_path, disks=(DiskSpec("vda", size=8 << 20), DiskSpec("vdb", size=16 << 20)), root_disk="vda"
    )
    drive = ConfigDrive(user_data=b"#cloud-config\n{}\n", node_id="node_01J0000000000000000000000A")
    raw = _image(2 * MIB)  # a boot sector and an empty MBR: the drive takes slot 1
    (folder / "mbr.img").write_bytes(raw)
    got = image_write(m, url=f"{base}/mbr.img", sha256=hashlib.sha256(raw).hexdigest(), config_drive=drive)
    got = to_builtins(got)
    assert got["configDrive"]["partition"] == 1
    assert got["configDrive"]["offset"] == 2 * MIB
    assert "cloud-config" not in json.dumps(got)  # where it went, never what it holds
    bare = bytes(range(256)) * (8 * 1024)  # no partition table at all
    (folder / "bare.img").write_bytes(bare)
    with pytest.raises(BcError) as info:
        image_write(m, url=f"{base}/bare.img", sha256=hashlib.sha256(bare).hexdigest(), config_drive=drive)
    assert (info.value.code, info.value.details["reason"]) == (ErrorCode.DRIVER_ERROR, "no-partition-table")
    assert "left not bootable" in info.value.message
    assert (m.root / "dev/vdb").read_bytes()[:MIB] == bytes(MIB)


async def test_a_refused_user_data_fetch_leaves_the_disk_as_it_was(tmp_path: Path) -> None:
    m = machine(
        tmp_path, disks=(DiskSpec("vda", size=8 << 20), DiskSpec("vdb", size=8 << 20)), root_disk="vda"
    )
    before = os.urandom(4096)
    (m.root / "dev/vdb").write_bytes(before + bytes((8 << 20) - 4096))
    fetched: list[str] = []

    async def refuse(ref: str) -> bytes:
        fetched.append(ref)
        raise BcError(ErrorCode.PERMISSION_DENIED, "no live command for this agent carries this reference")

    handler = node_handlers(m, "ramdisk", fetch_secret=refuse, node_id="node_01J0000000000000000000000A")
    ref = new_id("sec")
    cmd = Command(id="cmd_1", kind="node.imageWrite", node_id="node_01J0000000000000000000000A", site_id="s",
                  key="k", destructive=True, not_after=0.0, batch_id=None, workflow_id=None, step=None,
                  payload={"url": "http://127.0.0.1:9/never", "sha256": "0" * 64, "userDataRef": ref},
                  _agent=None)  # type: ignore[arg-type]  # fmt: skip
    with pytest.raises(BcError) as info:
        await handler["node.imageWrite"](cmd)
    assert info.value.code is ErrorCode.PERMISSION_DENIED
    assert fetched == [ref]
    assert (m.root / "dev/vdb").read_bytes()[:4096] == before  # nothing written: fetched first


def test_the_installed_os_takes_the_bus_files_from_the_config_drive_the_ramdisk_wrote(
    tmp_path: Path, cache: tuple[Path, str]
) -> None:
    """Issue 23: the ramdisk's bcd puts the bus CA (with its digest) and the site's joining
    certificate, which the boot path gave it, on the config drive after the image; the installed
    OS's bcd finds the drive on its disk and keeps them, refusing a CA that is not the digest's."""
    folder, base = cache
    ramdisk = machine(tmp_path / "ramdisk", disks=(DiskSpec("vdb", size=16 << 20),))
    boot_path = tmp_path / "ramdisk-state"
    boot_path.mkdir()
    (boot_path / "bus-ca.pem").write_bytes(
        b"-----BEGIN CERTIFICATE-----\nbus CA\n-----END CERTIFICATE-----\n"
    )
    joining = b"-----BEGIN CERTIFICATE-----\nj\n-----END CERTIFICATE-----\n-----BEGIN PRIVATE KEY-----\nk\n"
    (boot_path / "join.pem").write_bytes(joining)
    raw = _image(2 * MIB)
    (folder / "os.img").write_bytes(raw)
    drive = ConfigDrive(user_data=b"#cloud-config\n{}\n", node_id="node_01J0000000000000000000000A",
                        bus=carried_bus(boot_path))  # fmt: skip
    got = image_write(
        ramdisk, url=f"{base}/os.img", sha256=hashlib.sha256(raw).hexdigest(), config_drive=drive
    )
    got = to_builtins(got)
    assert got["configDrive"]["busFiles"] is True
    assert b"PRIVATE KEY" not in json.dumps(got).encode()

    def installed(name: str, disk: bytes) -> Machine:
        m = machine(tmp_path / name, disks=(DiskSpec("vda", size=len(disk)),), root_disk="vda")
        (m.root / "dev/vda").write_bytes(disk)
        return m

    written = (ramdisk.root / "dev/vdb").read_bytes()
    state = tmp_path / "installed-state"
    assert adopt_config_drive(installed("os", written), state) is True
    assert (state / "bus-ca.pem").read_bytes() == (boot_path / "bus-ca.pem").read_bytes()
    assert (state / "join.pem").read_bytes() == joining
    assert (state / "join.pem").stat().st_mode & 0o077 == 0

    # a CA that is not the one its digest names (the drive edited): refused, nothing kept
    tampered = written.replace(b"bus CA", b"evil!!", 1)
    assert tampered != written
    elsewhere = tmp_path / "tampered-state"
    with pytest.raises(BcError) as info:
        adopt_config_drive(installed("tampered", tampered), elsewhere)
    assert (info.value.code, info.value.path) == (
        ErrorCode.INVALID_CONFIG,
        "configDrive.bcd-bus.json.caSha256",
    )
    assert not elsewhere.exists()

    # a ramdisk the boot path gave no bus files: the drive carries none, the OS takes none
    assert carried_bus(tmp_path / "nothing") is None
    plain = ConfigDrive(user_data=b"#cloud-config\n{}\n", node_id="node_01J0000000000000000000000A")
    got = image_write(
        ramdisk, url=f"{base}/os.img", sha256=hashlib.sha256(raw).hexdigest(), config_drive=plain
    )
    got = to_builtins(got)
    assert got["configDrive"]["busFiles"] is False
    assert adopt_config_drive(installed("plain", (ramdisk.root / "dev/vdb").read_bytes()), elsewhere) is False


def test_only_the_installed_os_takes_a_config_drive_s_bus_files(
    tmp_path: Path, cache: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``bcd join`` in the installed OS reads the drive before it connects (a CA not matching
    its digest stops it there); a ramdisk, whose disks may hold an earlier OS's drive, does not
    read it, nor does a join given ``BC_NATS_CA`` by hand."""
    folder, base = cache
    m = machine(tmp_path, disks=(DiskSpec("vda", size=16 << 20),))
    raw = _image(2 * MIB)
    (folder / "os.img").write_bytes(raw)
    bad = b'{"caSha256": "' + b"0" * 64 + b'", "ca": "CA", "join": "J"}\n'
    drive = ConfigDrive(user_data=b"#cloud-config\n{}\n", node_id="node_01J0000000000000000000000A", bus=bad)
    image_write(
        m, url=f"{base}/os.img", sha256=hashlib.sha256(raw).hexdigest(), disk="/dev/vda", config_drive=drive
    )
    (m.root / "join-token").write_text("bcjt_unused")
    argv = ["--root", str(m.root), "join", "--control-plane", "nats://127.0.0.1:9",
            "--token-file", "/join-token", "--no-service"]  # fmt: skip

    def join_says() -> str:
        with pytest.raises(SystemExit):
            bcd_main(argv)
        return capsys.readouterr().err

    assert "configDrive.bcd-bus.json.caSha256" in join_says()  # the installed OS: read, refused
    (m.root / "etc/bcd").mkdir(parents=True, exist_ok=True)
    (m.root / "etc/bcd/ramdisk").write_text("")
    assert "configDrive" not in join_says()  # a ramdisk: not read (it fails to connect instead)
    assert not (m.root / "var/lib/bcd/bus-ca.pem").exists()
