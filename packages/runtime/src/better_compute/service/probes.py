"""The health port: ``/healthz`` for probes and ``/metrics`` for Prometheus, over HTTP.

Served by prometheus_client's own server (its ``ThreadingWSGIServer`` and ``make_wsgi_app``, the
server ``start_http_server`` runs): already loaded with the metrics, so it costs a thread and no
import (aiohttp's server would load aiohttp into every service, about 60 ms of CPU and 2 MB).
Each request runs on a thread of its own; what it needs from the service (the health checks,
the gauges read from the store before a scrape) runs on the service's event loop, which owns the
connections, and the thread waits for it.

``/metrics`` answers as prometheus_client does (``Accept`` for OpenMetrics, ``gzip``,
``name[]=`` to pick metrics); any other path is the health document, 200 when every check is ok,
503 otherwise. The port listens on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import REGISTRY, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from ..wire.codec import encode

__all__ = ["ProbeServer"]

_ANSWER_WITHIN_S = 10.0
"""A probe waits this long for the loop at most (a collect is cut at 5 s by the service)."""

_POLL_S = 0.25
"""How often the server's loop looks for a stop: the most a service's stop waits for it."""


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes and probes every few seconds are not news (the service logs what fails)."""


class ProbeServer:
    """``/healthz`` and ``/metrics`` on ``127.0.0.1:port``, until ``close``."""

    def __init__(
        self,
        *,
        port: int,
        loop: asyncio.AbstractEventLoop,
        health: Callable[[], Awaitable[dict[str, Any]]],
        collect: Callable[[], Awaitable[None]],
    ) -> None:
        self._loop = loop
        self._health = health
        self._collect = collect
        self._metrics = make_wsgi_app(REGISTRY)
        self._httpd = make_server("127.0.0.1", port, self._app, ThreadingWSGIServer, handler_class=_Quiet)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": _POLL_S}, name="probes", daemon=True
        )
        self._thread.start()

    def _on_loop(self, make: Callable[[], Awaitable[Any]]) -> Any:
        async def run() -> Any:
            return await make()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=_ANSWER_WITHIN_S)

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == "/metrics":
            # the loop away (stopping) or slow: the counters are served, the gauges as last read
            with contextlib.suppress(Exception):
                self._on_loop(self._collect)
            return self._metrics(environ, start_response)  # type: ignore[no-any-return]
        try:
            body = self._on_loop(self._health)
        except Exception as exc:  # the loop did not answer in time: not healthy
            body = {"ok": False, "error": type(exc).__name__}
        data = encode(body)
        status = "200 OK" if body["ok"] else "503 Service Unavailable"
        start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
        return [data]

    async def close(self) -> None:
        """Stop listening (within ``_POLL_S``); a request in flight is left to finish."""
        with contextlib.suppress(OSError):
            await asyncio.to_thread(self._httpd.shutdown)
            self._httpd.server_close()
