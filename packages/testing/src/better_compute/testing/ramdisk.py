"""The built ramdisk and QEMU VMs that boot it, for tests (docs/real-machines.md).

``built_ramdisk()`` builds the ramdisk once per test process (the build cache makes later runs a
copy); ``qemu_accel()`` picks KVM where it works, TCG otherwise; ``RamdiskVM`` is one VM booted
straight into the ramdisk (``-kernel``/``-initrd``) with a blank virtio disk file, a virtio NIC on
user-mode networking (the guest reaches this machine's loopback as 10.0.2.2) and the DMI product
UUID and serial given. A VM dies with the process that started it (``PR_SET_PDEATHSIG``), even
when that one is SIGKILLed.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from ..runtime.ramdisk import RamdiskArtifacts, build, default_cache_dir

__all__ = ["RamdiskVM", "built_ramdisk", "die_with_parent", "kvm_works", "qemu_accel"]

QEMU: Final = "qemu-system-x86_64"
_PR_SET_PDEATHSIG: Final = 1


@functools.cache
def built_ramdisk() -> RamdiskArtifacts:
    """The ramdisk, built (or copied from the build cache) once per process into a temporary
    folder; ``build_seconds`` of the manifest says how long packing took when it was built."""
    out = Path(tempfile.mkdtemp(prefix="bc-ramdisk-"))
    return build(out, cache_dir=default_cache_dir())


def kvm_works() -> bool:
    """Whether a VM can use KVM here: ``/dev/kvm`` opens and the CPU shows virtualisation
    (``vmx``/``svm``). A nested guest whose host hides them has a ``/dev/kvm`` on which a guest
    kernel never starts, so the device alone is not enough."""
    try:
        fd = os.open("/dev/kvm", os.O_RDWR)
    except OSError:
        return False
    os.close(fd)
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " vmx" in flags or " svm" in flags


def qemu_accel() -> list[str]:
    """QEMU's accelerator arguments: ``BC_QEMU_ACCEL`` (``kvm`` or ``tcg``) when set, else KVM
    when ``kvm_works()``, else TCG."""
    choice = os.environ.get("BC_QEMU_ACCEL") or ("kvm" if kvm_works() else "tcg")
    if choice == "kvm":
        return ["-enable-kvm", "-cpu", "host"]
    return ["-accel", "tcg"]


def die_with_parent() -> None:
    """For ``preexec_fn``: the child gets SIGKILL when the process that started it dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class RamdiskVM:
    """One QEMU VM booted into a kernel and initramfs, with a blank virtio disk."""

    folder: Path
    kernel: Path
    initrd: Path
    cmdline: str
    mac: str = "52:54:00:12:34:56"
    product_uuid: str = "5b3c2b9e-1f4e-4a31-9d35-5a2a6f0e7d11"
    serial: str = "BC-VM-0001"
    disk_bytes: int = 1 << 30
    memory_mib: int = 1024
    cpus: int = 2
    accel: list[str] = field(default_factory=qemu_accel)
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0

    @property
    def disk(self) -> Path:
        return self.folder / "disk.raw"

    @property
    def console(self) -> Path:
        """The serial console's output (the kernel's and the init's lines, bcd's log)."""
        return self.folder / "console.log"

    def argv(self) -> list[str]:
        return [
            QEMU, *self.accel, "-m", str(self.memory_mib), "-smp", str(self.cpus),
            "-kernel", str(self.kernel), "-initrd", str(self.initrd), "-append", self.cmdline,
            "-nographic", "-monitor", "none", "-serial", f"file:{self.console}", "-no-reboot",
            "-netdev", "user,id=n0", "-device", f"virtio-net-pci,netdev=n0,mac={self.mac}",
            "-drive", f"file={self.disk},if=virtio,format=raw,cache=writeback",
            "-device", "virtio-rng-pci",
            "-smbios", f"type=1,uuid={self.product_uuid},serial={self.serial}",
        ]  # fmt: skip

    def start(self) -> RamdiskVM:
        if shutil.which(QEMU) is None:
            raise AssertionError(f"{QEMU} is missing: scripts/system-packages.sh installs qemu-system-x86")
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.disk, "wb") as fh:
            fh.truncate(self.disk_bytes)  # sparse and blank
        self.console.write_bytes(b"")
        with open(self.folder / "qemu.log", "wb") as log:
            self.proc = subprocess.Popen(
                self.argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
            )  # fmt: skip
        self.started_at = time.monotonic()
        return self

    def console_text(self) -> str:
        return self.console.read_text(errors="replace") if self.console.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
