"""Core of the SDK: errors, ids, the manifest DSL, plugins and app composition."""

from .app import PLUGIN_ENTRY_POINT_GROUP, App, better_compute, discover_plugins, load_app
from .errors import BcError, ErrorCode, join_path
from .ids import new_id, parse_id
from .manifest import Field, Manifest, field, manifest, parse_duration
from .plugins import CommandKind, ComputeModule, Plugin, Registry, define_plugin

__all__ = [
    "PLUGIN_ENTRY_POINT_GROUP",
    "App",
    "BcError",
    "CommandKind",
    "ComputeModule",
    "ErrorCode",
    "Field",
    "Manifest",
    "Plugin",
    "Registry",
    "better_compute",
    "define_plugin",
    "discover_plugins",
    "field",
    "join_path",
    "load_app",
    "manifest",
    "new_id",
    "parse_duration",
    "parse_id",
]
