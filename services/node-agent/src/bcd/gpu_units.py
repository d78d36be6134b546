"""The converger's GPU units: ``container-toolkit``, ``nvidia-driver``, ``fabric-manager``,
``mig-layout``, ``gpu-sharing``.

They apply where the hardware is: an NVIDIA GPU under ``/sys/bus/pci`` or listed by
``nvidia-smi``. On a machine without one each unit is reported ``skipped`` ("no NVIDIA GPU on
this machine"), and ``fabric-manager`` is skipped on a machine without an NVSwitch. What they
change is read back from the machine where it can be — the driver version and the MIG and
compute modes from ``nvidia-smi``, the service from ``systemctl``, the MIG layout from
``nvidia-mig-parted assert`` — so applying them again runs nothing; ``container-toolkit`` and a
driver installed but not loaded yet remember what they applied under ``/var/lib/bcd/units/``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from .hardware import nvidia_pci
from .system import Machine
from .unit import Apply, Unit, UnitFailed, UnitSkipped, last_line

__all__ = ["GPU_UNITS", "Gpus", "SmiGpu", "look_at_gpus"]

_QUERY: Final = "index,uuid,driver_version,mig.mode.current,mig.mode.pending,compute_mode"
_NO_DEVICES: Final = 6  # nvidia-smi's exit status when it finds no GPU
_NOT_SUPPORTED: Final = frozenset({"[N/A]", "N/A", "[Not Supported]", ""})
_RUNTIME_SERVICE: Final = {"containerd": "containerd", "docker": "docker", "cri-o": "crio"}
_FABRIC_MANAGER: Final = "nvidia-fabricmanager.service"
_MIG_CONFIG: Final = "/etc/nvidia-mig-manager/config.yaml"
_SHARING_FILE: Final = "/etc/nvidia-device-plugin/sharing.yaml"


@dataclass(frozen=True)
class SmiGpu:
    """One GPU as ``nvidia-smi`` lists it."""

    index: str
    uuid: str
    driver: str
    mig_current: str  # Enabled, Disabled, [N/A] (no MIG on this GPU)
    mig_pending: str
    compute_mode: str  # Default, Exclusive_Process, Prohibited


@dataclass(frozen=True)
class Gpus:
    """The machine's NVIDIA hardware: PCI GPUs and NVSwitches, and what ``nvidia-smi`` lists.

    ``listed`` is None when ``nvidia-smi`` is missing or fails (``smi_error`` says which).
    """

    pci: tuple[str, ...]
    nvswitches: tuple[str, ...]
    listed: tuple[SmiGpu, ...] | None
    smi_error: str | None

    @property
    def present(self) -> bool:
        return bool(self.pci) or bool(self.listed)

    def smi(self, unit: str) -> tuple[SmiGpu, ...]:
        """``nvidia-smi``'s GPUs, or ``UnitFailed`` saying why ``unit`` cannot use them."""
        if self.listed is None:
            raise UnitFailed(f"{unit} needs the NVIDIA driver: {self.smi_error}")
        return self.listed


def look_at_gpus(machine: Machine) -> Gpus:
    """What NVIDIA hardware the machine has (``/sys/bus/pci``, ``nvidia-smi`` when installed)."""
    pci, switches = nvidia_pci(machine)
    listed: tuple[SmiGpu, ...] | None = None
    error = None
    if not machine.has("nvidia-smi"):
        error = "nvidia-smi is not installed on this machine (the nvidia-driver unit installs it)"
    else:
        done = machine.run("nvidia-smi", f"--query-gpu={_QUERY}", "--format=csv,noheader", timeout=60)
        if done.returncode == _NO_DEVICES or (done.returncode == 0 and not done.stdout.strip()):
            listed = ()
        elif done.returncode != 0:
            error = (
                f"nvidia-smi could not list the GPUs: {last_line(done)}"
                " (a driver just installed loads at the next boot)"
            )
        else:
            rows = [[p.strip() for p in line.split(",")] for line in done.stdout.splitlines() if line.strip()]
            listed = tuple(SmiGpu(*row) for row in rows if len(row) == 6)
    return Gpus(tuple(pci), tuple(switches), listed, error)


def _gpus(u: Unit) -> Gpus:
    """The machine's GPUs (looked at once per converge); ``UnitSkipped`` when it has none."""
    gpus = u.cache.get("gpus")
    if gpus is None:
        gpus = u.cache["gpus"] = look_at_gpus(u.machine)
    if not gpus.present:
        raise UnitSkipped("no NVIDIA GPU on this machine")
    assert isinstance(gpus, Gpus)
    return gpus


async def _container_toolkit(u: Unit, s: Mapping[str, Any]) -> tuple[bool, str | None]:
    _gpus(u)
    if u.stamped("container-toolkit", s):
        return False, None
    u.need("nvidia-ctk", "the NVIDIA container toolkit")
    runtime = str(s.get("runtime", "containerd"))
    argv = ["nvidia-ctk", "runtime", "configure", f"--runtime={runtime}"]
    if s.get("setAsDefault", True):
        argv.append("--set-as-default")
    u.must(*argv)
    u.must("systemctl", "restart", _RUNTIME_SERVICE[runtime])
    u.stamp("container-toolkit", s)
    return True, None


def _version_is(loaded: str | None, wanted: str) -> bool:
    """``550.54.15`` is version ``550``, ``550.54`` and ``550.54.15``."""
    want = wanted.split(".")
    return loaded is not None and loaded.split(".")[: len(want)] == want


async def _nvidia_driver(u: Unit, s: Mapping[str, Any]) -> tuple[bool, str | None]:
    gpus = _gpus(u)
    version = str(s["version"])
    loaded = next((g.driver for g in gpus.listed or () if g.driver), None) or u.machine.read(
        "/sys/module/nvidia/version"
    )
    if _version_is(loaded, version):
        return False, None
    later = f"driver {version} installed; it loads at the next boot (loaded now: {loaded or 'none'})"
    if u.stamped("nvidia-driver", s):
        return False, later
    major = version.split(".")[0]
    open_module = s.get("kernelModule", "open") == "open"
    if u.machine.has("apt-get"):
        u.must("apt-get", "install", "-y", f"nvidia-driver-{major}{'-open' if open_module else ''}")
    elif u.machine.has("dnf"):
        u.must("dnf", "module", "install", "-y", f"nvidia-driver:{major}-{'open' if open_module else 'dkms'}")
    else:
        raise UnitFailed("no package manager (apt-get, dnf) to install the driver with")
    u.stamp("nvidia-driver", s)
    return True, later


async def _fabric_manager(u: Unit, s: Mapping[str, Any]) -> tuple[bool, str | None]:
    gpus = _gpus(u)
    state = u.query("systemctl", "is-enabled", _FABRIC_MANAGER).stdout.strip()
    installed = state not in ("", "not-found")
    if s.get("enabled", True):
        if not gpus.nvswitches:
            raise UnitSkipped("no NVSwitch on this machine: fabric manager runs on NVSwitch systems only")
        if not installed:
            raise UnitFailed(f"{_FABRIC_MANAGER} is not installed (the nvidia-fabricmanager package)")
        if state == "enabled" and u.query("systemctl", "is-active", _FABRIC_MANAGER).returncode == 0:
            return False, None
        u.must("systemctl", "enable", "--now", _FABRIC_MANAGER)
        return True, None
    if not installed:
        return False, None
    if state != "enabled" and u.query("systemctl", "is-active", _FABRIC_MANAGER).returncode != 0:
        return False, None
    u.must("systemctl", "disable", "--now", _FABRIC_MANAGER)
    return True, None


async def _mig_layout(u: Unit, s: Mapping[str, Any]) -> tuple[bool, str | None]:
    listed = _gpus(u).smi("mig-layout")
    layout = str(s["layout"])
    by_index = {g.index: g for g in listed}
    wanted = [str(g) for g in s.get("gpus") or []]
    missing = [i for i in wanted if i not in by_index]
    if missing:
        there = ", ".join(by_index) or "none"
        raise UnitFailed(f"no GPU {', '.join(missing)} on this machine (nvidia-smi lists {there})")
    targets = [by_index[i] for i in wanted] or [g for g in listed if g.mig_current not in _NOT_SUPPORTED]
    if not targets:
        raise UnitFailed("no GPU on this machine supports MIG")
    unable = [g.index for g in targets if g.mig_current in _NOT_SUPPORTED]
    if unable:
        raise UnitFailed(f"GPU {', '.join(unable)} does not support MIG")
    u.need("nvidia-mig-parted", "mig-layout applies layouts with nvidia-mig-parted")
    if not u.machine.path(_MIG_CONFIG).exists():
        raise UnitFailed(f"{_MIG_CONFIG} is missing: nvidia-mig-parted reads the layout {layout} from it")
    changed = False
    for gpu in targets:
        if "Enabled" not in (gpu.mig_current, gpu.mig_pending):
            u.must("nvidia-smi", "-i", gpu.index, "-mig", "1")
            changed = True
    config = u.real(_MIG_CONFIG)
    if not changed and u.query("nvidia-mig-parted", "assert", "-f", config, "-c", layout).returncode == 0:
        return False, None
    u.must("nvidia-mig-parted", "apply", "-f", config, "-c", layout)
    return True, None


async def _gpu_sharing(u: Unit, s: Mapping[str, Any]) -> tuple[bool, str | None]:
    gpus = _gpus(u)
    strategy = str(s["strategy"])
    replicas = int(s["replicas"])
    key = "timeSlicing" if strategy == "time-slicing" else "mps"
    doc = {  # the NVIDIA device plugin's sharing config (JSON is YAML)
        "version": "v1",
        "sharing": {key: {"resources": [{"name": "nvidia.com/gpu", "replicas": replicas}]}},
    }
    changed = u.write(_SHARING_FILE, json.dumps(doc, indent=2) + "\n")
    if strategy == "mps":
        for gpu in gpus.smi("gpu-sharing with mps"):
            if gpu.compute_mode != "Exclusive_Process":
                u.must("nvidia-smi", "-i", gpu.index, "-c", "EXCLUSIVE_PROCESS")
                changed = True
    else:  # time-slicing: a GPU left exclusive by mps takes every process again
        for gpu in gpus.listed or ():
            if gpu.compute_mode == "Exclusive_Process":
                u.must("nvidia-smi", "-i", gpu.index, "-c", "DEFAULT")
                changed = True
    return changed, None


GPU_UNITS: Final[Mapping[str, Apply]] = {
    "container-toolkit": _container_toolkit,
    "nvidia-driver": _nvidia_driver,
    "fabric-manager": _fabric_manager,
    "mig-layout": _mig_layout,
    "gpu-sharing": _gpu_sharing,
}
