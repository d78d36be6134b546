"""What a simulated machine's installed OS reads off its disk file: its partitions, whether one
holds the simulated OS, and the NoCloud config drive (an ISO9660 partition labelled ``cidata``
holding ``user-data`` and ``meta-data``) that bcd's ``node.imageWrite`` leaves after the image.

Read the way the OS would, from the disk's own bytes: the MBR or GPT entries, the ISO's volume
label, and the files by their Joliet names (what a mounted ``cidata`` shows), never from what the
control plane sent.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Final

__all__ = ["OS_MARK", "apply_write_files", "config_drive", "has_os", "partitions"]

OS_MARK: Final = b"BCSIM-OS\n"
"""What stands for an installed OS: at the disk's start (the simulated installer) or at the start
of one of its partitions (the root filesystem of an image bcd wrote)."""
_SECTOR: Final = 512
_ISO_BLOCK: Final = 2048


def partitions(disk: Path) -> list[tuple[int, int]]:
    """``(offset, bytes)`` of each partition in the disk's MBR or GPT (primary entries)."""
    with disk.open("rb") as fh:
        head = fh.read(34 * _SECTOR)
        if len(head) < _SECTOR or head[510:512] != b"\x55\xaa":
            return []
        mbr = [struct.unpack_from("<4xB3xII", head, 446 + 16 * i) for i in range(4)]
        if not any(kind == 0xEE for kind, _first, _count in mbr):
            return [(first * _SECTOR, count * _SECTOR) for kind, first, count in mbr if kind and count]
        if head[_SECTOR : _SECTOR + 8] != b"EFI PART":
            return []
        entries_lba, count, size = struct.unpack_from("<QII", head, _SECTOR + 72)
        fh.seek(entries_lba * _SECTOR)
        table = fh.read(count * size)
    found = []
    for i in range(count):
        entry = table[i * size : (i + 1) * size]
        if len(entry) >= 48 and any(entry[:16]):
            first, last = struct.unpack_from("<QQ", entry, 32)
            found.append((first * _SECTOR, (last - first + 1) * _SECTOR))
    return found


def has_os(disk: Path) -> bool:
    """Whether the disk holds the simulated OS (``OS_MARK`` at its start or a partition's)."""
    try:
        with disk.open("rb") as fh:
            for offset in [0, *(start for start, _size in partitions(disk))]:
                fh.seek(offset)
                if fh.read(len(OS_MARK)) == OS_MARK:
                    return True
    except OSError:
        return False
    return False


def config_drive(disk: Path) -> dict[str, bytes] | None:
    """The files of the partition whose ISO9660 volume is labelled ``cidata`` (by their Joliet
    names: ``user-data``, ``meta-data``), or None when the disk has none."""
    try:
        with disk.open("rb") as fh:
            for offset, _size in partitions(disk):
                files = _iso_files(fh, offset)
                if files is not None:
                    return files
    except OSError:
        return None
    return None


def _iso_files(fh: Any, offset: int) -> dict[str, bytes] | None:
    fh.seek(offset + 16 * _ISO_BLOCK)
    pvd = fh.read(_ISO_BLOCK)
    if pvd[1:6] != b"CD001" or pvd[40:72].rstrip(b" ").lower() != b"cidata":
        return None
    for block in range(17, 32):  # the Joliet supplementary descriptor follows the primary one
        fh.seek(offset + block * _ISO_BLOCK)
        vd = fh.read(_ISO_BLOCK)
        if vd[1:6] != b"CD001" or vd[0] == 255:
            return None
        if vd[0] == 2 and vd[88:90] == b"%/":
            extent, length = struct.unpack_from("<I4xI", vd, 156 + 2)
            fh.seek(offset + extent * _ISO_BLOCK)
            directory = fh.read(length)
            return _directory(fh, offset, directory)
    return None


def _directory(fh: Any, offset: int, directory: bytes) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    at = 0
    while at < len(directory):
        size = directory[at]
        if size == 0:  # records do not cross a block: skip to the next
            at = (at // _ISO_BLOCK + 1) * _ISO_BLOCK
            continue
        extent, length = struct.unpack_from("<I4xI", directory, at + 2)
        flags, name_len = directory[at + 25], directory[at + 32]
        raw = directory[at + 33 : at + 33 + name_len]
        if not flags & 2 and raw not in (b"\0", b"\1"):
            name = raw.decode("utf-16-be").split(";")[0]
            fh.seek(offset + extent * _ISO_BLOCK)
            files[name] = fh.read(length)
        at += size
    return files


def apply_write_files(user_data: bytes, root: Path) -> list[str]:
    """cloud-init's ``write_files`` of a ``#cloud-config`` document under ``root`` (the project's
    templates write it as JSON, which is YAML); the paths written."""
    text = user_data.decode()
    if not text.startswith("#cloud-config"):
        return []
    doc = json.loads(text.split("\n", 1)[1])
    written = []
    for item in doc.get("write_files", []):
        path = root / str(item["path"]).lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(item.get("content", "")))
        path.chmod(int(str(item.get("permissions", "0644")), 8))
        written.append(str(item["path"]))
    return written
