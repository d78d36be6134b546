"""Start-up cost: two optional extras that nats-py and structlog import eagerly when present.

Every service process, and every ``bcx`` call, imports nats-py and structlog. Both import an
optional library at import time when it happens to be installed: nats-py imports ``aiohttp``
(for its WebSocket transport, which we do not use by default) and structlog imports ``rich``
(for coloured tracebacks, which our logging turns off). In one environment holding every
package (the site agent installs aiohttp, import-linter installs rich) that was about 0.6 s of
CPU per process start.

``defer_optional_imports()`` imports nats-py and structlog with those two hidden, then gives
nats-py a stand-in that imports aiohttp on first use, so a ``ws://`` server URL still works.
Code that imports aiohttp or rich itself (the site agent's HTTP server, a live CLI view) gets
the real module as usual.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

__all__ = ["defer_optional_imports"]

_HIDDEN = ("aiohttp", "rich")


class _ImportOnUse:
    """Stands for a module nats-py imported optionally; imports it on the first attribute read."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self._name), attr)

    def __bool__(self) -> bool:
        return True


def defer_optional_imports() -> None:
    if "nats" in sys.modules and "structlog" in sys.modules:
        return
    hidden = [name for name in _HIDDEN if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # the import system's "not installed"
    try:
        import nats.aio.transport
        import structlog  # noqa: F401
    finally:
        for name in hidden:
            if sys.modules.get(name, ...) is None:
                del sys.modules[name]
    transport: Any = nats.aio.transport
    if transport.aiohttp is None and importlib.util.find_spec("aiohttp") is not None:
        transport.aiohttp = _ImportOnUse("aiohttp")
