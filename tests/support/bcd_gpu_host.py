"""A simulated GPU machine for bcd's converger tests: a prepared tree with NVIDIA GPUs (and an
NVSwitch), and fake ``nvidia-smi``, ``systemctl``, ``nvidia-mig-parted``, ``modprobe`` and
``kubeadm`` that answer like the real programs and keep state, through a ``RecordingRunner``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from bcd.system import Machine
from better_compute.provision.profiles import HostUnit
from better_compute.testing.machines import RecordingRunner, RunAnswer, prepare_machine
from better_compute.wire.commands import ConvergeUnit

REF = "sec_01M8R2PJRBNHM27WE1SRZ01H3G"
TOKEN = "abcdef.0123456789abcdef"
_SMI_FIELDS = {
    "index",
    "uuid",
    "driver_version",
    "mig.mode.current",
    "mig.mode.pending",
    "compute_mode",
    "pci.bus_id",
    "name",
    "memory.total",
}


@dataclass
class FakeHost:
    """The programs of a simulated GPU machine: they answer like the real ones and keep state."""

    root: Path
    gpus: int = 2
    mig: bool = True
    driver: str | None = "535.161.08"  # None: nvidia-smi cannot reach a driver (not loaded)
    smi: bool = True  # nvidia-smi is installed
    fabric_manager: bool = True  # nvidia-fabricmanager.service is installed
    enabled: set[str] = field(default_factory=set)
    active: set[str] = field(default_factory=set)
    mig_mode: dict[str, str] = field(default_factory=dict)
    compute: dict[str, str] = field(default_factory=dict)
    layout: str | None = None

    def runner(self) -> RecordingRunner:
        programs = {
            "nvidia-ctk",
            "kubeadm",
            "apt-get",
            "nvidia-mig-parted",
            "sysctl",
            "modprobe",
            "systemctl",
        }
        return RecordingRunner(
            programs=programs | ({"nvidia-smi"} if self.smi else set()),
            answers={
                "nvidia-smi": self.nvidia_smi,
                "systemctl": self.systemctl,
                "nvidia-mig-parted": self.mig_parted,
                "modprobe": self.modprobe,
                "kubeadm": self.kubeadm,
            },
        )

    def _gpu(self, index: str, name: str) -> str:
        mig = self.mig_mode.get(index, "Disabled") if self.mig else "[N/A]"
        return {
            "index": index,
            "uuid": f"GPU-{index}0000000-0000-0000-0000-000000000000",
            "driver_version": self.driver or "",
            "mig.mode.current": mig,
            "mig.mode.pending": mig,
            "compute_mode": self.compute.get(index, "Default"),
            "pci.bus_id": f"00000000:{0x17 + int(index):02x}:00.0",
            "name": "NVIDIA H100 80GB HBM3",
            "memory.total": "81559",
        }[name]

    def nvidia_smi(self, argv: Sequence[str]) -> RunAnswer:
        argv = list(argv)
        if self.driver is None:
            return RunAnswer(
                9, stderr="NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
            )
        if self.gpus == 0:
            return RunAnswer(6, stdout="No devices were found")
        if argv[1].startswith("--query-gpu="):
            names = argv[1].removeprefix("--query-gpu=").split(",")
            assert set(names) <= _SMI_FIELDS, names
            rows = [", ".join(self._gpu(str(i), n) for n in names) for i in range(self.gpus)]
            return RunAnswer(stdout="\n".join(rows) + "\n")
        if argv[1] == "-i" and argv[3:] == ["-mig", "1"] and self.mig:
            self.mig_mode[argv[2]] = "Enabled"
            return RunAnswer(stdout=f"Enabled MIG Mode for GPU {argv[2]}")
        if argv[1] == "-i" and argv[3] == "-c":
            self.compute[argv[2]] = {"EXCLUSIVE_PROCESS": "Exclusive_Process", "DEFAULT": "Default"}[argv[4]]
            return RunAnswer(stdout=f"Set compute mode to {argv[4]} for GPU {argv[2]}.")
        return RunAnswer(2, stderr=f"Invalid combination of input arguments: {argv[1:]}")

    def systemctl(self, argv: Sequence[str]) -> RunAnswer:
        argv = list(argv)
        verb, unit = argv[1], argv[-1]
        if unit == "nvidia-fabricmanager.service" and not self.fabric_manager:
            return RunAnswer(1, stderr=f"Failed to get unit file state for {unit}: No such file or directory")
        if verb == "is-enabled":
            return RunAnswer(0, "enabled") if unit in self.enabled else RunAnswer(1, "disabled")
        if verb == "is-active":
            return RunAnswer(0, "active") if unit in self.active else RunAnswer(3, "inactive")
        if verb in ("enable", "disable"):
            on = verb == "enable"
            for kept in (self.enabled, self.active) if "--now" in argv else (self.enabled,):
                (kept.add if on else kept.discard)(unit)
        return RunAnswer()

    def mig_parted(self, argv: Sequence[str]) -> RunAnswer:
        argv = list(argv)
        assert argv[2:4] == ["-f", str(self.root / "etc/nvidia-mig-manager/config.yaml")]
        if argv[1] == "assert":
            return RunAnswer(0 if self.layout == argv[-1] else 1)
        self.layout = argv[-1]
        return RunAnswer()

    def modprobe(self, argv: Sequence[str]) -> RunAnswer:
        (self.root / "sys/module" / argv[-1]).mkdir(parents=True)
        return RunAnswer()

    def kubeadm(self, argv: Sequence[str]) -> RunAnswer:
        (self.root / "etc/kubernetes").mkdir(parents=True)
        (self.root / "etc/kubernetes/kubelet.conf").write_text("joined\n")
        return RunAnswer()


def gpu_machine(
    tmp_path: Path, *, nvswitch: bool = True, gpus: int = 2, **kw: Any
) -> tuple[Machine, FakeHost, RecordingRunner]:
    root = prepare_machine(tmp_path / "root", nvidia_gpus=gpus)
    if nvswitch:
        for name, value in {"vendor": "0x10de", "class": "0x068000", "device": "0x22a3"}.items():
            path = root / "sys/bus/pci/devices/0000:c0:00.0" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(value + "\n")
    hugepages = root / "sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages"
    hugepages.parent.mkdir(parents=True)
    hugepages.write_text("0\n")
    (root / "etc/nvidia-mig-manager").mkdir(parents=True)
    (root / "etc/nvidia-mig-manager/config.yaml").write_text("version: v1\nmig-configs: {}\n")
    host = FakeHost(root, gpus=gpus, **kw)
    runner = host.runner()
    return Machine(root=root, runner=runner), host, runner  # type: ignore[arg-type]


async def fetch(ref: str) -> bytes:
    assert ref == REF
    return TOKEN.encode() + b"\n"


def changing(runner: RecordingRunner) -> list[list[str]]:
    """The commands that change the machine (not the queries a unit looks with)."""
    return [
        a
        for a in runner.ran
        if not (
            a[1:2] in (["is-enabled"], ["is-active"], ["assert"]) or any(x.startswith("--query") for x in a)
        )
    ]


def _unit(name: str, settings: dict[str, Any], when: str | None) -> HostUnit:
    return HostUnit(name=name, settings=settings, when=when)


# A profile's hostConfig as a user writes it: the engine fills defaults (resolve_host_section).
PROFILE_UNITS = [
    _unit("sysctl", {"values": {"net.ipv4.ip_forward": "1", "vm.swappiness": "10"}}, None),
    _unit(
        "kernel-modules",
        {
            "load": ["br_netfilter"],
            "blacklist": ["nouveau"],
            "options": {"nvidia": "NVreg_EnableGpuFirmware=0"},
        },
        None,
    ),
    _unit("hugepages", {"count": 512}, None),
    _unit("container-toolkit", {}, "gpu=nvidia"),
    _unit(
        "k8s-join",
        {
            "apiServer": "https://k8s.example.test:6443",
            "tokenRef": REF,
            "caCertHash": "sha256:" + "a" * 64,
            "labels": {"zone": "a"},
            "taints": ["gpu=true:NoSchedule"],
        },
        None,
    ),
    _unit("nvidia-driver", {"version": "550.54.15"}, "gpu=nvidia"),
    _unit("fabric-manager", {}, "gpu=nvidia"),
    _unit("mig-layout", {"layout": "all-1g.10gb"}, "gpu=nvidia"),
    _unit("gpu-sharing", {"strategy": "time-slicing", "replicas": 4}, "gpu=nvidia"),
]


def units_of(docs: Sequence[Any]) -> list[ConvergeUnit]:
    """A host section's units as ``node.converge`` carries them to bcd (decoded once there)."""
    return msgspec.convert(list(docs), list[ConvergeUnit])
