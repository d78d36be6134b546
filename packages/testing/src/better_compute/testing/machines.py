"""Prepared machine trees for bcd: ``/sys``, ``/proc``, ``/etc`` and plain files as disks.

``prepare_machine(root, ...)`` lays out what bcd reads (DMI ids, NICs, disks, CPUs, memory)
so ``bcd --root <root>`` sees that machine; ``RecordingRunner`` records the commands bcd runs
instead of running them, and can act like the real program (``modprobe`` loads the module).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DiskSpec", "RecordingRunner", "RunAnswer", "prepare_machine"]


@dataclass(frozen=True)
class RunAnswer:
    """What a recorded command answers."""

    returncode: int = 0
    stdout: str = ""
    stderr: str = ""


@dataclass(frozen=True)
class DiskSpec:
    """A disk of a prepared machine: a plain file at ``/dev/<name>`` of ``size`` bytes."""

    name: str
    size: int = 8 << 20
    model: str = "BC-SIM-DISK"
    serial: str | None = None
    rotational: bool = False
    removable: bool = False


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def prepare_machine(
    root: Path,
    *,
    product_uuid: str = "4c4c4544-0042-3510-8052-b4c04f4e3432",
    serial: str = "SIM-0001",
    macs: Sequence[str] = ("52:54:00:12:34:56",),
    disks: Sequence[DiskSpec] = (DiskSpec("vdb"),),
    root_disk: str | None = None,
    cpus: int = 4,
    memory_kib: int = 16 * 1024 * 1024,
    hostname: str = "sim-node",
    nvidia_gpus: int = 0,
) -> Path:
    """Lay out a machine under ``root`` and return it.

    ``root_disk`` names a disk whose second partition is mounted at ``/`` (an installed OS);
    without it ``/`` is a tmpfs (a ramdisk).
    """
    dmi = root / "sys/class/dmi/id"
    for name, value in {
        "product_uuid": product_uuid,
        "product_serial": serial,
        "sys_vendor": "Better Compute",
        "product_name": "Simulated Machine",
        "board_name": "SIM-BOARD",
        "bios_vendor": "SimBIOS",
        "bios_version": "1.2.3",
        "bios_date": "01/01/2026",
    }.items():
        _write(dmi / name, value)
    for i, mac in enumerate(macs):
        nic = root / f"sys/class/net/eth{i}"
        (nic / "device").mkdir(parents=True, exist_ok=True)
        _write(nic / "address", mac)
        _write(nic / "carrier", "1")
        _write(nic / "operstate", "up")
        _write(nic / "speed", "25000")
        _write(nic / "mtu", "9000")
    lo = root / "sys/class/net/lo"
    _write(lo / "address", "00:00:00:00:00:00")
    (root / "dev").mkdir(parents=True, exist_ok=True)
    for disk in disks:
        block = root / f"sys/block/{disk.name}"
        (block / "device").mkdir(parents=True, exist_ok=True)
        _write(block / "size", str(disk.size // 512))
        _write(block / "device/model", disk.model)
        _write(block / "device/serial", disk.serial or f"SER-{disk.name}")
        _write(block / "queue/rotational", "1" if disk.rotational else "0")
        _write(block / "removable", "1" if disk.removable else "0")
        with open(root / f"dev/{disk.name}", "wb") as fh:
            fh.truncate(disk.size)
    mount = f"/dev/{root_disk}2 / ext4 rw 0 0" if root_disk else "rootfs / tmpfs rw 0 0"
    _write(root / "proc/mounts", mount)
    _write(root / "proc/cmdline", "console=ttyS0")
    _write(
        root / "proc/cpuinfo",
        "\n\n".join(
            f"processor\t: {i}\nmodel name\t: Sim CPU @ 3.0GHz\nphysical id\t: 0\ncpu cores\t: {cpus}\n"
            "flags\t\t: fpu vmx sse"
            for i in range(cpus)
        ),
    )
    _write(root / "proc/meminfo", f"MemTotal:       {memory_kib} kB\nMemFree:        1024 kB")
    _write(root / "proc/sys/kernel/osrelease", "6.1.0-sim")
    _write(root / "etc/hostname", hostname)
    for i in range(nvidia_gpus):
        dev = root / f"sys/bus/pci/devices/0000:{0x17 + i:02x}:00.0"
        _write(dev / "vendor", "0x10de")
        _write(dev / "class", "0x030200")
        _write(dev / "device", "0x2330")
    return root


@dataclass
class RecordingRunner:
    """A ``CommandRunner`` that records each command instead of running it.

    Args:
        programs: programs the machine has (``which`` finds them).
        answers: program name -> a function of argv giving a ``RunAnswer`` (default: success).
    """

    programs: set[str] = field(default_factory=set)
    answers: Mapping[str, Callable[[Sequence[str]], RunAnswer]] = field(default_factory=dict)
    ran: list[list[str]] = field(default_factory=list)

    def which(self, program: str) -> str | None:
        return f"/usr/bin/{program}" if program in self.programs else None

    def run(self, argv: Sequence[str], *, input: bytes | None = None, timeout: float = 600.0) -> RunAnswer:
        self.ran.append(list(argv))
        answer = self.answers.get(os.path.basename(argv[0]))
        return answer(argv) if answer is not None else RunAnswer()

    def commands(self, program: str) -> list[list[str]]:
        return [argv for argv in self.ran if argv[0] == program]
