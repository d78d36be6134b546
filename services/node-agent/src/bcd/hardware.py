"""What the machine is: its hardware claims (for joining) and its inventory (``node.inventory``).

Everything is read from ``/sys`` and ``/proc`` under the machine's root, so a test can point
bcd at a prepared tree; ``lsblk --json`` and ``nvidia-smi`` add what sysfs lacks when the
machine has them.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Final

import msgspec

from better_compute.wire.commands import (
    NodeCpus,
    NodeDisk,
    NodeFirmware,
    NodeGpu,
    NodeInventoryResult,
    NodeMemory,
    NodeNic,
)
from better_compute.wire.pki import JoinClaims

from .system import Machine

__all__ = ["block_disks", "boot_disk", "boot_disks", "claims", "gpu_uuids", "inventory", "macs", "nvidia_pci"]

_JUNK: Final = frozenset(
    {"", "none", "0", "default string", "to be filled by o.e.m.", "not specified", "not applicable",
     "system serial number", "123456789", "00000000-0000-0000-0000-000000000000"}
)  # fmt: skip
_MAC_RE: Final = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")
_NOT_DISKS: Final = ("loop", "ram", "zram", "sr", "dm-", "md", "nbd", "fd")


def _value(machine: Machine, path: str) -> str | None:
    got = machine.read(path)
    if got is None or got.strip().lower() in _JUNK:
        return None
    return got.strip()


def macs(machine: Machine) -> list[str]:
    """MAC addresses of the physical NICs (those backed by a device), sorted."""
    found: set[str] = set()
    for nic in _listdir(machine.path("/sys/class/net")):
        base = f"/sys/class/net/{nic}"
        if not machine.path(f"{base}/device").exists():
            continue  # lo, bridges, bonds, veths
        mac = (machine.read(f"{base}/address") or "").lower()
        if _MAC_RE.match(mac) and mac != "00:00:00:00:00:00":
            found.add(mac)
    return sorted(found)


def gpu_uuids(machine: Machine) -> list[str]:
    """The GPUs' UUIDs from ``nvidia-smi``, when the machine has it."""
    if not machine.has("nvidia-smi"):
        return []
    done = machine.run("nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader", timeout=60)
    if done.returncode != 0:
        return []
    return sorted({line.strip() for line in done.stdout.splitlines() if line.strip()})


def claims(machine: Machine) -> JoinClaims:
    """The hardware claims a join shows: product UUID, serial, MACs, GPU UUIDs, hostname."""
    return JoinClaims(
        macs=macs(machine)[:64],
        product_uuid=_value(machine, "/sys/class/dmi/id/product_uuid"),
        serial=_value(machine, "/sys/class/dmi/id/product_serial")
        or _value(machine, "/sys/class/dmi/id/chassis_serial"),
        gpu_uuids=gpu_uuids(machine)[:64],
        hostname=_value(machine, "/etc/hostname"),
    )


def _listdir(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def block_disks(machine: Machine) -> list[str]:
    """Names of the machine's disks (``sda``, ``nvme0n1``, ``vdb``): block devices backed by a
    device, without loop, RAM, optical and mapped devices."""
    return [
        name
        for name in _listdir(machine.path("/sys/block"))
        if not name.startswith(_NOT_DISKS) and machine.path(f"/sys/block/{name}/device").exists()
    ]


def _parent_disk(machine: Machine, device: str) -> str:
    """The disk a partition (``sda2``, ``nvme0n1p2``) is on; a disk names itself."""
    name = device.rsplit("/", 1)[-1]
    part = machine.path(f"/sys/class/block/{name}/partition")
    if part.exists():
        return machine.path(f"/sys/class/block/{name}").resolve().parent.name
    if machine.path(f"/sys/block/{name}").exists():
        return name
    match = re.match(r"^(nvme\d+n\d+|mmcblk\d+)p\d+$", name) or re.match(r"^([a-z]+)\d+$", name)
    return match.group(1) if match else name


def _beneath(machine: Machine, name: str, depth: int = 0) -> set[str]:
    """The disks under block device ``name``: through device-mapper, LVM and MD ``slaves``."""
    holders = _listdir(machine.path(f"/sys/class/block/{name}/slaves"))
    if not holders or depth > 8:
        return {_parent_disk(machine, name)}
    found: set[str] = set()
    for holder in holders:
        found |= _beneath(machine, holder, depth + 1)
    return found


def _root_device(machine: Machine) -> str | None:
    """The block device mounted at ``/`` (``dm-0``, ``sda2``); None for a tmpfs root."""
    for line in (machine.read("/proc/self/mountinfo") or "").splitlines():
        fields = line.split()
        if len(fields) > 4 and fields[4] == "/":
            link = machine.path(f"/sys/dev/block/{fields[2]}")
            if link.exists():
                return link.resolve().name
    for line in (machine.read("/proc/mounts") or "").splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[1] == "/" and fields[0].startswith("/dev/"):
            device = machine.path(fields[0])
            # /dev/mapper/vg-root and /dev/disk/by-uuid/… are links to the kernel's name
            return device.resolve().name if device.is_symlink() else fields[0].rsplit("/", 1)[-1]
    return None


def boot_disks(machine: Machine) -> set[str]:
    """The disks bcd runs from: every disk beneath the device mounted at ``/`` (several for a
    root on RAID or LVM); none in a ramdisk (tmpfs root)."""
    device = _root_device(machine)
    return _beneath(machine, device) if device is not None else set()


def boot_disk(machine: Machine) -> str | None:
    """One disk bcd runs from (the first of ``boot_disks``), or None."""
    return min(boot_disks(machine), default=None)


def _lsblk(machine: Machine) -> dict[str, dict[str, Any]]:
    # lsblk reads the real machine: only when bcd looks at the real machine.
    if machine.root != Path("/") or not machine.has("lsblk"):
        return {}
    done = machine.run("lsblk", "--json", "--bytes", "--nodeps", "-o", "NAME,MODEL,SERIAL,SIZE,ROTA,TRAN,WWN")
    if done.returncode != 0:
        return {}
    try:
        devices = json.loads(done.stdout).get("blockdevices", [])
    except ValueError:
        return {}
    return {str(d.get("name")): d for d in devices if isinstance(d, dict)}


def _disks(machine: Machine) -> list[NodeDisk]:
    extra = _lsblk(machine)
    boot = boot_disks(machine)
    disks = []
    for name in block_disks(machine):
        base = f"/sys/block/{name}"
        more = extra.get(name, {})
        sectors = _int(machine.read(f"{base}/size"))
        rotational = machine.read(f"{base}/queue/rotational")
        disks.append(
            NodeDisk(
                name=name,
                path=f"/dev/{name}",
                size_bytes=sectors * 512 if sectors is not None else _int(str(more.get("size"))),
                model=_value(machine, f"{base}/device/model") or more.get("model"),
                serial=_value(machine, f"{base}/device/serial")
                or _value(machine, f"{base}/serial")
                or more.get("serial"),
                rotational=rotational == "1" if rotational is not None else bool(more.get("rota")),
                removable=machine.read(f"{base}/removable") == "1",
                transport=more.get("tran"),
                wwn=_value(machine, f"{base}/wwid") or more.get("wwn"),
                boot=name in boot,
            )
        )
    return disks


def _cpus(machine: Machine) -> NodeCpus:
    text = machine.read("/proc/cpuinfo") or ""
    logical = 0
    sockets: set[str] = set()
    cores: dict[str, int] = {}
    model = None
    flags: list[str] = []
    for block in text.split("\n\n"):
        info: dict[str, str] = {}
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                info[key.strip()] = value.strip()
        if "processor" not in info:
            continue
        logical += 1
        socket = info.get("physical id", "0")
        sockets.add(socket)
        cores[socket] = _int(info.get("cpu cores")) or cores.get(socket, 1)
        model = model or info.get("model name") or info.get("cpu model")
        flags = flags or info.get("flags", "").split()
    return NodeCpus(
        model=model,
        sockets=len(sockets) or None,
        cores=sum(cores.values()) or None,
        threads=logical or None,
        virtualization="vmx" in flags or "svm" in flags,
    )


def _memory(machine: Machine) -> NodeMemory:
    for line in (machine.read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemTotal:"):
            kib = _int(line.split()[1])
            return NodeMemory(total_bytes=kib * 1024 if kib is not None else None)
    return NodeMemory()


def _nics(machine: Machine) -> list[NodeNic]:
    nics = []
    for nic in _listdir(machine.path("/sys/class/net")):
        base = f"/sys/class/net/{nic}"
        if not machine.path(f"{base}/device").exists():
            continue
        speed = _int(machine.read(f"{base}/speed"))
        driver = machine.path(f"{base}/device/driver")
        nics.append(
            NodeNic(
                name=nic,
                mac=(machine.read(f"{base}/address") or "").lower() or None,
                link=machine.read(f"{base}/carrier") == "1" or machine.read(f"{base}/operstate") == "up",
                speed_mbps=speed if speed is not None and speed > 0 else None,
                mtu=_int(machine.read(f"{base}/mtu")),
                driver=driver.resolve().name if driver.exists() else None,
            )
        )
    return nics


def nvidia_pci(machine: Machine) -> tuple[list[str], list[str]]:
    """The PCI addresses of the NVIDIA GPUs (display controllers) and NVSwitches (bridges)."""
    gpus: list[str] = []
    switches: list[str] = []
    for dev in _listdir(machine.path("/sys/bus/pci/devices")):
        base = f"/sys/bus/pci/devices/{dev}"
        if machine.read(f"{base}/vendor") != "0x10de":
            continue
        klass = machine.read(f"{base}/class") or ""
        if klass.startswith("0x03"):
            gpus.append(dev)
        elif klass.startswith("0x0680"):
            switches.append(dev)
    return gpus, switches


def _gpus(machine: Machine) -> list[NodeGpu]:
    gpus: list[NodeGpu] = []
    for dev in nvidia_pci(machine)[0]:
        device = machine.read(f"/sys/bus/pci/devices/{dev}/device")
        gpus.append(NodeGpu(pci_address=dev, vendor="nvidia", device_id=device))
    if machine.has("nvidia-smi"):
        done = machine.run(
            "nvidia-smi",
            "--query-gpu=pci.bus_id,name,uuid,memory.total,driver_version",
            "--format=csv,noheader,nounits",
            timeout=60,
        )
        if done.returncode == 0:
            at = {g.pci_address.lower(): i for i, g in enumerate(gpus)}
            for line in done.stdout.splitlines():
                parts = [p.strip() for p in line.split(",")]
                if len(parts) != 5:
                    continue
                bus = parts[0].lower()[-12:]  # 00000000:17:00.0 -> 0000:17:00.0
                if bus not in at:
                    at[bus] = len(gpus)
                    gpus.append(NodeGpu(pci_address=bus, vendor="nvidia"))
                gpus[at[bus]] = msgspec.structs.replace(
                    gpus[at[bus]],
                    name=parts[1],
                    uuid=parts[2],
                    memory_mib=_int(parts[3]),
                    driver_version=parts[4],
                )
    return gpus


def _firmware(machine: Machine) -> NodeFirmware:
    dmi = "/sys/class/dmi/id"
    return NodeFirmware(
        vendor=_value(machine, f"{dmi}/sys_vendor"),
        product=_value(machine, f"{dmi}/product_name"),
        board=_value(machine, f"{dmi}/board_name"),
        bios_vendor=_value(machine, f"{dmi}/bios_vendor"),
        bios_version=_value(machine, f"{dmi}/bios_version"),
        bios_date=_value(machine, f"{dmi}/bios_date"),
        boot_mode="uefi" if machine.path("/sys/firmware/efi").exists() else "bios",
    )


def inventory(machine: Machine) -> NodeInventoryResult:
    """The machine's hardware, as ``node.inventory`` reports it."""
    found = claims(machine)
    return NodeInventoryResult(
        product_uuid=found.product_uuid,
        serial=found.serial,
        hostname=found.hostname,
        kernel=machine.read("/proc/sys/kernel/osrelease"),
        cpus=_cpus(machine),
        memory=_memory(machine),
        disks=_disks(machine),
        nics=_nics(machine),
        gpus=_gpus(machine),
        firmware=_firmware(machine),
    )
