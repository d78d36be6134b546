"""Start-up cost: two optional extras that nats-py and structlog import eagerly when present.

nats-py imports ``aiohttp`` at import time when it happens to be installed (for its WebSocket
transport, which we do not use by default), and structlog imports ``rich`` (for coloured
tracebacks, which our logging turns off). In one environment holding every package (the site
agent installs aiohttp, import-linter installs rich) that was about 0.6 s of CPU per process start.

Nothing here runs on import: importing the SDK (``better_compute.core``, ``wire``, ``provision``,
``metal``, ``app``) loads neither nats-py nor structlog. The code that needs them imports them
through :func:`import_quietly` when it first runs (``service.client.connect``, the logging set-up),
and each service process calls :func:`defer_optional_imports` in its package's ``__init__``, before
its modules import nats-py at their top.

While the import runs, the two extras are hidden (a ``None`` in ``sys.modules`` is the import
system's "not installed"); they are put back right after. nats-py then gets a stand-in that
imports aiohttp on first use, so a ``ws://`` server URL still works. Code that imports aiohttp or
rich itself (the site agent's HTTP server, a live CLI view) gets the real module as usual.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

__all__ = ["defer_optional_imports", "import_quietly", "lazy_attributes"]

_HIDDEN = ("aiohttp", "rich")


class _ImportOnUse:
    """Stands for a module nats-py imported optionally; imports it on the first attribute read."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self._name), attr)

    def __bool__(self) -> bool:
        return True


def import_quietly(name: str) -> ModuleType:
    """``importlib.import_module(name)`` without loading aiohttp or rich along (unless some code
    imported them already). Cheap once the module is loaded."""
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded
    hidden = [extra for extra in _HIDDEN if extra not in sys.modules]
    for extra in hidden:
        sys.modules[extra] = None  # type: ignore[assignment]  # the import system's "not installed"
    try:
        module = importlib.import_module(name)
    finally:
        for extra in hidden:
            if sys.modules.get(extra, ...) is None:
                del sys.modules[extra]
    transport: Any = sys.modules.get("nats.aio.transport")
    if (
        transport is not None
        and transport.aiohttp is None
        and importlib.util.find_spec("aiohttp") is not None
    ):
        transport.aiohttp = _ImportOnUse("aiohttp")
    return module


def defer_optional_imports() -> None:
    """Import nats-py and structlog without their optional extras: for a process about to import
    them at the top of its modules (each service's package calls this)."""
    import_quietly("nats")
    import_quietly("structlog")


def lazy_attributes(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A package's module ``__getattr__`` (PEP 562) that loads each name's module on first use:
    ``homes`` maps a name to its submodule (``{"EngineClient": "engine"}``)."""

    def attribute(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{home}"), name)

    return attribute
