"""``metal()``: the bare-metal compute module."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from better_compute.core.plugins import CommandKind, DriverOperation

from .commands import COMMAND_KINDS, DRIVER_OPERATIONS
from .steps import METAL_STEPS, Ramdisk, lifecycle_profiles

if TYPE_CHECKING:
    from better_compute.provision.profiles import Profile
    from better_compute.provision.steps import Step

__all__ = ["METAL_MODULE_ID", "MetalModule", "metal"]

METAL_MODULE_ID = "metal"


@dataclass(frozen=True, kw_only=True, eq=False)
class MetalModule:
    """The metal module. Made by ``metal()``."""

    id: str = field(default=METAL_MODULE_ID, init=False)
    command_kinds: tuple[CommandKind, ...]
    steps: tuple[Step, ...]
    profiles: tuple[Profile, ...]
    driver_operations: tuple[DriverOperation, ...] = ()


def metal(*, ramdisk: Ramdisk | None = None) -> MetalModule:
    """The metal module: its command kinds, the site agent's driver operations, its shipped
    steps (``better_compute.metal.steps``) and lifecycle profiles (``metal.inspect`` …).

    Every call shares the same kind and step objects, and calls with the same ``ramdisk`` the
    same profile objects, so ``metal()`` may be registered in ``better_compute(modules=…)``
    and borrowed by ``provision_module(modules=[metal()])``.

    Args:
        ramdisk: the bcd ramdisk the lifecycle profiles network-boot nodes into; without it
            their ``metal.ensureRamdisk`` step fails ``INVALID_CONFIG``.
    """
    return MetalModule(
        command_kinds=tuple(COMMAND_KINDS.values()),
        steps=METAL_STEPS,
        profiles=lifecycle_profiles(ramdisk),
        driver_operations=tuple(DRIVER_OPERATIONS.values()),
    )
