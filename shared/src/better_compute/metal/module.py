"""``metal()``: the bare-metal compute module."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from better_compute.config import RamdiskSettings, load_settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.plugins import CommandKind, DriverOperation

from .commands import COMMAND_KINDS, DRIVER_OPERATIONS
from .lifecycle import DEFAULT_PROFILES
from .steps import METAL_STEPS, Ramdisk, lifecycle_profiles

if TYPE_CHECKING:
    from better_compute.provision.profiles import Profile
    from better_compute.provision.steps import Step

__all__ = ["METAL_MODULE_ID", "MetalModule", "configured_ramdisk", "metal"]

METAL_MODULE_ID = "metal"


@dataclass(frozen=True, kw_only=True, eq=False)
class MetalModule:
    """The metal module. Made by ``metal()``."""

    id: str = field(default=METAL_MODULE_ID, init=False)
    command_kinds: tuple[CommandKind, ...]
    steps: tuple[Step, ...]
    profiles: tuple[Profile, ...]
    driver_operations: tuple[DriverOperation, ...] = ()
    verb_profiles: Mapping[str, str] = field(default_factory=lambda: DEFAULT_PROFILES)
    """The profile id each lifecycle verb starts (``metal.deploy`` …, or an operator's own)."""


def metal(*, ramdisk: Ramdisk | None = None, profiles: Mapping[str, str] | None = None) -> MetalModule:
    """The metal module: its command kinds, the site agent's driver operations, its shipped
    steps (``better_compute.metal.steps``) and lifecycle profiles (``metal.inspect`` …).

    Every call shares the same kind and step objects, and calls with the same ``ramdisk`` the
    same profile objects, so ``metal()`` may be registered in ``better_compute(modules=…)``
    and borrowed by ``provision_module(modules=[metal()])``.

    Args:
        ramdisk: the bcd ramdisk the lifecycle profiles network-boot nodes into; by default the
            one ``[ramdisk]`` of bc.toml (``BC_RAMDISK_*``) names (``configured_ramdisk()``);
            without either their ``metal.ensureRamdisk`` step fails ``INVALID_CONFIG``.
        profiles: the profile a lifecycle verb starts instead of the shipped one, e.g.
            ``{"deploy": "acme.deploy"}`` (verbs: inspect, commission, deploy, release,
            retire, adopt).

    Raises:
        BcError: ``INVALID_CONFIG`` at ``profiles.<verb>`` for an unknown verb.
    """
    verb_profiles = dict(DEFAULT_PROFILES)
    for verb, profile_id in (profiles or {}).items():
        if verb not in DEFAULT_PROFILES:
            raise BcError(
                ErrorCode.INVALID_CONFIG,
                f"unknown lifecycle verb {verb}; one of {', '.join(DEFAULT_PROFILES)}",
                {"path": f"profiles.{verb}"},
            )
        if not isinstance(profile_id, str) or not profile_id:
            raise BcError(ErrorCode.INVALID_CONFIG, "a profile id", {"path": f"profiles.{verb}"})
        verb_profiles[verb] = profile_id
    return MetalModule(
        command_kinds=tuple(COMMAND_KINDS.values()),
        steps=METAL_STEPS,
        profiles=lifecycle_profiles(ramdisk if ramdisk is not None else configured_ramdisk()),
        driver_operations=tuple(DRIVER_OPERATIONS.values()),
        verb_profiles=MappingProxyType(verb_profiles),
    )


def configured_ramdisk(settings: RamdiskSettings | None = None) -> Ramdisk | None:
    """The ramdisk ``[ramdisk]`` names (``settings``, else this process's bc.toml and
    ``BC_RAMDISK_*``): a ``Ramdisk`` when it sets ``kernel`` or ``script``, else None.

    Raises:
        BcError: ``INVALID_CONFIG`` at ``ramdisk.<key>`` for a bad value (as every setting).
    """
    given = settings if settings is not None else load_settings().ramdisk
    if not given.kernel and not given.script:
        return None
    return Ramdisk(
        kernel=given.kernel,
        initrd=given.initrd,
        kernel_sha256=given.kernel_sha256,
        initrd_sha256=given.initrd_sha256,
        cmdline=given.cmdline or "",
        script=given.script,
    )
