"""Bare metal: the ``metal()`` module and the command kinds its agents implement.

The default app, metal plus provision, is ``better_compute.app.default:app``: composing a
deployment is the layer above metal.
"""

from .commands import COMMAND_KINDS
from .module import MetalModule, metal
from .steps import Ramdisk, http_via_site

__all__ = ["COMMAND_KINDS", "MetalModule", "Ramdisk", "http_via_site", "metal"]
