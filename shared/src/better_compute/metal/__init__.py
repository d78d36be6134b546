"""Bare metal: the ``metal()`` module and the command kinds its agents implement.

The default app, metal plus provision, is ``better_compute.app.default:app``: composing a
deployment is the layer above metal.
"""

from .commands import COMMAND_KINDS
from .module import MetalModule, metal

__all__ = ["COMMAND_KINDS", "MetalModule", "metal"]
