"""``metal()``: the bare-metal compute module."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from better_compute.core.plugins import CommandKind, DriverOperation

from .commands import COMMAND_KINDS, DRIVER_OPERATIONS

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


def metal() -> MetalModule:
    """The metal module: its command kinds, the site agent's driver operations (and, in a later
    release, its lifecycle steps and profiles).

    Every call shares the same kind objects, so ``metal()`` may be registered in
    ``better_compute(modules=…)`` and borrowed by ``provision_module(modules=[metal()])``.
    """
    return MetalModule(
        command_kinds=tuple(COMMAND_KINDS.values()),
        steps=(),
        profiles=(),
        driver_operations=tuple(DRIVER_OPERATIONS.values()),
    )
