"""One VM as a machine: a QEMU process with a blank virtio disk file, iPXE on its NIC and
user-mode networking, switched on and off by whichever BMC stands in front of it.

Power on starts ``qemu-system-x86_64`` booting the device asked for (``network``: iPXE first,
then the disk, as a one-time PXE does on a real machine; ``cd``: a medium, then the disk;
``disk``); power off kills it with SIGKILL (a pulled plug, nothing flushed by the guest);
reset restarts it. KVM when ``/dev/kvm`` opens, TCG otherwise. The guest reaches this machine's
loopback as 10.0.2.2 (QEMU's user network, no root set-up): its DHCP hands iPXE ``boot_url``.
KVM only where it runs real-mode firmware (``kvm_runs_real_mode``).

Each VM has its own product UUID and serial (``-smbios type=1``) and MAC, a serial console
written to ``console.log`` (every boot's, each after a ``=== vmlab: power on`` line), a QMP
socket, and ``events.jsonl``: every power change and what it booted, as the machine saw them (a
test counts there and in the disk file).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["BootDevice", "VirtualMachine", "VmSpec", "kvm_available", "kvm_runs_real_mode"]

BootDevice = Literal["network", "disk", "cd"]
_ORDER: dict[str, str] = {"network": "nc", "cd": "dc", "disk": "c"}


def kvm_available() -> bool:
    """Whether this process can open ``/dev/kvm`` (else QEMU emulates: TCG, slower)."""
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    os.close(fd)
    return True


def kvm_runs_real_mode() -> bool:
    """Whether KVM here runs the firmware's real-mode code (SeaBIOS option ROMs such as iPXE,
    syslinux's boot sector): ``/dev/kvm`` opens *and* the CPU shows ``vmx`` or ``svm``.

    On the 2-core sandbox (itself a VM on AMD EPYC, KVM nested, no ``svm`` flag shown) SeaBIOS
    starts the iPXE ROM under KVM and it hangs before printing a line, with every CPU model,
    ``kernel-irqchip=off``, ``-no-hpet`` and q35 tried; syslinux stops the same way (the test OS
    image's test found it); under TCG both run. ``BC_VMLAB_ACCEL=kvm|tcg`` overrides."""
    forced = os.environ.get("BC_VMLAB_ACCEL")
    if forced in ("kvm", "tcg"):
        return forced == "kvm"
    if not kvm_available():
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " vmx" in flags or " svm" in flags


@dataclass(frozen=True)
class VmSpec:
    """Who a VM is and how it is built; JSON-able, so a BMC process can own the VM."""

    name: str
    folder: str
    uuid: str
    serial: str
    mac: str
    boot_url: str
    """The site agent's first-stage script as the guest sees it (``http://10.0.2.2:<port>/boot.ipxe``)."""
    disk_bytes: int = 2 << 30
    memory_mb: int = 1024
    cpus: int = 1

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> VmSpec:
        return cls(**{k: doc[k] for k in cls.__dataclass_fields__ if k in doc})


class VirtualMachine:
    """A VM behind a BMC: ``power_on(boot)``, ``power_off()``, ``reset(boot)``, ``close()``.

    Each QEMU is started from the VM's own thread (it lives as long as the VM object) with
    ``setpriv --pdeathsig KILL``: it dies with the process that owns the VM, even a SIGKILLed
    one. Calls from several threads (the BMC's) are run one at a time in that thread.
    """

    def __init__(self, spec: VmSpec, *, qemu: str | None = None) -> None:
        self.spec = spec
        self.folder = Path(spec.folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.disk = self.folder / "disk.raw"
        self.console = self.folder / "console.log"
        self.qmp_path = self.folder / "qmp.sock"
        self.events_path = self.folder / "events.jsonl"
        self.cdrom: Path | None = None
        self.kvm = kvm_runs_real_mode()
        found = qemu or shutil.which("qemu-system-x86_64")
        if not found:
            raise RuntimeError(
                "qemu-system-x86_64 is missing: scripts/system-packages.sh installs qemu-system-x86 "
                "and ipxe-qemu"
            )
        self.qemu = found
        if not self.disk.exists():  # blank and sparse: it costs nothing until the guest writes
            with open(self.disk, "wb") as fh:
                fh.truncate(spec.disk_bytes)
        self.proc: subprocess.Popen[bytes] | None = None
        self.boots = 0
        self._lock = threading.Lock()
        self._ops = ThreadPoolExecutor(1, thread_name_prefix=f"vm-{spec.name}")

    # -- what the machine did --------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> None:
        with self._lock, open(self.events_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"t": round(time.time(), 3), "event": kind, **fields}) + "\n")

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        if not self.events_path.exists():
            return []
        out = [json.loads(line) for line in self.events_path.read_text().splitlines() if line.strip()]
        return [e for e in out if kind is None or e.get("event") == kind]

    @property
    def power(self) -> str:
        """``On`` while QEMU runs (a guest that powered itself off counts as Off)."""
        return "On" if self.proc is not None and self.proc.poll() is None else "Off"

    # -- power -----------------------------------------------------------------------------

    def power_on(self, boot: BootDevice = "disk", *, cdrom: Path | None = None) -> None:
        """Start the VM booting ``boot`` (nothing when it runs already)."""
        self._ops.submit(self._start, boot, cdrom).result(60)

    def power_off(self, why: str = "power-off") -> None:
        """Pull the plug: SIGKILL, the guest flushes nothing."""
        self._ops.submit(self._kill, why).result(60)

    def reset(self, boot: BootDevice = "disk", *, cdrom: Path | None = None) -> None:
        """A hard reset: stop QEMU and start it again booting ``boot``."""

        def both() -> None:
            self._kill("reset")
            self._start(boot, cdrom)

        self._ops.submit(both).result(60)

    def close(self) -> None:
        if not self._ops._shutdown:
            self._ops.submit(self._kill, "closed").result(60)
            self._ops.shutdown(wait=True)

    def accel(self, boot: BootDevice) -> str:
        """``kvm`` or ``tcg`` (see ``kvm_runs_real_mode``); every boot runs real-mode firmware."""
        return "kvm" if self.kvm else "tcg"

    def argv(self, boot: BootDevice, cdrom: Path | None) -> list[str]:
        s = self.spec
        smbios = f"type=1,manufacturer=Better Compute,product=vmlab,uuid={s.uuid},serial={s.serial}"
        argv = [
            self.qemu, "-name", s.name, "-machine", "pc", "-accel", self.accel(boot),
            "-smp", str(s.cpus), "-m", str(s.memory_mb),
            "-smbios", smbios, "-nodefaults", "-no-user-config", "-nographic",
            # appended to, not truncated at each boot (``-serial file:`` truncates): every boot's
            # screen stays, after the power-on line written before it
            "-chardev", f"file,id=console,path={self.console},append=on", "-serial", "chardev:console",
            "-qmp", f"unix:{self.qmp_path},server=on,wait=off",
            "-drive", f"file={self.disk},format=raw,if=virtio,cache=writeback",
            "-netdev", f"user,id=n0,bootfile={s.boot_url}",
            "-device", f"virtio-net-pci,netdev=n0,mac={s.mac}",
            "-boot", f"order={_ORDER[boot]},reboot-timeout=2000",
        ]  # fmt: skip
        if cdrom is not None:
            argv += ["-drive", f"file={cdrom},media=cdrom,if=ide,readonly=on"]
        return argv

    def _start(self, boot: BootDevice, cdrom: Path | None) -> None:
        if self.power == "On":
            return
        if boot == "cd" and cdrom is None:
            boot = "disk"  # nothing inserted: the BIOS goes on to the disk
        self.qmp_path.unlink(missing_ok=True)
        self.boots += 1
        self.cdrom = cdrom
        with open(self.console, "ab") as out:
            out.write(f"\n=== vmlab: power on #{self.boots}, boot {boot} ===\n".encode())
        with open(self.folder / "qemu.log", "ab") as log:
            self.proc = subprocess.Popen(
                ["setpriv", "--pdeathsig", "KILL", "--", *self.argv(boot, cdrom)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        self.event("power", to="On", boot=boot, cdrom=cdrom is not None, accel=self.accel(boot))

    def _kill(self, why: str) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        running = proc.poll() is None
        if running:
            proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        if running:
            self.event("power", to="Off", reason=why)

    # -- QMP -------------------------------------------------------------------------------

    def qmp(self, command: str, arguments: dict[str, Any] | None = None, *, timeout: float = 10.0) -> Any:
        """One QMP command on the VM's socket; its ``return`` (``qmp("query-status")``)."""
        end = time.monotonic() + timeout
        while not self.qmp_path.exists():
            if self.power == "Off" or time.monotonic() > end:
                raise RuntimeError(f"{self.spec.name}: no QMP socket (the VM is {self.power})")
            time.sleep(0.05)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(self.qmp_path))
            reader = sock.makefile("rb")

            def answer() -> dict[str, Any]:
                while True:
                    doc: dict[str, Any] = json.loads(reader.readline())
                    if "return" in doc or "error" in doc:
                        return doc

            json.loads(reader.readline())  # the greeting
            sock.sendall(b'{"execute": "qmp_capabilities"}\n')
            answer()
            msg: dict[str, Any] = {"execute": command, **({"arguments": arguments} if arguments else {})}
            sock.sendall(json.dumps(msg).encode() + b"\n")
            doc = answer()
        if "error" in doc:
            raise RuntimeError(f"QMP {command}: {doc['error']}")
        return doc["return"]

    def console_text(self) -> str:
        return self.console.read_text(errors="replace") if self.console.exists() else ""
