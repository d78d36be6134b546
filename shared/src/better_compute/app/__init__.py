"""The top layer: a deployment's composition, ``better_compute(modules=…, plugins=…)``.

Services load it with ``--app package.module:attr`` (``load_app``); the default one,
``better_compute.app.default:app``, is metal plus provision (imported on demand, not from here).
"""

from .composition import PLUGIN_ENTRY_POINT_GROUP, App, better_compute, discover_plugins, load_app

__all__ = ["PLUGIN_ENTRY_POINT_GROUP", "App", "better_compute", "discover_plugins", "load_app"]
