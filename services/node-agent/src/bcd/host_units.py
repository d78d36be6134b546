"""The converger's host units: ``sysctl``, ``kernel-modules``, ``hugepages``, ``k8s-join``.

Each writes its files idempotently under the machine's root and runs its commands (``sysctl -p``,
``modprobe``, ``systemctl``, ``kubeadm``) only when something changed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from better_compute.core.errors import BcError
from better_compute.logging import register_secret

from .unit import Apply, Unit, UnitFailed, line_safe

__all__ = ["HOST_UNITS"]

_SYSCTL_KEY: Final = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_./-]{0,255}$")
_HUGEPAGE_KB: Final = {"2M": 2048, "1G": 1048576}


async def _sysctl(u: Unit, s: Mapping[str, Any]) -> tuple[bool, str | None]:
    values: Mapping[str, str] = s.get("values", {})
    for key, value in values.items():
        if not _SYSCTL_KEY.match(key):
            raise UnitFailed(f"{key!r} is not a kernel parameter name")
        line_safe(str(value), key)
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


async def _kernel_modules(u: Unit, s: Mapping[str, Any]) -> tuple[bool, str | None]:
    load: list[str] = list(s.get("load", []))
    blacklist: list[str] = list(s.get("blacklist", []))
    options: Mapping[str, str] = s.get("options", {})
    for module, opts in options.items():
        line_safe(opts, f"options.{module}")
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


async def _hugepages(u: Unit, s: Mapping[str, Any]) -> tuple[bool, str | None]:
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


async def _k8s_join(u: Unit, s: Mapping[str, Any]) -> tuple[bool, str | None]:
    labels: Mapping[str, str] = s.get("labels", {})
    taints: list[str] = list(s.get("taints", []))
    args = []
    if labels:
        args.append("--node-labels=" + ",".join(f"{k}={line_safe(v, k)}" for k, v in sorted(labels.items())))
    if taints:
        args.append("--register-with-taints=" + ",".join(line_safe(t, "taints") for t in taints))
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


HOST_UNITS: Final[Mapping[str, Apply]] = {
    "sysctl": _sysctl,
    "kernel-modules": _kernel_modules,
    "hugepages": _hugepages,
    "k8s-join": _k8s_join,
}
