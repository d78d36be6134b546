"""Core of the SDK: errors, ids, the manifest DSL, and the definitions of plugins and command kinds.

Core imports nothing else of ``better_compute``. Composing a deployment (``better_compute()``,
``App``, ``load_app``) builds on ``provision`` and ``metal``, so it lives above them in
``better_compute.app``.
"""

from .errors import BcError, ErrorCode, join_path
from .ids import new_id, parse_id
from .manifest import Field, Manifest, field, manifest, parse_duration
from .names import Name, parse_name
from .plugins import CommandKind, ComputeModule, DriverOperation, Plugin, Registry, define_plugin

# better_compute is a namespace shared by several distributions (the SDK, the runtime, bcx, the test
# kit), so the version the services and bcx report lives here, in the SDK every one of them needs.
__version__ = "0.1.0"

__all__ = [
    "BcError",
    "CommandKind",
    "ComputeModule",
    "DriverOperation",
    "ErrorCode",
    "Field",
    "Manifest",
    "Name",
    "Plugin",
    "Registry",
    "define_plugin",
    "field",
    "join_path",
    "manifest",
    "new_id",
    "parse_duration",
    "parse_id",
    "parse_name",
]
