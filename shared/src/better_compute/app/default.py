"""The default app: metal and provision, and every installed plugin.

Services load it as ``better_compute.app.default:app`` (``DEFAULT_APP`` in the settings). Plugins
installed under the entry-point group ``better_compute.plugins`` (``pip install acme-plugin``) are
registered and lent to provision, so their steps, profiles, config units and image signers are
there after a restart (docs/plugins.md). A plugin that fails to load is ``INVALID_CONFIG`` at
``entry_points.<name>``, and the service does not start.
"""

from __future__ import annotations

from better_compute.metal.module import metal
from better_compute.provision.module import provision_module

from .composition import App, better_compute

__all__ = ["app", "default_app"]


def default_app() -> App:
    """Metal, a provision module that borrows metal's steps and profiles, and the installed plugins."""
    return better_compute(modules=[metal(), provision_module(modules=[metal()])], discover=True)


app = default_app()
