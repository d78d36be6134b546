"""Disk commands: ``node.wipe`` (wipefs semantics) and ``node.imageWrite`` (streamed, verified).

Both refuse the disk bcd runs from. Disks are ``/dev/<name>`` under the machine's root, so a
test can hand plain files to them.
"""

from __future__ import annotations

import hashlib
import lzma
import os
import stat
import struct
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

import zstandard

from better_compute.agent import CommandRejected
from better_compute.core.errors import BcError, ErrorCode

from .hardware import block_disks, boot_disks
from .system import Machine

__all__ = ["MIB", "image_write", "signatures", "wipe"]

MIB: Final = 1 << 20
_CHUNK: Final = 4 * MIB
_BLKDISCARD: Final = 0x1277
_BTRFS_MIRRORS: Final = (64 * MIB, 256 << 30)
_MBR_EXTENDED: Final = frozenset({0x05, 0x0F, 0x85})

Progress = Callable[[str, float | None], None]


# -- devices ------------------------------------------------------------------------


def _disk_name(path: str) -> str:
    return path.removeprefix("/dev/")


def _target(machine: Machine, disk: str, *, where: str) -> str:
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


def _size(fd: int) -> int:
    return os.lseek(fd, 0, os.SEEK_END)


def _read(fd: int, offset: int, length: int) -> bytes:
    return os.pread(fd, length, offset) if offset >= 0 else b""


def _zero(fd: int, offset: int, length: int) -> None:
    zeros = bytes(min(length, _CHUNK))
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


def wipe(machine: Machine, *, disks: list[str] | None, mode: str = "quick") -> dict[str, Any]:
    """Erase every partition table and superblock signature of ``disks`` (every disk but the
    boot disk when None) and report each disk.

    ``quick`` zeroes the first and last MiB of the disk and of each partition (and the btrfs
    mirrors), ``discard`` first discards the whole device where it can, ``secure`` zeroes all
    of it.
    """
    boot = boot_disks(machine)
    if disks:
        targets = [(d, _target(machine, d, where=f"disks[{i}]")) for i, d in enumerate(disks)]
        skipped: list[dict[str, Any]] = []
    else:
        names = block_disks(machine)
        targets = [(f"/dev/{n}", str(machine.path(f"/dev/{n}"))) for n in names if n not in boot]
        skipped = [{"disk": f"/dev/{n}", "skipped": "bcd runs from this disk"} for n in names if n in boot]
    reports = []
    for disk, path in targets:
        t0 = time.monotonic()
        fd = os.open(path, os.O_RDWR)
        try:
            size = _size(fd)
            table, parts = _partitions(fd, size)
            before = signatures(fd, size)
            discarded = mode == "discard" and _discard(fd, size)
            regions = [(0, size)] if mode == "secure" else _regions(size, parts)
            for start, length in regions:
                _zero(fd, start, length)
            os.fsync(fd)
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
            {
                "disk": disk,
                "sizeBytes": size,
                "mode": mode,
                "partitionTable": table,
                "partitions": len(parts),
                "signaturesErased": before,
                "erasedBytes": sum(length for _, length in regions),
                "discarded": discarded,
                "ms": round((time.monotonic() - t0) * 1000, 1),
            }
        )
    return {"disks": reports + skipped}


# -- image write --------------------------------------------------------------------


class _Stream(Protocol):
    @property
    def eof(self) -> bool: ...

    @property
    def unused_data(self) -> bytes: ...

    def decompress(self, data: bytes, /) -> bytes: ...


class _Decoder(Protocol):
    @property
    def eof(self) -> bool: ...

    def decompress(self, data: bytes, /) -> bytes: ...


class _Raw:
    @property
    def eof(self) -> bool:
        return True

    def decompress(self, data: bytes, /) -> bytes:
        return data


class _Members:
    """Compressed members (gzip) or frames (zstd, xz streams) one after another, read whole as
    ``gzip -d`` and ``zstd -d`` do: pigz and ``zstd -T`` write several."""

    def __init__(self, make: Callable[[], _Stream]) -> None:
        self._make = make
        self._current = make()

    @property
    def eof(self) -> bool:
        return self._current.eof

    def decompress(self, data: bytes, /) -> bytes:
        out = []
        while data:
            if self._current.eof:
                self._current = self._make()
            out.append(self._current.decompress(data))
            data = self._current.unused_data if self._current.eof else b""
        return b"".join(out)


def _decoder(fmt: str) -> _Decoder:
    if fmt == "raw":
        return _Raw()
    if fmt == "raw.gz":
        return _Members(lambda: zlib.decompressobj(wbits=47))  # gzip or zlib header
    if fmt == "raw.zst":
        return _Members(lambda: zstandard.ZstdDecompressor().decompressobj())
    if fmt == "raw.xz":
        return _Members(lzma.LZMADecompressor)
    raise CommandRejected(f"unsupported-format: image format {fmt} is not supported by this daemon")


@dataclass
class _Written:
    downloaded: int = 0
    written: int = 0


def _unbootable(fd: int, size: int) -> None:
    """Leave the disk not bootable: no partition table, no boot sector, no backup GPT."""
    _zero(fd, 0, min(MIB, size))
    _zero(fd, max(0, size - MIB), min(MIB, size))
    os.fsync(fd)


def _pick_disk(machine: Machine) -> str:
    boot = boot_disks(machine)
    for name in block_disks(machine):
        if name not in boot and machine.read(f"/sys/block/{name}/removable") != "1":
            return f"/dev/{name}"
    raise CommandRejected("no-disk: this machine has no disk to write the image to")


def image_write(
    machine: Machine,
    *,
    url: str,
    sha256: str,
    fmt: str = "raw",
    disk: str | None = None,
    progress: Progress | None = None,
    timeout: float = 60.0,
) -> dict[str, Any]:
    """Stream the image at ``url`` onto ``disk``, checking its sha256 while writing.

    The image's first MiB is written last, once the digest matched, so an interrupted or
    corrupted write never leaves a bootable disk; a mismatch zeroes the first and last MiB and
    fails with both digests. After an fsync the disk is read back and checked again.
    """
    target_disk = disk or _pick_disk(machine)
    path = _target(machine, target_disk, where="disk")
    decoder = _decoder(fmt)
    t0 = time.monotonic()
    artifact = hashlib.sha256()
    raw = hashlib.sha256()
    head = bytearray()
    count = _Written()
    fd = os.open(path, os.O_RDWR)
    try:
        size = _size(fd)
        _zero(fd, 0, min(MIB, size))  # the old boot sector and table go first

        def put(data: bytes) -> None:
            if not data:
                return
            raw.update(data)
            if count.written + len(data) > size:
                raise _BadImage(f"the image is larger than {target_disk} ({size} bytes)", "image-too-large")
            offset = count.written
            count.written += len(data)
            if offset < MIB:
                keep = data[: MIB - offset]
                head.extend(keep)
                data, offset = data[len(keep) :], MIB
            if data:
                os.pwrite(fd, data, offset)

        try:
            total = _stream(url, timeout, artifact, decoder, put, count, progress)
            if not decoder.eof:
                raise _BadImage("the compressed image ends early", "image-truncated")
        except _BadImage as bad:
            _unbootable(fd, size)
            raise BcError(ErrorCode.DRIVER_ERROR, f"{bad}; {target_disk} was left not bootable",
                          {"path": "url", "reason": bad.reason, "disk": target_disk}) from None  # fmt: skip
        except (zlib.error, lzma.LZMAError, zstandard.ZstdError) as exc:
            _unbootable(fd, size)
            raise BcError(
                ErrorCode.DRIVER_ERROR,
                f"the image does not decompress as {fmt} ({exc}); {target_disk} was left not bootable",
                {"path": "format", "reason": "image-corrupt", "disk": target_disk},
            ) from None
        actual = artifact.hexdigest()
        if actual != sha256:
            _unbootable(fd, size)
            raise BcError(
                ErrorCode.DRIVER_ERROR,
                f"image sha256 mismatch: expected {sha256}, actual {actual}; "
                f"{target_disk} was left not bootable",
                {"path": "sha256", "reason": "digest-mismatch", "expected": sha256, "actual": actual,
                 "disk": target_disk},
            )  # fmt: skip
        os.fsync(fd)
        os.pwrite(fd, bytes(head), 0)
        os.fsync(fd)
        written = raw.hexdigest()
        if progress is not None:
            progress("verifying", 99.0)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read the disk, not the page cache
        reread = _reread(fd, count.written)
        if reread != written:
            _unbootable(fd, size)
            raise BcError(
                ErrorCode.DRIVER_ERROR,
                f"{target_disk} reads back other data: expected sha256 {written}, actual {reread}; "
                "it was left not bootable",
                {"path": "disk", "reason": "readback-mismatch", "expected": written, "actual": reread},
            )
    finally:
        os.close(fd)
    return {
        "disk": target_disk,
        "format": fmt,
        "sha256": actual,
        "bytesDownloaded": total,
        "bytesWritten": count.written,
        "writtenSha256": written,
        "verified": True,
        "bootable": True,
        "ms": round((time.monotonic() - t0) * 1000, 1),
    }


class _BadImage(Exception):  # noqa: N818 - control flow inside image_write
    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _stream(
    url: str,
    timeout: float,
    artifact: Any,
    decoder: _Decoder,
    put: Callable[[bytes], None],
    count: _Written,
    progress: Progress | None,
) -> int:
    try:
        response = urllib.request.urlopen(url, timeout=timeout)
    except (urllib.error.URLError, OSError) as exc:
        raise BcError(
            ErrorCode.UNAVAILABLE, f"cannot fetch the image: {exc}", {"path": "url", "reason": "fetch-failed"}
        ) from None
    with response:
        length = int(response.headers.get("Content-Length") or 0) or None
        shown = -1.0
        while True:
            try:
                chunk = response.read(MIB)
            except OSError as exc:
                raise _BadImage(f"the download broke off: {exc}", "fetch-broken") from None
            if not chunk:
                break
            count.downloaded += len(chunk)
            artifact.update(chunk)
            put(decoder.decompress(chunk))
            if progress is not None and length:
                percent = round(100.0 * count.downloaded / length, 0)
                if percent >= shown + 5:
                    shown = percent
                    progress("writing", min(percent, 98.0))
        if length is not None and count.downloaded != length:
            raise _BadImage(f"the download ended after {count.downloaded} of {length} bytes", "fetch-broken")
    return count.downloaded


def _reread(fd: int, length: int) -> str:
    digest = hashlib.sha256()
    offset = 0
    while offset < length:
        data = os.pread(fd, min(_CHUNK, length - offset), offset)
        if not data:
            break
        digest.update(data)
        offset += len(data)
    return digest.hexdigest()
