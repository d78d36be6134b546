"""bcd's NoCloud config drive on disk files, read back with the host's own tools: ``sfdisk``
finds the new partition (and ``--verify`` passes on GPT, backup header moved), ``blkid`` finds
``LABEL=cidata TYPE=iso9660`` on it, ``isoinfo`` reads ``user-data`` and ``meta-data`` out of it,
and the image's own partitions hold the same bytes as before."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from msgspec import to_builtins

from bcd.configdrive import BUS_FILE, ConfigDrive, read_config_drive, write_config_drive
from better_compute.core.errors import BcError, ErrorCode

pytestmark = pytest.mark.integration

MIB = 1 << 20
NODE = "node_0123456789abcdefghjkmnpqrs"
USER_DATA = b'#cloud-config\n{"write_files": [{"path": "/etc/bcd/join-token", "content": "bcjt_x"}]}\n'


def run(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def image(path: Path, label: str, parts: list[str], *, size: int = 8 * MIB) -> int:
    """A disk image of ``size`` with ``parts`` (sfdisk lines), each filled with its own bytes."""
    with path.open("wb") as fh:
        fh.truncate(size)
    script = f"label: {label}\n" + "".join(f"{p}\n" for p in parts)
    subprocess.run(["sfdisk", "-q", str(path)], input=script, text=True, check=True, capture_output=True)
    for n, part in enumerate(table(path), start=1):
        with path.open("r+b") as fh:
            fh.seek(part["start"] * 512)
            fh.write(bytes([n]) * part["size"] * 512)
    return size


def table(path: Path) -> list[dict[str, Any]]:
    doc = json.loads(run("sfdisk", "-J", str(path)))
    return list(doc["partitiontable"].get("partitions", []))


def contents(path: Path) -> list[str]:
    """Each partition's sha256: the image's partitions must read the same afterwards."""
    data = path.read_bytes()
    return [
        hashlib.sha256(data[p["start"] * 512 : (p["start"] + p["size"]) * 512]).hexdigest()
        for p in table(path)
    ]


def disk(tmp_path: Path, label: str, parts: list[str], *, disk_size: int = 32 * MIB) -> tuple[Path, int]:
    """The image written to the start of a larger disk, as ``node.imageWrite`` leaves it."""
    img = tmp_path / "image.raw"
    written = image(img, label, parts)
    target = tmp_path / "vdb"
    with target.open("wb") as fh:
        fh.write(img.read_bytes())
        fh.truncate(disk_size)
    return target, written


def write(target: Path, written: int) -> dict[str, Any]:
    fd = os.open(target, os.O_RDWR)
    try:
        placed = write_config_drive(fd, ConfigDrive(user_data=USER_DATA, node_id=NODE), image_bytes=written)
        return to_builtins(placed)
    finally:
        os.close(fd)


def probe(target: Path, part: dict[str, Any]) -> dict[str, str]:
    out = run("blkid", "-p", "-o", "export", "-O", str(part["start"] * 512), "-S", str(part["size"] * 512),
              str(target))  # fmt: skip
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def iso_file(target: Path, part: dict[str, Any], name: str, tmp_path: Path) -> bytes:
    iso = tmp_path / "drive.iso"
    with target.open("rb") as fh:
        fh.seek(part["start"] * 512)
        iso.write_bytes(fh.read(part["size"] * 512))
    return subprocess.run(["isoinfo", "-R", "-i", str(iso), "-x", f"/{name}"], check=True,
                          capture_output=True).stdout  # fmt: skip


@pytest.mark.parametrize("label", ["dos", "gpt"])
def test_the_config_drive_is_a_cidata_iso_on_a_new_partition_after_the_image(
    tmp_path: Path, label: str
) -> None:
    target, written = disk(tmp_path, label, ["start=2048, size=4096", "start=6144, size=4096"])
    before = contents(target)
    placed = write(target, written)
    parts = table(target)
    assert len(parts) == 3
    assert contents(target)[:2] == before  # the image's own partitions are untouched
    new = parts[2]
    assert new["start"] * 512 >= written  # after the image, MiB-aligned
    assert new["start"] % 2048 == 0
    assert (placed["table"], placed["partition"], placed["offset"]) == (label.replace("dos", "mbr"), 3,
                                                                        new["start"] * 512)  # fmt: skip
    found = probe(target, new)
    assert (found["LABEL"], found["TYPE"]) == ("cidata", "iso9660")
    assert iso_file(target, new, "user-data", tmp_path) == USER_DATA
    meta = iso_file(target, new, "meta-data", tmp_path).decode()
    assert meta == f"instance-id: {NODE}\nlocal-hostname: {NODE.replace('_', '-')}\n"
    if label == "gpt":
        # the backup GPT moved to the disk's end: sfdisk finds nothing wrong, and the last
        # usable sector is the larger disk's
        verify = subprocess.run(["sfdisk", "--verify", str(target)], capture_output=True, text=True)
        assert verify.returncode == 0, verify.stdout + verify.stderr
        assert "No errors detected" in verify.stdout
        assert "header" not in verify.stderr.lower(), verify.stderr
        doc = json.loads(run("sfdisk", "-J", str(target)))["partitiontable"]
        assert doc["lastlba"] == (32 * MIB) // 512 - 34
        assert new["type"].upper() == "0FC63DAF-8483-4772-8E79-3D69D8477DE4"


@pytest.mark.parametrize("label", ["dos", "gpt"])
def test_writing_the_drive_again_leaves_one(tmp_path: Path, label: str) -> None:
    target, written = disk(tmp_path, label, ["start=2048, size=4096"])
    first = write(target, written)
    second = write(target, written)
    assert (first["partition"], first["offset"]) == (second["partition"], second["offset"])
    parts = table(target)
    assert len(parts) == 2
    assert probe(target, parts[1])["LABEL"] == "cidata"


def test_an_image_without_a_partition_table_or_a_free_slot_is_refused(tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.write_bytes(bytes(4 * MIB))
    with pytest.raises(BcError) as info:
        write(bare, 2 * MIB)
    assert (info.value.code, info.value.details["reason"]) == (ErrorCode.DRIVER_ERROR, "no-partition-table")

    full, written = disk(tmp_path, "dos", [f"start={2048 * (i + 1)}, size=2048" for i in range(4)],
                         disk_size=32 * MIB)  # fmt: skip
    with pytest.raises(BcError) as info:
        write(full, written)
    assert info.value.details["reason"] == "no-free-slot"

    tight, written = disk(tmp_path, "dos", ["start=2048, size=14000"], disk_size=8 * MIB)
    with pytest.raises(BcError) as info:
        write(tight, written)
    assert info.value.details["reason"] == "disk-full"
    assert "bcjt" not in str(info.value)


@pytest.mark.parametrize("label", ["dos", "gpt"])
def test_the_bus_files_ride_on_the_drive_and_read_back_from_the_disk(tmp_path: Path, label: str) -> None:
    """What the installed OS's bcd joins with (issue 23): ``bcd-bus.json`` on the drive, as
    isoinfo reads it and as bcd finds it from the disk's own partition table."""
    target, written = disk(tmp_path, label, ["start=2048, size=4096"])
    bus = b'{"caSha256": "00", "ca": "CA", "join": "J"}\n'
    fd = os.open(target, os.O_RDWR)
    try:
        placed = write_config_drive(
            fd, ConfigDrive(user_data=USER_DATA, node_id=NODE, bus=bus), image_bytes=written
        )
        placed = to_builtins(placed)
        assert placed["busFiles"] is True
        assert read_config_drive(fd, BUS_FILE) == bus
        assert read_config_drive(fd, "user-data") == USER_DATA
    finally:
        os.close(fd)
    assert iso_file(target, table(target)[1], BUS_FILE, tmp_path) == bus
    assert "bus=[redacted]" in repr(ConfigDrive(user_data=USER_DATA, node_id=NODE, bus=bus))
    image_only = tmp_path / "image.raw"  # no drive at all
    fd = os.open(image_only, os.O_RDONLY)
    try:
        assert read_config_drive(fd, BUS_FILE) is None
    finally:
        os.close(fd)
