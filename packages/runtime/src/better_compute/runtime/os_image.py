"""The test OS image: a small raw disk image that boots on its own into bcd in installed mode.

Made from the ramdisk's parts (``runtime.ramdisk``: the Debian kernel, busybox, bcd) with an init
of its own (``os_image_init``), and laid out without loop mounts or root:

* an MBR with syslinux's boot code (``mbr.bin`` from Debian's ``syslinux-common``);
* partition 1, active, FAT (``mkfs.vfat`` on a file, files put in with mtools' ``mcopy``,
  ``syslinux --install`` on that file): ``vmlinuz``, ``initrd.img``, ``syslinux.cfg`` (the kernel
  line carries ``bcd.mode=installed``);
* partition 2, ext4 labelled ``bc-state`` (``mkfs.ext4 -d``): what persists across boots
  (``/var/lib/bcd``, ``/etc/bcd``, ``/usr/local``, the cloud-init instance seen).

bcd's ``node.imageWrite`` writes it to a machine's disk and adds the NoCloud config drive as
partition 3; the first boot runs the user data's ``write_files`` and ``runcmd`` (the project's
cloud-init template downloads bcd and joins with the token), later boots go straight to ``bcd
run --mode installed``. Register it in the catalog like any image (docs/images.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from ..core.errors import BcError, ErrorCode
from .os_image_init import CLOUD_INIT, CURL, JSON_AWK, OS_INIT, STATE_LABEL, SYSLINUX_CFG
from .ramdisk import prepare_parts, ramdisk_tree, write_cpio

__all__ = ["DEFAULT_OS_CMDLINE", "MBR_BIN", "OsImage", "build_os_image", "disk_image", "os_image_extra"]

MIB: Final = 1 << 20
MBR_BIN: Final = Path("/usr/lib/syslinux/mbr/mbr.bin")
DEFAULT_OS_CMDLINE: Final = "console=ttyS0,115200n8 bcd.mode=installed"
_BOOT_LABEL: Final = "BC-BOOT"
_STATE_DIRS: Final = ("var/lib/bcd", "etc/bcd", "usr/local/bin", "cloud")


@dataclass(frozen=True)
class OsImage:
    """What ``build_os_image`` (or ``disk_image``) wrote."""

    image: Path
    sha256: str
    size: int
    manifest: Path | None = None


def _run(argv: Sequence[str], what: str) -> None:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=300)
    except FileNotFoundError:
        raise BcError(
            ErrorCode.UNAVAILABLE,
            f"{argv[0]} is not installed ({what}): see scripts/system-packages.sh",
            {"path": argv[0]},
        ) from None
    if done.returncode != 0:
        raise BcError(
            ErrorCode.UNAVAILABLE,
            f"{what} failed: {' '.join(argv[:2])}: {(done.stderr or done.stdout).strip()[-400:]}",
            {"path": argv[0]},
        )


def _mib(n: int) -> int:
    return -(-n // MIB) * MIB


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(MIB):
            digest.update(chunk)
    return digest.hexdigest()


def disk_image(
    *, kernel: Path, initrd: Path, out: Path, cmdline: str = DEFAULT_OS_CMDLINE, state_mib: int = 16
) -> OsImage:
    """Lay out the bootable disk image at ``out`` from a kernel and an initramfs.

    Raises:
        BcError: ``UNAVAILABLE`` naming the tool that is missing or failed (mkfs.vfat, mcopy,
            syslinux, mkfs.ext4, sfdisk), ``INVALID_INPUT`` at ``cmdline`` for a line break.
    """
    if "\n" in cmdline or "\r" in cmdline:
        raise BcError(ErrorCode.INVALID_INPUT, "the kernel command line is one line", {"path": "cmdline"})
    if not MBR_BIN.exists():
        raise BcError(
            ErrorCode.UNAVAILABLE, f"{MBR_BIN} is missing: install syslinux-common", {"path": "mbr"}
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bc-os-image-") as tmp_name:
        tmp = Path(tmp_name)
        boot_bytes = _mib(kernel.stat().st_size + initrd.stat().st_size + 4 * MIB)
        fat = tmp / "boot.fat"
        _run(["mkfs.vfat", "-C", "-n", _BOOT_LABEL, str(fat), str(boot_bytes // 1024)], "making the FAT")
        cfg = tmp / "syslinux.cfg"
        cfg.write_text(SYSLINUX_CFG.format(cmdline=cmdline))
        for source, name in ((kernel, "vmlinuz"), (initrd, "initrd.img"), (cfg, "syslinux.cfg")):
            _run(["mcopy", "-i", str(fat), str(source), f"::/{name}"], f"copying {name} into the FAT")
        _run(["syslinux", "--install", str(fat)], "installing syslinux")
        state_root = tmp / "state"
        for folder in _STATE_DIRS:
            (state_root / folder).mkdir(parents=True, exist_ok=True)
        state = tmp / "state.ext4"
        state_bytes = state_mib * MIB
        _run(["mkfs.ext4", "-q", "-F", "-L", STATE_LABEL, "-E", "root_owner=0:0", "-d", str(state_root),
              str(state), f"{state_mib}M"], "making the state file system")  # fmt: skip
        total = MIB + boot_bytes + state_bytes
        partial = out.with_name(out.name + ".partial")
        with partial.open("wb") as fh:
            fh.truncate(total)
        table = (
            "label: dos\n"
            f"start={MIB // 512}, size={boot_bytes // 512}, type=c, bootable\n"
            f"start={(MIB + boot_bytes) // 512}, size={state_bytes // 512}, type=83\n"
        )
        done = subprocess.run(["sfdisk", "-q", str(partial)], input=table, capture_output=True, text=True)
        if done.returncode != 0:
            raise BcError(ErrorCode.UNAVAILABLE, f"sfdisk failed: {done.stderr.strip()}", {"path": "sfdisk"})
        with partial.open("r+b") as fh:
            fh.seek(0)
            fh.write(MBR_BIN.read_bytes()[:440])  # boot code only: the signature and table stay
            for offset, part in ((MIB, fat), (MIB + boot_bytes, state)):
                fh.seek(offset)
                with part.open("rb") as src:
                    shutil.copyfileobj(src, fh, MIB)
            fh.flush()
            os.fsync(fh.fileno())
        partial.replace(out)
    return OsImage(image=out, sha256=_sha256(out), size=out.stat().st_size)


def os_image_extra() -> dict[str, bytes]:
    """The files the test OS adds to the ramdisk's tree: its cloud-init and the curl shim."""
    return {
        "/bin/bc-cloud-init": CLOUD_INIT.encode(),
        "/bin/curl": CURL.encode(),
        "/etc/bc-os/json.awk": JSON_AWK.encode(),
    }


def build_os_image(
    out_dir: Path,
    *,
    cache_dir: Path | None = None,
    cmdline: str = DEFAULT_OS_CMDLINE,
    state_mib: int = 16,
    say: Callable[[str], None] = lambda _m: None,
) -> OsImage:
    """Build the test OS image into ``out_dir``: ``bc-test-os.raw`` and ``manifest.json`` (its
    sha256 and size, the Debian packages inside, the ramdisk parts' key).

    Raises:
        BcError: as ``ramdisk.prepare_parts`` and ``disk_image``.
    """
    started = time.monotonic()
    parts = prepare_parts(cache_dir=cache_dir, say=say)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bc-os-initrd-") as tmp_name:
        initrd = Path(tmp_name) / "initrd.img"
        tree = ramdisk_tree(parts, init=OS_INIT, extra=dict(os_image_extra()), release="bc-os")
        write_cpio(tree, initrd)
        say(f"initrd    {initrd.stat().st_size} bytes")
        image = disk_image(
            kernel=parts.kernel, initrd=initrd, out=out_dir / "bc-test-os.raw", cmdline=cmdline,
            state_mib=state_mib,
        )  # fmt: skip
    doc: dict[str, Any] = {
        "kind": "bc-test-os",
        "file": image.image.name,
        "sha256": image.sha256,
        "size": image.size,
        "format": "raw",
        "cmdline": cmdline,
        "kernelRelease": parts.kernel_release,
        "packages": dict(parts.packages),
        "partsKey": parts.key,
    }
    manifest = out_dir / "manifest.json"
    manifest.write_text(json.dumps(doc, indent=2) + "\n")
    say(f"image     {image.image} {image.size} bytes in {time.monotonic() - started:.1f}s")
    return OsImage(image=image.image, sha256=image.sha256, size=image.size, manifest=manifest)
