"""Config units: the named pieces of a node's host section, and the built-in ones.

A profile's ``hostConfig`` lists units by name with settings; when its workflow succeeds they
become the node's host section (``resolve_host_section``), which bcd's host converger applies. A
unit definition here is data for the control plane only: bcd applies the units it was built
with. The built-ins' settings are what bcd's converger (``bcd/converger.py``) applies, and they
refuse what it would refuse (a sysctl key or a value with a line break), so a bad setting is
``INVALID_INPUT`` when the section resolves, not a failed unit on the machine later.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

from better_compute.core._json import freeze_json, thaw_json
from better_compute.core.errors import BcError, ErrorCode, join_path
from better_compute.core.manifest import Manifest, field, manifest
from better_compute.core.plugins import as_tuple

from ._names import UNIT_NAME_PATTERN, matches
from .labels import parse_label_expression
from .profiles import HostConfig, HostUnit

__all__ = [
    "BUILTIN_CONFIG_UNITS",
    "ConfigUnit",
    "merge_config_units",
    "resolve_host_config",
    "resolve_host_section",
]


def _bad(path: str, message: str) -> BcError:
    return BcError(ErrorCode.INVALID_CONFIG, message, {"path": path})


@dataclass(frozen=True, kw_only=True, eq=False)
class ConfigUnit:
    """A unit of host configuration.

    Args:
        name: kebab-case name (``acme-nic-firmware``); a unit named like a built-in replaces it.
        description: one line for people.
        settings: manifest the unit's settings in a profile must fit.
        when: default label expression turning the unit on per node; a profile's unit entry
            may give its own.

    Raises:
        BcError: ``INVALID_CONFIG`` at the bad argument.
    """

    name: str
    description: str
    settings: Manifest
    when: str | None = None

    def __post_init__(self) -> None:
        if not matches(UNIT_NAME_PATTERN, self.name):
            raise _bad("name", f"unit names are kebab-case like sysctl, got {self.name!r}")
        if not isinstance(self.description, str):
            raise _bad("description", "description must be a string")
        if not isinstance(self.settings, Manifest):
            raise _bad("settings", "settings must be a manifest")
        if self.when is not None:
            parse_label_expression(self.when, path="when", code=ErrorCode.INVALID_CONFIG)


_MODULE_NAME = field.string(pattern=r"^[A-Za-z0-9_-]{1,64}$")
# One line of a file bcd writes (sysctl.d, modprobe.d, kubelet arguments): no line break, no NUL.
_LINE = field.string(pattern=r"^[^\n\r\x00]*$", max_length=1024)
_SYSCTL_KEY = field.string(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_./-]{0,255}$")
# Kubernetes: an optional DNS prefix and a name; a value; a taint key[=value]:Effect.
_K8S_LABEL_KEY = field.string(
    pattern=r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_K8S_LABEL_VALUE = field.string(pattern=r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_K8S_TAINT = field.string(
    pattern=r"^([a-z0-9.-]{1,253}/)?[A-Za-z0-9][-A-Za-z0-9_.]{0,62}(=[-A-Za-z0-9_.]{0,63})?"
    r":(NoSchedule|PreferNoSchedule|NoExecute)$"
)

_BUILTINS: Final = (
    ConfigUnit(
        name="kernel-modules",
        description="Loads and blacklists kernel modules, with module options",
        settings=manifest(
            {
                "load": field.list(_MODULE_NAME).default([]),
                "blacklist": field.list(_MODULE_NAME).default([]),
                "options": field.map(_LINE, keys=_MODULE_NAME).default({}),
            }
        ),
    ),
    ConfigUnit(
        name="sysctl",
        description="Sets kernel parameters",
        settings=manifest({"values": field.map(_LINE, keys=_SYSCTL_KEY)}),
    ),
    ConfigUnit(
        name="hugepages",
        description="Reserves huge pages at boot",
        settings=manifest(
            {
                "size": field.enum(["2M", "1G"]).default("2M"),
                "count": field.int(min=0, max=1_048_576),
            }
        ),
    ),
    ConfigUnit(
        name="nvidia-driver",
        description="Installs the NVIDIA driver",
        settings=manifest(
            {
                "version": field.string(pattern=r"^[0-9]+(\.[0-9]+)*$"),
                "kernelModule": field.enum(["open", "proprietary"]).default("open"),
            }
        ),
    ),
    ConfigUnit(
        name="fabric-manager",
        description="Runs NVIDIA Fabric Manager for NVSwitch systems",
        settings=manifest({"enabled": field.bool().default(True)}),
    ),
    ConfigUnit(
        name="mig-layout",
        description="Partitions GPUs with MIG",
        settings=manifest(
            {
                "layout": field.string(pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$"),
                "gpus": field.list(field.int(min=0)).optional(),
            }
        ),
    ),
    ConfigUnit(
        name="gpu-sharing",
        description="Shares each GPU among workloads",
        settings=manifest(
            {
                "strategy": field.enum(["time-slicing", "mps"]),
                "replicas": field.int(min=2, max=64),
            }
        ),
    ),
    ConfigUnit(
        name="container-toolkit",
        description="Installs the NVIDIA container toolkit for a container runtime",
        settings=manifest(
            {
                "runtime": field.enum(["containerd", "docker", "cri-o"]).default("containerd"),
                "setAsDefault": field.bool().default(True),
            }
        ),
    ),
    ConfigUnit(
        name="k8s-join",
        description="Joins the node to a Kubernetes cluster",
        settings=manifest(
            {
                "apiServer": field.string(pattern=r"^https://\S+$"),
                "tokenRef": field.secret_ref(),
                "caCertHash": field.string(pattern=r"^sha256:[0-9a-f]{64}$"),
                "role": field.enum(["worker", "control-plane"]).default("worker"),
                "labels": field.map(_K8S_LABEL_VALUE, keys=_K8S_LABEL_KEY).default({}),
                "taints": field.list(_K8S_TAINT).default([]),
            }
        ),
    ),
)

BUILTIN_CONFIG_UNITS: Final[Mapping[str, ConfigUnit]] = MappingProxyType(
    {unit.name: unit for unit in _BUILTINS}
)


def merge_config_units(
    units: Sequence[ConfigUnit], *, path: str = "config_units"
) -> Mapping[str, ConfigUnit]:
    """The built-in units with ``units`` added; a unit named like a built-in replaces it.

    Raises:
        BcError: ``INVALID_CONFIG`` at ``config_units[i]`` for a non-unit or a name given twice.
    """
    merged = dict(BUILTIN_CONFIG_UNITS)
    added: set[str] = set()
    for index, unit in enumerate(as_tuple(units, path)):
        item_path = f"{path}[{index}]"
        if not isinstance(unit, ConfigUnit):
            raise _bad(item_path, "expected a ConfigUnit")
        if unit.name in added:
            raise _bad(join_path(item_path, "name"), f"unit {unit.name!r} is given twice")
        added.add(unit.name)
        merged[unit.name] = unit
    return MappingProxyType(merged)


def resolve_host_config(
    host_config: HostConfig | None, *, units: Mapping[str, ConfigUnit]
) -> tuple[HostUnit, ...]:
    """A profile's units with their settings checked and defaults filled.

    Args:
        host_config: the profile's ``hostConfig`` (``None`` resolves to no units).
        units: known units, usually ``ProvisionModule.config_units``.

    Raises:
        BcError: ``INVALID_INPUT`` at ``hostConfig.units[i].name`` for an unknown unit, or at
            the bad setting (``hostConfig.units[0].settings.count``).
    """
    if host_config is None:
        return ()
    resolved: list[HostUnit] = []
    for index, entry in enumerate(host_config.units):
        path = f"hostConfig.units[{index}]"
        unit = units.get(entry.name)
        if unit is None:
            raise BcError(
                ErrorCode.INVALID_INPUT,
                f"unknown config unit {entry.name!r}",
                {"path": join_path(path, "name")},
            )
        settings_path = join_path(path, "settings")
        settings: dict[str, Any] = unit.settings.validate(thaw_json(entry.settings), path=settings_path)
        resolved.append(
            HostUnit(
                name=entry.name,
                settings=freeze_json(settings, path=settings_path, code=ErrorCode.INVALID_INPUT),
                when=entry.when if entry.when is not None else unit.when,
            )
        )
    return tuple(resolved)


def resolve_host_section(
    host_config: HostConfig | Sequence[HostUnit] | None,
    labels: Mapping[str, str],
    *,
    units: Mapping[str, ConfigUnit] = BUILTIN_CONFIG_UNITS,
) -> list[dict[str, Any]]:
    """The host section of one node: the units whose ``when:`` holds for its ``labels``.

    Every unit is checked, whatever the labels (a profile is refused the same for every node);
    then each ``when:`` (the entry's, else the unit's default) is evaluated against ``labels``.

    Args:
        host_config: the profile's ``hostConfig`` (or its units); ``None`` is an empty section.
        labels: the node's labels.
        units: known units, usually ``ProvisionModule.config_units`` (built-ins with yours).

    Returns:
        ``[{name, settings}]`` in the profile's order, settings with defaults filled: what bcd's
        converger takes.

    Raises:
        BcError: ``INVALID_INPUT`` at ``hostConfig.units[i].name`` for an unknown unit, at the
            bad setting, at ``….when`` for a malformed expression, and at ``….name`` for a unit
            that two entries turn on for this node.
    """
    if host_config is None:
        return []
    config = host_config if isinstance(host_config, HostConfig) else HostConfig(units=tuple(host_config))
    resolved = resolve_host_config(config, units=units)
    section: list[dict[str, Any]] = []
    chosen: set[str] = set()
    for index, unit in enumerate(resolved):
        path = f"hostConfig.units[{index}]"
        if unit.when is not None:
            expression = parse_label_expression(unit.when, path=join_path(path, "when"))
            if not expression.matches(labels):
                continue
        if unit.name in chosen:
            raise BcError(
                ErrorCode.INVALID_INPUT,
                f"unit {unit.name} is turned on twice for this node: make their when: exclusive",
                {"path": join_path(path, "name")},
            )
        chosen.add(unit.name)
        section.append({"name": unit.name, "settings": thaw_json(unit.settings)})
    return section
