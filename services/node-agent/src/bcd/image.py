"""``node.imageWrite``: stream an image from the site cache onto a disk, verified as it goes.

Hashes the download while writing it (raw, gzip, zstd, xz), holds the image's first MiB back
until the digest matched, flushes what it wrote to the disk every ``SYNC_EVERY`` bytes (so the
disk, not the page cache, holds what the progress says), and reads the disk back after an fsync.
It refuses the disk bcd runs from. Split from ``disks.py`` (wipe) by concern.
"""

from __future__ import annotations

import hashlib
import lzma
import os
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

import zstandard
from msgspec import UNSET

from better_compute.agent import CommandRejected
from better_compute.core.errors import BcError, ErrorCode
from better_compute.service.killpoints import kill_point
from better_compute.wire.commands import ImageWriteResult

from .configdrive import ConfigDrive, write_config_drive
from .disks import AFTER_DISK_WRITE, BEFORE_DISK_WRITE, CHUNK, MIB, Progress, device_size, disk_path, zero
from .hardware import block_disks, boot_disks
from .system import Machine

__all__ = ["SYNC_EVERY", "image_write"]

SYNC_EVERY: Final = 16 * MIB
"""How much of the image may sit in the page cache, written but not on the disk: without the
flush the kernel kept a whole image in RAM (the ramdisk's RAM) and wrote it out at the final
fsync, so a ``writing 90%`` disk held nothing of it yet (seen in the VM lab: all of a 77 MiB
image reached the disk in 0.2 s, at the end)."""


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
    synced: int = 0


def _unbootable(fd: int, size: int) -> None:
    """Leave the disk not bootable: no partition table, no boot sector, no backup GPT."""
    zero(fd, 0, min(MIB, size))
    zero(fd, max(0, size - MIB), min(MIB, size))
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
    config_drive: ConfigDrive | None = None,
) -> ImageWriteResult:
    """Stream the image at ``url`` onto ``disk``, checking its sha256 while writing.

    The image's first MiB is written last, once the digest matched, so an interrupted or
    corrupted write never leaves a bootable disk; the rest is flushed to the disk every
    ``SYNC_EVERY`` bytes as it is written; a mismatch zeroes the first and last MiB and
    fails with both digests. After an fsync the disk is read back and checked again. Then, with
    ``config_drive``, the NoCloud config drive goes on a new partition after the image's
    (``configdrive``); if it cannot, the disk is left not bootable.
    """
    target_disk = disk or _pick_disk(machine)
    path = disk_path(machine, target_disk, where="disk")
    decoder = _decoder(fmt)
    t0 = time.monotonic()
    artifact = hashlib.sha256()
    raw = hashlib.sha256()
    head = bytearray()
    count = _Written()
    kill_point(BEFORE_DISK_WRITE)
    fd = os.open(path, os.O_RDWR)
    try:
        size = device_size(fd)
        zero(fd, 0, min(MIB, size))  # the old boot sector and table go first

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
            if count.written - count.synced >= SYNC_EVERY:
                os.fdatasync(fd)  # on the disk as it goes, not all of it at the end
                count.synced = count.written

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
        kill_point(AFTER_DISK_WRITE)
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
        drive = None
        if config_drive is not None:
            try:
                drive = write_config_drive(fd, config_drive, image_bytes=count.written)
            except BcError as err:
                _unbootable(fd, size)
                raise BcError(err.code, f"{err.message}; {target_disk} was left not bootable",
                              {**err.details, "disk": target_disk}) from None  # fmt: skip
    finally:
        os.close(fd)
    return ImageWriteResult(
        disk=target_disk,
        format=fmt,
        sha256=actual,
        bytes_downloaded=total,
        bytes_written=count.written,
        written_sha256=written,
        verified=True,
        bootable=True,
        config_drive=drive if drive is not None else UNSET,
        ms=round((time.monotonic() - t0) * 1000, 1),
    )


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
        data = os.pread(fd, min(CHUNK, length - offset), offset)
        if not data:
            break
        digest.update(data)
        offset += len(data)
    return digest.hexdigest()
