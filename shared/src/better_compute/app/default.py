"""The default app: metal and provision, nothing else.

Services load it as ``better_compute.app.default:app`` (``DEFAULT_APP`` in the settings).
"""

from __future__ import annotations

from better_compute.metal.module import metal
from better_compute.provision.module import provision_module

from .composition import App, better_compute

__all__ = ["app", "default_app"]


def default_app() -> App:
    """Metal, plus a provision module that borrows metal's steps and profiles."""
    return better_compute(modules=[metal(), provision_module(modules=[metal()])])


app = default_app()
