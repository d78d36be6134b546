"""Disks: ``node.wipe`` (wipefs semantics) and the device helpers ``image.py`` shares.

Both disk commands refuse the disk bcd runs from. Disks are ``/dev/<name>`` under the
machine's root, so a test can hand plain files to them.
"""

from __future__ import annotations

import os
import stat
import struct
import time
from collections.abc import Callable
from typing import Final

from better_compute.agent import CommandRejected
from better_compute.core.errors import BcError, ErrorCode
from better_compute.service.killpoints import declare, kill_point
from better_compute.wire.commands import DiskWiped, WipeResult

from .hardware import block_disks, boot_disks
from .system import Machine

__all__ = [
    "AFTER_DISK_WRITE", "BEFORE_DISK_WRITE", "CHUNK", "MIB", "Progress", "device_size", "disk_path",
    "signatures", "wipe", "zero",
]  # fmt: skip

# Where a chaos test may SIGKILL bcd (a wipe's or an image write's, docs/chaos.md).
BEFORE_DISK_WRITE = declare("bcd.before-disk-write", "bcd", "a disk write is due, the disk is untouched")
AFTER_DISK_WRITE = declare("bcd.after-disk-write", "bcd", "the disk is written and synced, bcd has no result")

MIB: Final = 1 << 20
CHUNK: Final = 4 * MIB
_BLKDISCARD: Final = 0x1277
_BTRFS_MIRRORS: Final = (64 * MIB, 256 << 30)
_MBR_EXTENDED: Final = frozenset({0x05, 0x0F, 0x85})

Progress = Callable[[str, float | None], None]


# -- devices ------------------------------------------------------------------------


def _disk_name(path: str) -> str:
    return path.removeprefix("/dev/")


def disk_path(machine: Machine, disk: str, *, where: str) -> str:
    """``disk``'s path under the root, refusing the boot disk and a disk that is not there."""
    name = _disk_name(disk)
    if "/" in name or name in ("", ".", ".."):
        raise BcError(ErrorCode.INVALID_INPUT, f"{disk} is not a disk", {"path": where})
    if name in boot_disks(machine):
        raise CommandRejected(f"boot-disk: bcd runs from {disk}; it does not erase or overwrite it")
    path = machine.path(f"/dev/{name}")
    if not path.exists():
        raise BcError(ErrorCode.INVALID_INPUT, f"no disk {disk} on this machine", {"path": where})
    return str(path)


def device_size(fd: int) -> int:
    return os.lseek(fd, 0, os.SEEK_END)


def _read(fd: int, offset: int, length: int) -> bytes:
    return os.pread(fd, length, offset) if offset >= 0 else b""


def zero(fd: int, offset: int, length: int) -> None:
    zeros = bytes(min(length, CHUNK))
    end = offset + length
    while offset < end:
        n = min(len(zeros), end - offset)
        os.pwrite(fd, zeros[:n], offset)
        offset += n


# -- partition tables and signatures ------------------------------------------------


def _partitions(fd: int, size: int) -> tuple[str | None, list[tuple[int, int]]]:
    """The partition table kind and each partition's ``(start, length)`` in bytes."""
    for sector in (512, 4096):
        header = _read(fd, sector, 92)
        if header[:8] == b"EFI PART":
            entries_lba, count, entry_size = struct.unpack_from("<QII", header, 72)
            count = min(count, 256)
            raw = _read(fd, entries_lba * sector, count * entry_size)
            parts = []
            for i in range(count):
                entry = raw[i * entry_size : (i + 1) * entry_size]
                if len(entry) < 56 or entry[:16] == bytes(16):
                    continue
                first, last = struct.unpack_from("<QQ", entry, 32)
                if first <= last:
                    parts.append((first * sector, (last - first + 1) * sector))
            return "gpt", parts
    mbr = _read(fd, 0, 512)
    if len(mbr) == 512 and mbr[510:512] == b"\x55\xaa":
        parts = []
        for i in range(4):
            entry = mbr[446 + 16 * i : 446 + 16 * (i + 1)]
            kind = entry[4]
            start, count = struct.unpack_from("<II", entry, 8)
            if kind == 0 or count == 0:
                continue
            if kind == 0xEE:
                return "gpt-protective", []
            # an extended partition's first MiB holds its chain of logical partitions
            parts.append((start * 512, count * 512))
        if parts:
            return "dos", parts
    return None, []


_MAGICS: Final = (
    ("xfs", 0, b"XFSB"),
    ("ext4", 1080, b"\x53\xef"),
    ("btrfs", 0x10040, b"_BHRfS_M"),
    ("swap", 4086, b"SWAPSPACE2"),
    ("swap", 4086, b"SWAP-SPACE"),
    ("LVM2_member", 536, b"LVM2 001"),
    ("iso9660", 32769, b"CD001"),
    ("linux_raid_member", 4096, b"\xfc\x4e\x2b\xa9"),
    ("vfat", 82, b"FAT32   "),
    ("zfs_member", 0x4000 * 8, b"\x0c\xb1\xba\x00"),
)


def signatures(fd: int, size: int) -> list[str]:
    """The partition-table and superblock signatures ``fd`` shows (disk and partitions)."""
    table, parts = _partitions(fd, size)
    found = [table.replace("-protective", "")] if table else []
    for base in [0, *(start for start, _ in parts)]:
        for name, offset, magic in _MAGICS:
            if base + offset + len(magic) <= size and _read(fd, base + offset, len(magic)) == magic:
                found.append(name if base == 0 else f"{name}@{base}")
    return found


def _regions(size: int, parts: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """What a wipe erases: the first and last MiB of the disk and of every partition, and the
    btrfs superblock mirrors; merged, clipped to the disk."""
    spans: list[tuple[int, int]] = []
    for start, length in [(0, size), *parts]:
        spans.append((start, min(MIB, length)))
        spans.append((max(start, start + length - MIB), min(MIB, length)))
        spans.extend((start + mirror, 4096) for mirror in _BTRFS_MIRRORS if mirror + 4096 <= length)
    merged: list[tuple[int, int]] = []
    for start, length in sorted((s, min(n, size - s)) for s, n in spans if 0 <= s < size):
        if merged and start <= merged[-1][0] + merged[-1][1]:
            last_start, last_len = merged[-1]
            merged[-1] = (last_start, max(last_len, start + length - last_start))
        else:
            merged.append((start, length))
    return merged


def _discard(fd: int, size: int) -> bool:
    """Discard the whole device (``BLKDISCARD``); False where it cannot (a plain file)."""
    if not stat.S_ISBLK(os.fstat(fd).st_mode):
        return False
    import fcntl

    try:
        fcntl.ioctl(fd, _BLKDISCARD, struct.pack("QQ", 0, size))
    except OSError:
        return False
    return True


def wipe(machine: Machine, *, disks: list[str] | None, mode: str = "quick") -> WipeResult:
    """Erase every partition table and superblock signature of ``disks`` (every disk but the
    boot disk when None) and report each disk.

    ``quick`` zeroes the first and last MiB of the disk and of each partition (and the btrfs
    mirrors), ``discard`` first discards the whole device where it can, ``secure`` zeroes all
    of it.
    """
    boot = boot_disks(machine)
    if disks:
        targets = [(d, disk_path(machine, d, where=f"disks[{i}]")) for i, d in enumerate(disks)]
        skipped: list[DiskWiped] = []
    else:
        names = block_disks(machine)
        targets = [(f"/dev/{n}", str(machine.path(f"/dev/{n}"))) for n in names if n not in boot]
        skipped = [DiskWiped(disk=f"/dev/{n}", skipped="bcd runs from this disk") for n in names if n in boot]
    reports = []
    for disk, path in targets:
        t0 = time.monotonic()
        kill_point(BEFORE_DISK_WRITE)
        fd = os.open(path, os.O_RDWR)
        try:
            size = device_size(fd)
            table, parts = _partitions(fd, size)
            before = signatures(fd, size)
            discarded = mode == "discard" and _discard(fd, size)
            regions = [(0, size)] if mode == "secure" else _regions(size, parts)
            for start, length in regions:
                zero(fd, start, length)
            os.fsync(fd)
            kill_point(AFTER_DISK_WRITE)
            after = signatures(fd, size)
        finally:
            os.close(fd)
        if after:
            raise BcError(
                ErrorCode.DRIVER_ERROR,
                f"{disk} still shows {', '.join(after)} after the wipe",
                {"path": disk, "reason": "signatures-left"},
            )
        reports.append(
            DiskWiped(
                disk=disk,
                size_bytes=size,
                mode=mode,
                partition_table=table,
                partitions=len(parts),
                signatures_erased=before,
                erased_bytes=sum(length for _, length in regions),
                discarded=discarded,
                ms=round((time.monotonic() - t0) * 1000, 1),
            )
        )
    return WipeResult(disks=reports + skipped)
