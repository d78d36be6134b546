"""Bare metal: the ``metal()`` module and the command kinds its agents implement.

The default app is ``better_compute.metal.app:app`` (imported on demand, not from here).
"""

from .commands import COMMAND_KINDS
from .module import MetalModule, metal

__all__ = ["COMMAND_KINDS", "MetalModule", "metal"]
