"""The host converger: applies a node's host section (config units) and reports each unit.

Each unit is idempotent: applied twice, the second run reports ``unchanged`` and runs nothing.
Files go under the machine's root; commands (``sysctl -p``, ``modprobe``, ``systemctl``,
``kubeadm``) go through the machine's runner. A unit this daemon was not built with is
reported as ``unit <name> is not supported by this daemon`` and fails the host section once
the known units had their turn; ``observedGeneration`` advances only when every unit applied.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from better_compute.core.errors import BcError, ErrorCode
from better_compute.logging import get_logger, register_secret
from better_compute.provision.config_units import BUILTIN_CONFIG_UNITS

from .system import Machine

__all__ = ["SUPPORTED_UNITS", "Converger", "UnitFailed"]

SecretFetcher = Callable[[str], Awaitable[bytes]]


def log() -> Any:
    """bcd's logger, as configured when it logs (never bound before ``configure_logging``)."""
    return get_logger(component="bcd")


_SYSCTL_KEY: Final = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_./-]{0,255}$")
_HUGEPAGE_KB: Final = {"2M": 2048, "1G": 1048576}
_RUNTIME_SERVICE: Final = {"containerd": "containerd", "docker": "docker", "cri-o": "crio"}
_STATE: Final = "/var/lib/bcd"


class UnitFailed(Exception):  # noqa: N818 - an outcome of one unit, reported, not a program error
    """A unit could not be applied; the message says why (never a secret)."""


@dataclass
class _Unit:
    machine: Machine
    fetch_secret: SecretFetcher | None
    ran: list[str]

    # -- helpers ---------------------------------------------------------------------

    def write(self, path: str, content: str, mode: int = 0o644) -> bool:
        """Write ``content`` to ``path`` (a machine path) unless it is there already."""
        target = self.machine.path(path)
        try:
            if target.read_text() == content and (target.stat().st_mode & 0o777) == mode:
                return False
        except OSError:
            pass
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.bcd-tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w") as fh:
            fh.write(content)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        tmp.replace(target)
        return True

    def must(self, *argv: str, hide: Sequence[str] = ()) -> str:
        """Run ``argv``; ``UnitFailed`` with the end of its output when it fails."""
        done = self.machine.run(*argv)
        shown = " ".join("***" if a in hide else a for a in argv[:3])
        self.ran.append(shown)
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
            text = said[0]
            for secret in hide:
                text = text.replace(secret, "***")
            raise UnitFailed(f"{shown} exited {done.returncode}: {text[:200]}")
        return done.stdout

    def need(self, program: str, why: str) -> None:
        if not self.machine.has(program):
            raise UnitFailed(f"{program} is not installed on this machine ({why})")

    def stamp(self, name: str, settings: Mapping[str, Any]) -> bool:
        """Whether ``settings`` differ from what was applied last (then remember them)."""
        doc = json.dumps(settings, sort_keys=True)
        return self.write(f"{_STATE}/units/{name}.json", doc + "\n", 0o600)

    def stamped(self, name: str, settings: Mapping[str, Any]) -> bool:
        doc = json.dumps(settings, sort_keys=True) + "\n"
        return self.machine.read(f"{_STATE}/units/{name}.json", "") == doc.strip()

    def has_nvidia_gpu(self) -> bool:
        base = self.machine.path("/sys/bus/pci/devices")
        try:
            devices = os.listdir(base)
        except OSError:
            return False
        for dev in devices:
            root = f"/sys/bus/pci/devices/{dev}"
            if self.machine.read(f"{root}/vendor") == "0x10de" and (
                self.machine.read(f"{root}/class") or ""
            ).startswith("0x03"):
                return True
        return False

    def real(self, path: str) -> str:
        """A machine path as the commands see it (under the root)."""
        return str(self.machine.path(path))


def _line_safe(value: str, where: str) -> str:
    if "\n" in value or "\r" in value or "\x00" in value:
        raise UnitFailed(f"{where} holds a line break")
    return value


# -- the units ------------------------------------------------------------------------


async def _sysctl(u: _Unit, s: Mapping[str, Any]) -> tuple[bool, str | None]:
    values: Mapping[str, str] = s.get("values", {})
    for key, value in values.items():
        if not _SYSCTL_KEY.match(key):
            raise UnitFailed(f"{key!r} is not a kernel parameter name")
        _line_safe(str(value), key)
    body = "".join(f"{k} = {values[k]}\n" for k in sorted(values))
    path = "/etc/sysctl.d/90-bc.conf"
    changed = u.write(path, "# written by bcd: host section unit sysctl\n" + body)
    live_differs = any(
        (got := u.machine.read(f"/proc/sys/{k.replace('.', '/')}")) is not None
        and " ".join(got.split()) != " ".join(str(v).split())
        for k, v in values.items()
    )
    if changed or live_differs:
        u.must("sysctl", "-p", u.real(path))
        return True, None
    return False, None


async def _kernel_modules(u: _Unit, s: Mapping[str, Any]) -> tuple[bool, str | None]:
    load: list[str] = list(s.get("load", []))
    blacklist: list[str] = list(s.get("blacklist", []))
    options: Mapping[str, str] = s.get("options", {})
    for module, opts in options.items():
        _line_safe(opts, f"options.{module}")
        if not re.match(r"^[A-Za-z0-9_-]{1,64}$", module):
            raise UnitFailed(f"{module!r} is not a module name")
    changed = u.write("/etc/modules-load.d/bc.conf", "# written by bcd\n" + "".join(f"{m}\n" for m in load))
    changed |= u.write(
        "/etc/modprobe.d/bc.conf",
        "# written by bcd\n"
        + "".join(f"blacklist {m}\n" for m in blacklist)
        + "".join(f"options {m} {options[m]}\n" for m in sorted(options)),
    )
    for module in load:
        if not u.machine.path(f"/sys/module/{module.replace('-', '_')}").exists():
            u.must("modprobe", module)
            changed = True
    loaded_blacklisted = [
        m for m in blacklist if u.machine.path(f"/sys/module/{m.replace('-', '_')}").exists()
    ]
    detail = f"still loaded until reboot: {', '.join(loaded_blacklisted)}" if loaded_blacklisted else None
    return changed, detail


async def _hugepages(u: _Unit, s: Mapping[str, Any]) -> tuple[bool, str | None]:
    size = str(s.get("size", "2M"))
    count = int(s["count"])
    kb = _HUGEPAGE_KB[size]
    sysfs = f"/sys/kernel/mm/hugepages/hugepages-{kb}kB/nr_hugepages"
    unit = (
        "[Unit]\nDescription=Reserve huge pages (written by bcd)\nDefaultDependencies=no\n"
        f"Before=sysinit.target\nConditionPathExists={sysfs}\n"
        f"[Service]\nType=oneshot\nExecStart=/bin/sh -c 'echo {count} > {sysfs}'\n"
        "[Install]\nWantedBy=sysinit.target\n"
    )
    changed = u.write("/etc/systemd/system/bc-hugepages.service", unit)
    if changed:
        u.must("systemctl", "daemon-reload")
        u.must("systemctl", "enable", "bc-hugepages.service")
    detail = None
    current = u.machine.read(sysfs)
    if current is not None and current != str(count):
        u.machine.path(sysfs).write_text(f"{count}\n")
        changed = True
        got = u.machine.read(sysfs)
        if got != str(count):
            detail = f"reserved {got} of {count} {size} pages now; the rest at the next boot"
    return changed, detail


async def _container_toolkit(u: _Unit, s: Mapping[str, Any]) -> tuple[bool, str | None]:
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


async def _k8s_join(u: _Unit, s: Mapping[str, Any]) -> tuple[bool, str | None]:
    labels: Mapping[str, str] = s.get("labels", {})
    taints: list[str] = list(s.get("taints", []))
    args = []
    if labels:
        args.append("--node-labels=" + ",".join(f"{k}={_line_safe(v, k)}" for k, v in sorted(labels.items())))
    if taints:
        args.append("--register-with-taints=" + ",".join(_line_safe(t, "taints") for t in taints))
    changed = u.write("/etc/default/kubelet", f"KUBELET_EXTRA_ARGS={' '.join(args)}\n")
    if u.machine.path("/etc/kubernetes/kubelet.conf").exists():
        return changed, None  # joined already
    u.need("kubeadm", "k8s-join joins with kubeadm")
    if u.fetch_secret is None:
        raise UnitFailed("k8s-join needs the secrets service to read tokenRef")
    try:
        token = (await u.fetch_secret(str(s["tokenRef"]))).decode().strip()
    except BcError as err:
        raise UnitFailed(f"tokenRef could not be read: {err.code.value}") from None
    register_secret(token)
    endpoint = str(s["apiServer"]).removeprefix("https://").rstrip("/")
    argv = [
        "kubeadm",
        "join",
        endpoint,
        "--token",
        token,
        "--discovery-token-ca-cert-hash",
        str(s["caCertHash"]),
    ]
    if s.get("role") == "control-plane":
        argv.append("--control-plane")
    u.must(*argv, hide=(token,))
    return True, None


async def _nvidia_driver(u: _Unit, s: Mapping[str, Any]) -> tuple[bool, str | None]:
    version = str(s["version"])
    loaded = u.machine.read("/sys/module/nvidia/version")
    if loaded == version or u.stamped("nvidia-driver", s):
        return False, None if loaded == version else f"driver {version} installed; reboot to load it"
    major = version.split(".")[0]
    open_module = s.get("kernelModule", "open") == "open"
    if u.machine.has("apt-get"):
        u.must("apt-get", "install", "-y", f"nvidia-driver-{major}{'-open' if open_module else ''}")
    elif u.machine.has("dnf"):
        u.must("dnf", "module", "install", "-y", f"nvidia-driver:{major}-{'open' if open_module else 'dkms'}")
    else:
        raise UnitFailed("no package manager (apt-get, dnf) to install the driver with")
    u.stamp("nvidia-driver", s)
    return True, f"driver {version} installed; reboot to load it"


async def _fabric_manager(u: _Unit, s: Mapping[str, Any]) -> tuple[bool, str | None]:
    if u.stamped("fabric-manager", s):
        return False, None
    verb = "enable" if s.get("enabled", True) else "disable"
    u.must("systemctl", verb, "--now", "nvidia-fabricmanager.service")
    u.stamp("fabric-manager", s)
    return True, None


async def _mig_layout(u: _Unit, s: Mapping[str, Any]) -> tuple[bool, str | None]:
    if u.stamped("mig-layout", s):
        return False, None
    u.need("nvidia-mig-parted", "mig-layout applies layouts with nvidia-mig-parted")
    gpus = s.get("gpus")
    targets = [str(g) for g in gpus] if gpus else [None]
    for gpu in targets:
        u.must("nvidia-smi", *(["-i", gpu] if gpu is not None else []), "-mig", "1")
    u.must(
        "nvidia-mig-parted",
        "apply",
        "-f",
        u.real("/etc/nvidia-mig-manager/config.yaml"),
        "-c",
        str(s["layout"]),
    )
    u.stamp("mig-layout", s)
    return True, None


async def _gpu_sharing(u: _Unit, s: Mapping[str, Any]) -> tuple[bool, str | None]:
    strategy = str(s["strategy"])
    replicas = int(s["replicas"])
    key = "timeSlicing" if strategy == "time-slicing" else "mps"
    doc = {
        "version": "v1",
        "sharing": {key: {"resources": [{"name": "nvidia.com/gpu", "replicas": replicas}]}},
    }
    changed = u.write("/etc/nvidia-device-plugin/sharing.yaml", json.dumps(doc, indent=2) + "\n")
    if changed and strategy == "mps":
        u.must("nvidia-smi", "-c", "EXCLUSIVE_PROCESS")
    return changed, None


_Apply = Callable[[_Unit, Mapping[str, Any]], Awaitable[tuple[bool, str | None]]]

_UNITS: Final[Mapping[str, tuple[_Apply, bool]]] = {
    # name: (apply, needs an NVIDIA GPU)
    "sysctl": (_sysctl, False),
    "kernel-modules": (_kernel_modules, False),
    "hugepages": (_hugepages, False),
    "container-toolkit": (_container_toolkit, True),
    "k8s-join": (_k8s_join, False),
    "nvidia-driver": (_nvidia_driver, True),
    "fabric-manager": (_fabric_manager, True),
    "mig-layout": (_mig_layout, True),
    "gpu-sharing": (_gpu_sharing, True),
}
SUPPORTED_UNITS: Final = frozenset(_UNITS)


class Converger:
    """Applies host sections on one machine.

    Args:
        machine: the root and runner.
        fetch_secret: reads a ``SecretRef`` through the secrets gate (``k8s-join``'s token).
    """

    def __init__(self, machine: Machine, *, fetch_secret: SecretFetcher | None = None) -> None:
        self.machine = machine
        self.fetch_secret = fetch_secret

    def observed_generation(self) -> int:
        """The generation of the last host section that applied whole (0 before any)."""
        try:
            doc = json.loads(self.machine.path(f"{_STATE}/converge.json").read_text())
            return int(doc.get("observedGeneration", 0))
        except (OSError, ValueError, TypeError):
            return 0

    async def converge(self, *, generation: int, units: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Apply ``units`` in order and report each.

        Raises:
            BcError: ``INVALID_STATE`` (reason ``host-section-failed``) once every known unit
                had its turn, when a unit failed or is not supported; the message names each.
        """
        reports: list[dict[str, Any]] = []
        problems: list[str] = []
        gpu = None
        for index, entry in enumerate(units):
            name = str(entry.get("name", ""))
            settings = entry.get("settings") or {}
            known = _UNITS.get(name)
            if known is None:
                problems.append(f"unit {name} is not supported by this daemon")
                reports.append({"name": name, "status": "unsupported", "detail": problems[-1]})
                continue
            apply, needs_gpu = known
            try:
                # bcd applies what its own units understand: their settings, defaults filled
                settings = BUILTIN_CONFIG_UNITS[name].settings.validate(
                    settings, path=f"units[{index}].settings"
                )
            except BcError as err:
                problems.append(f"unit {name} failed: {err.message} (at {err.path})")
                reports.append({"name": name, "status": "failed", "detail": problems[-1], "path": err.path})
                continue
            if needs_gpu:
                gpu = self._gpu() if gpu is None else gpu
                if not gpu:
                    reports.append(
                        {"name": name, "status": "skipped", "detail": "no NVIDIA GPU on this machine"}
                    )
                    continue
            unit = _Unit(self.machine, self.fetch_secret, [])
            try:
                changed, detail = await apply(unit, settings)
            except UnitFailed as exc:
                problems.append(f"unit {name} failed: {exc}")
                reports.append({"name": name, "status": "failed", "detail": str(exc), "index": index})
                continue
            report: dict[str, Any] = {"name": name, "status": "changed" if changed else "unchanged"}
            if detail:
                report["detail"] = detail
            if unit.ran:
                report["ran"] = unit.ran
            reports.append(report)
        observed = generation if not problems else self.observed_generation()
        doc = {"generation": generation, "observedGeneration": observed, "units": reports}
        _Unit(self.machine, None, []).write(
            f"{_STATE}/converge.json", json.dumps(doc, indent=2) + "\n", 0o600
        )
        log().info("host_converged", generation=generation, observed_generation=observed,
                 units={r["name"]: r["status"] for r in reports})  # fmt: skip
        if problems:
            summary = ", ".join(f"{r['name']} {r['status']}" for r in reports)
            raise BcError(
                ErrorCode.INVALID_STATE,
                f"{'; '.join(problems)} (units: {summary})",
                {"reason": "host-section-failed", "generation": generation, "observedGeneration": observed},
            )
        return doc

    def _gpu(self) -> bool:
        return _Unit(self.machine, None, []).has_nvidia_gpu()
