"""``VmLab``: N VMs as machines, each behind a real BMC implementation (sushy-emulator for
Redfish, pyghmi's BMC server for IPMI), their network boot pointed at a site agent."""

from __future__ import annotations

import json
import random
import sys
import time
import uuid as uuidlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ...files import atomic_write
from ...runtime.embedded import free_port
from ..bmcs import _Proc
from .qemu import VirtualMachine, VmSpec
from .redfish import RedfishVmBmc

__all__ = ["GUEST_HOST", "IpmiVmBmc", "LabVm", "VmLab", "guest_url", "vm_identity"]

GUEST_HOST = "10.0.2.2"
"""This machine's loopback as a guest on QEMU's user network sees it."""


def guest_url(url: str) -> str:
    """``url`` (on 127.0.0.1) as the guest reaches it."""
    return url.replace("127.0.0.1", GUEST_HOST).replace("localhost", GUEST_HOST)


def vm_identity(seed: int, index: int) -> tuple[str, str, str]:
    """A VM's product UUID, serial and MAC: unique per (seed, index), stable per seed. The MACs
    (``52:56:…``) are not the metal simulator's (``52:54:…``), so both can share a site."""
    rng = random.Random(f"vmlab-{seed}-{index}")
    product_uuid = str(uuidlib.UUID(int=rng.getrandbits(128), version=4))
    serial = f"VM{seed % 1000:03d}{index:05d}"
    mac = f"52:56:{seed % 256:02x}:{(index >> 8) & 0xFF:02x}:{index & 0xFF:02x}:01"
    return product_uuid, serial, mac


class IpmiVmBmc(_Proc):
    """pyghmi's BMC server for one VM, its own process, which owns the VM's QEMU."""

    def __init__(
        self, folder: Path, spec: VmSpec, *, username: str = "admin", password: str = "vm-ipmi-pw-1"
    ) -> None:
        super().__init__(folder)
        self.spec = spec
        self.username = username
        self.password = password
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.request_log = self.folder / "requests.jsonl"

    @property
    def credentials(self) -> dict[str, str]:
        return {"username": self.username, "password": self.password}

    def start(self) -> IpmiVmBmc:
        spec_file = self.folder / "vm.json"
        spec_file.write_text(json.dumps(self.spec.to_json()))
        creds = self.folder / "credentials.json"
        atomic_write(creds, json.dumps(self.credentials))
        self._spawn(
            [sys.executable, "-m", "better_compute.testing.vmlab.ipmi_main", "--vm", str(spec_file),
             "--port", str(self.port), "--credentials-file", str(creds),
             "--request-log", str(self.request_log)]
        )  # fmt: skip
        end = time.monotonic() + 60
        while not (self.folder / "ready").exists():  # written once its UDP socket is bound
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"the IPMI BMC exited: {self.output()[-2000:]}")
            if time.monotonic() > end:
                raise RuntimeError("the IPMI BMC did not start in 60 s")
            time.sleep(0.05)
        return self

    def requests(self) -> list[dict[str, Any]]:
        """Every request the BMC served (``{"call": "power_on", …}``), in order."""
        if not self.request_log.exists():
            return []
        return [json.loads(line) for line in self.request_log.read_text().splitlines() if line.strip()]

    def vm_events(self) -> list[dict[str, Any]]:
        path = Path(self.spec.folder) / "events.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@dataclass
class LabVm:
    """One VM of the lab: who it is, its files, and its BMC."""

    index: int
    spec: VmSpec
    bmc_protocol: Literal["redfish", "ipmi"]
    bmc_address: str
    """``http://127.0.0.1:<port>`` (Redfish, system id = ``uuid``) or ``127.0.0.1:<port>`` (IPMI)."""
    vm: VirtualMachine | None = None
    """The VM object when this process owns it (Redfish); an IPMI BMC process owns its own."""
    ipmi: IpmiVmBmc | None = None

    @property
    def uuid(self) -> str:
        return self.spec.uuid

    @property
    def serial(self) -> str:
        return self.spec.serial

    @property
    def mac(self) -> str:
        return self.spec.mac

    @property
    def macs(self) -> tuple[str, ...]:
        return (self.spec.mac,)

    @property
    def folder(self) -> Path:
        return Path(self.spec.folder)

    @property
    def disk(self) -> Path:
        """The VM's disk file (raw): what the guest's ``/dev/vda`` is."""
        return self.folder / "disk.raw"

    @property
    def console(self) -> Path:
        return self.folder / "console.log"

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        path = self.folder / "events.jsonl"
        if not path.exists():
            return []
        found = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [e for e in found if kind is None or e.get("event") == kind]


class VmLab:
    """N VMs behind one protocol's BMCs. ``start()``, ``close()``; ``vms[i]`` is a ``LabVm``.

    ``boot_url`` is the site agent's HTTP as this machine reaches it (``http://127.0.0.1:<port>``);
    each VM's iPXE is handed ``<it as the guest sees it>/boot.ipxe``.
    """

    def __init__(
        self,
        folder: Path,
        *,
        vms: int = 1,
        boot_url: str,
        bmc: Literal["redfish", "ipmi"] = "redfish",
        seed: int = 0,
        name_prefix: str = "vm",
        disk_bytes: int = 2 << 30,
        memory_mb: int = 1024,
        power_delay: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        self.folder = folder
        self.protocol = bmc
        self.vms: list[LabVm] = []
        specs = []
        for i in range(vms):
            product_uuid, serial, mac = vm_identity(seed, i)
            specs.append(
                VmSpec(
                    name=f"{name_prefix}{i:02d}",
                    folder=str(folder / f"vm{i:02d}"),
                    uuid=product_uuid,
                    serial=serial,
                    mac=mac,
                    boot_url=guest_url(boot_url.rstrip("/")) + "/boot.ipxe",
                    disk_bytes=disk_bytes,
                    memory_mb=memory_mb,
                )
            )
        self.redfish: RedfishVmBmc | None = None
        if bmc == "redfish":
            machines = [VirtualMachine(s) for s in specs]
            self.redfish = RedfishVmBmc(folder / "redfish", machines, power_delay=power_delay)
            for i, (spec, vm) in enumerate(zip(specs, machines, strict=True)):
                self.vms.append(LabVm(i, spec, "redfish", "", vm=vm))
        else:
            for i, spec in enumerate(specs):
                Path(spec.folder).mkdir(parents=True, exist_ok=True)
                ipmi = IpmiVmBmc(folder / f"ipmi{i:02d}", spec)
                self.vms.append(LabVm(i, spec, "ipmi", ipmi.address, ipmi=ipmi))

    def start(self) -> VmLab:
        if self.redfish is not None:
            self.redfish.start()
            for v in self.vms:
                v.bmc_address = self.redfish.url
        for v in self.vms:
            if v.ipmi is not None:
                v.ipmi.start()
        return self

    def close(self) -> None:
        for v in self.vms:
            if v.ipmi is not None:
                v.ipmi.close()
            if v.vm is not None:
                v.vm.close()
        if self.redfish is not None:
            self.redfish.close()

    def __enter__(self) -> VmLab:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def credentials(self, index: int) -> dict[str, str]:
        """The BMC credential of VM ``index`` (what goes into bc-secrets)."""
        v = self.vms[index]
        if v.ipmi is not None:
            return v.ipmi.credentials
        assert self.redfish is not None
        return self.redfish.credentials

    def bmc_requests(self, index: int) -> list[str]:
        """What VM ``index``'s BMC served: Redfish ``METHOD path status`` lines of its system (and
        the service root's), IPMI calls as ``call[:device]``."""
        v = self.vms[index]
        if v.ipmi is not None:
            return [r["call"] + (f":{r['device']}" if "device" in r else "") for r in v.ipmi.requests()]
        assert self.redfish is not None
        return [r for r in self.redfish.requests() if f"/Systems/{v.uuid}" in r]
