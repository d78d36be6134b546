"""A NoCloud config drive after a written image, as OpenStack Ironic's agent writes one.

After ``node.imageWrite`` wrote and verified the image, bcd adds a partition after the image's
last one and puts an ISO9660 filesystem labelled ``cidata`` there, holding ``user-data`` (the
document ``userdata.render`` stored, fetched through the secrets gate) and ``meta-data``
(``instance-id`` = the node id, ``local-hostname``). That is what cloud-init's NoCloud
datasource looks for on any cloud image, and what the project's test OS image reads. When the
ramdisk's bcd got the bus files through the boot path (``bcd.bus=``), the drive also holds
``bcd-bus.json``: the bus CA, its SHA-256 and the site's joining certificate and key, which the
installed OS's ``bcd join`` takes from it (``read_config_drive``; bcd.bus).

Both partition tables: MBR (a free primary slot) and GPT (a new entry; the backup header and
entries move to the end of the disk, which is larger than the image; CRCs updated). The image's
own partitions are left as they are. A table that already holds a ``cidata`` partition of ours
gets it rewritten in place, so writing twice leaves one.
"""

from __future__ import annotations

import io
import os
import struct
import uuid
import zlib
from dataclasses import dataclass
from typing import Final

import msgspec
import pycdlib

from better_compute.core.errors import BcError, ErrorCode
from better_compute.runtime import iso as runtime_iso
from better_compute.wire.commands import ConfigDrivePlaced

__all__ = [
    "BUS_FILE",
    "LABEL",
    "ConfigDrive",
    "iso_image",
    "meta_data",
    "read_config_drive",
    "write_config_drive",
]

LABEL: Final = "cidata"
BUS_FILE: Final = "bcd-bus.json"
_MAX_DRIVE: Final = 64 << 20  # a config drive larger than this is not one bcd wrote
SECTOR: Final = 512
_ALIGN: Final = 1 << 20  # partitions start on a MiB, as parted and sfdisk place them
_MBR_LINUX: Final = 0x83
_MBR_GPT: Final = 0xEE
_GPT_SIGNATURE: Final = b"EFI PART"
_GPT_LINUX_DATA: Final = uuid.UUID("0fc63daf-8483-4772-8e79-3d69d8477de4")
_ISO_PVD: Final = 16 * 2048  # the primary volume descriptor, 32 KiB into the filesystem


@dataclass(frozen=True, kw_only=True)
class ConfigDrive:
    """What goes on the drive: the user data as stored, the node it is for, and the bus files
    the installed OS's bcd needs (``bcd.bus.carried_bus``), if any."""

    user_data: bytes
    node_id: str
    bus: bytes | None = None

    def __repr__(self) -> str:
        bus = ", bus=[redacted]" if self.bus is not None else ""
        return f"ConfigDrive(node_id={self.node_id!r}, user_data=[redacted]{bus})"


def meta_data(node_id: str) -> bytes:
    """NoCloud ``meta-data``: the instance id is the node id, the hostname the one the user-data
    templates use for it (``hostname``: the id with ``-`` for ``_``)."""
    return f"instance-id: {node_id}\nlocal-hostname: {node_id.replace('_', '-')}\n".encode()


def iso_image(drive: ConfigDrive) -> bytes:
    """The ISO9660 filesystem (Rock Ridge and Joliet names, so ``user-data`` reads as such)."""
    files = [
        ("/USERDATA.;1", "user-data", drive.user_data),
        ("/METADATA.;1", "meta-data", meta_data(drive.node_id)),
    ]
    if drive.bus is not None:
        files.append(("/BCDBUS.JSN;1", BUS_FILE, drive.bus))
    return runtime_iso.iso_image(LABEL, files)


def _refuse(message: str, reason: str) -> BcError:
    return BcError(ErrorCode.DRIVER_ERROR, message, {"path": "userDataRef", "reason": reason})


def _align(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _ours(fd: int, start_sector: int) -> bool:
    """Whether the partition at ``start_sector`` holds a ``cidata`` ISO9660 filesystem."""
    pvd = os.pread(fd, 48, start_sector * SECTOR + _ISO_PVD)
    return pvd[1:6] == b"CD001" and pvd[40:48].rstrip(b" ").lower() == LABEL.encode()


def write_config_drive(fd: int, drive: ConfigDrive, *, image_bytes: int) -> ConfigDrivePlaced:
    """Add the config drive partition to the disk open at ``fd`` and write the ISO into it.

    ``image_bytes`` is how much the image wrote: the partition starts after it and after every
    partition of the image's table. Returns where it went (partition number, offsets, size,
    table), never the user data.

    Raises:
        BcError: ``DRIVER_ERROR`` with ``details.reason``: ``no-partition-table`` (the image has
            neither MBR nor GPT), ``no-free-slot``, ``disk-full``.
    """
    iso = iso_image(drive)
    disk_bytes = os.lseek(fd, 0, os.SEEK_END)
    mbr = os.pread(fd, SECTOR, 0)
    if len(mbr) < SECTOR or mbr[510:512] != b"\x55\xaa":
        raise _refuse(
            "the image has no partition table: a config drive partition cannot be added",
            "no-partition-table",
        )
    entries = [struct.unpack_from("<B3sB3sII", mbr, 446 + 16 * i) for i in range(4)]
    if any(e[2] == _MBR_GPT for e in entries):
        placed = _gpt(fd, iso, disk_bytes=disk_bytes, image_bytes=image_bytes)
    else:
        placed = _mbr(fd, mbr, iso, disk_bytes=disk_bytes, image_bytes=image_bytes)
    os.pwrite(fd, iso, placed.offset)
    os.fsync(fd)
    return msgspec.structs.replace(placed, label=LABEL, iso_bytes=len(iso), bus_files=drive.bus is not None)


def _drive_partitions(fd: int) -> list[tuple[int, int]]:
    """``(first sector, sectors)`` of each partition in the disk's MBR or GPT."""
    mbr = os.pread(fd, SECTOR, 0)
    if len(mbr) < SECTOR or mbr[510:512] != b"\x55\xaa":
        return []
    entries = [struct.unpack_from("<B3sB3sII", mbr, 446 + 16 * i) for i in range(4)]
    if not any(e[2] == _MBR_GPT for e in entries):
        return [(e[4], e[5]) for e in entries if e[2] and e[5]]
    header = _gpt_header(fd, 1)
    if header is None:
        return []
    table = os.pread(fd, header.entry_count * header.entry_size, header.entries_lba * SECTOR)
    found = []
    for i in range(header.entry_count):
        entry = table[i * header.entry_size : (i + 1) * header.entry_size]
        if len(entry) >= 48 and any(entry[:16]):
            first, last = struct.unpack_from("<QQ", entry, 32)
            found.append((first, last - first + 1))
    return found


def read_config_drive(fd: int, name: str) -> bytes | None:
    """The file ``name`` of the ``cidata`` config drive on the disk open at ``fd`` (read from
    the disk's own partition table, as the installed OS finds it), or None when the disk has
    no such drive or the drive no such file."""
    for first, count in _drive_partitions(fd):
        if count * SECTOR > _MAX_DRIVE or not _ours(fd, first):
            continue
        iso = pycdlib.PyCdlib()
        try:
            iso.open_fp(io.BytesIO(os.pread(fd, count * SECTOR, first * SECTOR)))
        except pycdlib.pycdlibexception.PyCdlibException:
            continue
        out = io.BytesIO()
        try:
            iso.get_file_from_iso_fp(out, rr_path=f"/{name}")
        except pycdlib.pycdlibexception.PyCdlibException:
            return None
        finally:
            iso.close()
        return out.getvalue()
    return None


def _span(start: int, isobytes: int, disk_bytes: int, reserved_tail: int) -> tuple[int, int]:
    """The partition's first sector and sector count, or ``disk-full``."""
    size = _align(isobytes)
    if start + size > disk_bytes - reserved_tail:
        raise _refuse(
            f"no room for the config drive: it needs {size} bytes at {start} of a {disk_bytes}-byte disk",
            "disk-full",
        )
    return start // SECTOR, size // SECTOR


def _mbr(fd: int, mbr: bytes, iso: bytes, *, disk_bytes: int, image_bytes: int) -> ConfigDrivePlaced:
    table = bytearray(mbr)
    used: list[tuple[int, int, int]] = []  # (slot, first sector, sectors)
    free: int | None = None
    mine: int | None = None
    for index in range(4):
        _status, _chs0, kind, _chs1, first, count = struct.unpack_from("<B3sB3sII", table, 446 + 16 * index)
        if kind == 0 or count == 0:
            free = index if free is None else free
            continue
        if kind == _MBR_LINUX and _ours(fd, first):
            mine = index
            continue
        used.append((index, first, count))
    slot = mine if mine is not None else free
    if slot is None:
        raise _refuse(
            "the image's MBR has no free primary partition slot for the config drive", "no-free-slot"
        )
    end = max([image_bytes, *((first + count) * SECTOR for _s, first, count in used)])
    first, count = _span(_align(end), len(iso), min(disk_bytes, 0xFFFFFFFF * SECTOR), 0)
    # LBA only: CHS fields say "beyond 1024 cylinders", as tools do for large disks
    struct.pack_into("<B3sB3sII", table, 446 + 16 * slot, 0, b"\xfe\xff\xff", _MBR_LINUX, b"\xfe\xff\xff",
                     first, count)  # fmt: skip
    os.pwrite(fd, bytes(table), 0)
    return ConfigDrivePlaced(table="mbr", partition=slot + 1, offset=first * SECTOR, bytes=count * SECTOR)


@dataclass(frozen=True)
class _GptHeader:
    raw: bytes
    entries_lba: int
    entry_count: int
    entry_size: int


def _gpt_header(fd: int, lba: int) -> _GptHeader | None:
    raw = os.pread(fd, SECTOR, lba * SECTOR)
    if raw[:8] != _GPT_SIGNATURE:
        return None
    size = struct.unpack_from("<I", raw, 12)[0]
    if not 92 <= size <= SECTOR:
        return None
    check = bytearray(raw[:size])
    check[16:20] = b"\0\0\0\0"
    if zlib.crc32(check) != struct.unpack_from("<I", raw, 16)[0]:
        return None
    entries_lba, count, entry_size = struct.unpack_from("<QII", raw, 72)
    if entry_size < 128 or count * entry_size > 4 << 20:
        return None
    return _GptHeader(raw[:size], entries_lba, count, entry_size)


def _gpt(fd: int, iso: bytes, *, disk_bytes: int, image_bytes: int) -> ConfigDrivePlaced:
    header = _gpt_header(fd, 1)
    if header is None:
        raise _refuse(
            "the image's protective MBR names a GPT whose header is not valid", "no-partition-table"
        )
    entries_bytes = header.entry_count * header.entry_size
    table = bytearray(os.pread(fd, entries_bytes, header.entries_lba * SECTOR))
    if zlib.crc32(table) != struct.unpack_from("<I", header.raw, 88)[0]:
        raise _refuse("the image's GPT partition entries fail their CRC", "no-partition-table")
    last_lba = disk_bytes // SECTOR - 1
    entry_sectors = -(-entries_bytes // SECTOR)
    used_end = image_bytes
    free = None
    mine = None
    for i in range(header.entry_count):
        at = i * header.entry_size
        kind = uuid.UUID(bytes_le=bytes(table[at : at + 16]))
        if kind.int == 0:
            free = i if free is None else free
            continue
        first, last = struct.unpack_from("<QQ", table, at + 32)
        if kind == _GPT_LINUX_DATA and _ours(fd, first):
            mine = i
            continue
        used_end = max(used_end, (last + 1) * SECTOR)
    slot = mine if mine is not None else free
    if slot is None:
        raise _refuse("the image's GPT has no free entry for the config drive", "no-free-slot")
    # the image's backup GPT sat at the image's end; it moves to the disk's end
    old_backup = struct.unpack_from("<Q", header.raw, 32)[0]
    first, count = _span(_align(used_end), len(iso), disk_bytes, (1 + entry_sectors) * SECTOR)
    at = slot * header.entry_size
    name = LABEL.encode("utf-16-le").ljust(72, b"\0")
    entry = (
        _GPT_LINUX_DATA.bytes_le
        + uuid.uuid4().bytes_le
        + struct.pack("<QQQ", first, first + count - 1, 0)
        + name
    )
    table[at : at + header.entry_size] = entry.ljust(header.entry_size, b"\0")
    entries_crc = zlib.crc32(table)
    backup_entries = last_lba - entry_sectors
    primary = _header(header.raw, my=1, alternate=last_lba, last_usable=backup_entries - 1,
                      entries_lba=header.entries_lba, entries_crc=entries_crc)  # fmt: skip
    backup = _header(header.raw, my=last_lba, alternate=1, last_usable=backup_entries - 1,
                     entries_lba=backup_entries, entries_crc=entries_crc)  # fmt: skip
    if 1 < old_backup < last_lba:
        os.pwrite(fd, bytes(SECTOR), old_backup * SECTOR)  # no stale backup header left inside the disk
    os.pwrite(fd, bytes(table), backup_entries * SECTOR)
    os.pwrite(fd, backup, last_lba * SECTOR)
    os.pwrite(fd, bytes(table), header.entries_lba * SECTOR)
    os.pwrite(fd, primary, SECTOR)
    # the protective MBR covers the whole disk now
    pmbr = bytearray(os.pread(fd, SECTOR, 0))
    for slot_mbr in range(4):
        if pmbr[446 + 16 * slot_mbr + 4] == _MBR_GPT:
            struct.pack_into("<I", pmbr, 446 + 16 * slot_mbr + 12, min(last_lba, 0xFFFFFFFF))
    os.pwrite(fd, bytes(pmbr), 0)
    return ConfigDrivePlaced(table="gpt", partition=slot + 1, offset=first * SECTOR, bytes=count * SECTOR)


def _header(
    raw: bytes, *, my: int, alternate: int, last_usable: int, entries_lba: int, entries_crc: int
) -> bytes:
    out = bytearray(raw)
    struct.pack_into("<QQ", out, 24, my, alternate)
    struct.pack_into("<Q", out, 48, last_usable)
    struct.pack_into("<Q", out, 72, entries_lba)
    struct.pack_into("<I", out, 88, entries_crc)
    out[16:20] = b"\0\0\0\0"
    struct.pack_into("<I", out, 16, zlib.crc32(out))
    return bytes(out).ljust(SECTOR, b"\0")
