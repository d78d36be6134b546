"""The skeleton every service process is built on.

``async with MyService(settings) as svc: await svc.run()`` connects NATS and
PostgreSQL, applies the service's migrations, serves its routes as a NATS micro
service (so ``$SRV.PING/INFO/STATS`` answer), runs its side loops in a TaskGroup and
stops gracefully: in-flight requests get a grace period, then are cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, ClassVar, TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import EndpointConfig
from nats.micro.service import Service as MicroService

from .. import __version__
from ..config import Settings
from ..core.errors import BcError, ErrorCode
from ..logging import get_logger
from ..runtime.urls import resolve_database_url, resolve_nats_url
from ..wire import Subjects, encode_error, encode_ok
from ..wire.codec import decode, encode
from ..wire.paging import PAGE_BUDGET
from .client import ApiClient, connect
from .db import Database, load_migrations

__all__ = ["ApiRequest", "Handler", "Service"]

T = TypeVar("T")


class ApiRequest:
    """One request to a route: its raw bytes, headers and a typed decoder."""

    def __init__(
        self, subject: str, data: bytes, headers: Mapping[str, str] | None, *, max_reply: int | None = None
    ) -> None:
        self.subject = subject
        self.data = data
        self.headers = dict(headers or {})
        self.max_reply = max_reply
        """The largest reply the bus carries (the connection's max_payload), when known."""

    @property
    def page_budget(self) -> int:
        """Bytes of items one page of a list may hold: ``PAGE_BUDGET``, or half the
        largest reply when the bus carries less, so the page and its envelope fit."""
        if self.max_reply is None:
            return PAGE_BUDGET
        return max(1, min(PAGE_BUDGET, self.max_reply // 2))

    def decode(self, typ: type[T]) -> T:
        """The payload as ``typ``; ``INVALID_INPUT`` with ``details.path`` when it does not fit."""
        return decode(self.data, typ)


Handler = Callable[[ApiRequest], Awaitable[Any]]
SideLoop = Callable[[], Coroutine[Any, Any, None]]


class Service:
    """Base of bc-engine, bc-command-queue, bc-pki and bc-secrets."""

    name: ClassVar[str] = "bc-service"
    api_name: ClassVar[str] = "service"
    schema: ClassVar[str | None] = None
    migrations_package: ClassVar[str | None] = None
    description: ClassVar[str] = ""
    stop_grace: ClassVar[float] = 3.0

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.subjects = Subjects(root=settings.subject_root)
        self.instance = settings.instance or f"{socket.gethostname()}-{os.getpid()}"
        self.log = get_logger(service=self.name, instance=self.instance)
        self.nc: Nats | None = None
        self.db: Database | None = None
        self.micro: MicroService | None = None
        self.api: ApiClient | None = None
        self.started_at = time.time()
        self._stop_event = asyncio.Event()
        self._inflight: set[asyncio.Task[None]] = set()
        self._stopped = False
        self._health_server: asyncio.Server | None = None

    # -- hooks for subclasses -------------------------------------------------

    def routes(self) -> Mapping[str, Handler]:
        """``resource.verb`` → handler. ``health.get`` is always there."""
        return {}

    def side_loops(self) -> Mapping[str, SideLoop]:
        """Named background loops; the first one to fail stops the service."""
        return {}

    def _all_side_loops(self) -> Mapping[str, SideLoop]:
        loops = dict(self.side_loops())
        if self.db is not None:
            loops["instance_heartbeat"] = self._instance_heartbeat
        return loops

    async def _instance_heartbeat(self) -> None:
        # Each instance records itself in its own schema, so `bcx status` can also tell
        # an instance that stopped answering from one that never ran.
        assert self.db is not None
        while True:
            await self.db.execute(
                "INSERT INTO instances (instance, host, pid, version, started_at, last_seen)"
                " VALUES ($1, $2, $3, $4, to_timestamp($5), now())"
                " ON CONFLICT (instance) DO UPDATE SET last_seen = now(),"
                " started_at = EXCLUDED.started_at, version = EXCLUDED.version",
                self.instance,
                socket.gethostname(),
                os.getpid(),
                __version__,
                self.started_at,
            )
            await asyncio.sleep(5.0)

    def make_database(self, url: str) -> Database:
        """The pool this service uses; override for codecs or pool size."""
        assert self.schema is not None
        return Database(url, self.schema)

    async def on_start(self) -> None:
        """After connections and migrations, before serving."""

    async def on_stop(self) -> None:
        """After serving stopped, before connections close."""

    # -- lifecycle ------------------------------------------------------------

    async def __aenter__(self) -> Service:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        nats_url = resolve_nats_url(self.settings)
        self.nc = await connect(nats_url, name=f"{self.name}:{self.instance}")
        self.api = ApiClient(self.nc, self.subjects)
        if self.schema is not None:
            self.db = self.make_database(resolve_database_url(self.settings))
            await self.db.open()
            if self.migrations_package:
                applied = await self.db.migrate(load_migrations(self.migrations_package))
                if applied:
                    self.log.info("migrations_applied", schema=self.schema, versions=applied)
        await self.on_start()
        self.micro = await add_service(
            self.nc,
            name=self.name,
            version=__version__,
            description=self.description or self.name,
            metadata={
                "root": self.subjects.root,
                "instance": self.instance,
                "host": socket.gethostname(),
                "pid": str(os.getpid()),
            },
        )
        routes = {"health.get": self._health, **self.routes()}
        for route, handler in routes.items():
            resource, _, verb = route.partition(".")
            await self.micro.add_endpoint(
                EndpointConfig(
                    name=route.replace(".", "-"),
                    subject=self.subjects.api(self.api_name, resource, verb),
                    handler=self._dispatcher(route, handler),
                    queue_group=f"{self.subjects.root}.{self.api_name}",
                )
            )
        if self.settings.health_port:
            self._health_server = await asyncio.start_server(
                self._health_http, "127.0.0.1", self.settings.health_port
            )
        await self.nc.flush()
        self.started_at = time.time()
        self.log.info("service_started", version=__version__, routes=sorted(routes))

    async def run(self) -> None:
        """Serve until ``request_stop()`` (or SIGTERM via ``run_service``) or a side loop fails."""
        loops = self._all_side_loops()
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(self._guard(name, fn), name=name) for name, fn in loops.items()]
            await self._stop_event.wait()
            for task in tasks:
                task.cancel()

    async def _guard(self, name: str, fn: SideLoop) -> None:
        try:
            await fn()
        except asyncio.CancelledError:
            raise
        except Exception:
            self.log.exception("side_loop_failed", loop=name)
            self._stop_event.set()
            raise

    def request_stop(self) -> None:
        self._stop_event.set()

    async def stop(self) -> None:
        """Stop serving, let in-flight requests finish within the grace, close. Safe twice."""
        if self._stopped:
            return
        self._stopped = True
        self._stop_event.set()
        if self.micro is not None:
            with contextlib.suppress(Exception):
                await self.micro.stop()
        if self._health_server is not None:
            self._health_server.close()
        if self._inflight:
            _done, pending = await asyncio.wait(set(self._inflight), timeout=self.stop_grace)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        with contextlib.suppress(Exception):
            await self.on_stop()
        if self.nc is not None and not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.drain(), timeout=2.0)
        if self.db is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.db.close(), timeout=2.0)
        self.log.info("service_stopped")

    # -- request handling -----------------------------------------------------

    def _dispatcher(self, route: str, handler: Handler) -> Callable[[Request], Awaitable[None]]:
        # nats-py awaits a subscription's callbacks one at a time: hand each request
        # to its own task so one slow request never holds up the others.
        async def dispatch(req: Request) -> None:
            task = asyncio.create_task(self._serve(route, handler, req), name=f"req:{route}")
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

        return dispatch

    async def _serve(self, route: str, handler: Handler, req: Request) -> None:
        max_reply = self.nc.max_payload if self.nc is not None else None
        request = ApiRequest(req.subject, req.data, req.headers, max_reply=max_reply)
        try:
            result = await handler(request)
            body = encode_ok(result)
        except BcError as err:
            body = encode_error(err)
        except msgspec.ValidationError as exc:
            body = encode_error(BcError(ErrorCode.INVALID_INPUT, str(exc)))
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await req.respond(encode_error(BcError(ErrorCode.UNAVAILABLE, "service is stopping")))
            raise
        except Exception as exc:
            self.log.exception("request_failed", route=route)
            body = encode_error(
                BcError(ErrorCode.INTERNAL, f"internal error in {route}: {type(exc).__name__}")
            )
        if max_reply is not None and len(body) > max_reply:
            # nats-py would refuse to publish it and the caller would wait for its timeout:
            # say what happened instead. INTERNAL, not INVALID_INPUT: the request was fine,
            # the service made something the bus cannot carry (lists page by size, so only
            # one item beyond the bus's limit gets here).
            self.log.warning("reply_too_large", route=route, size=len(body), max_payload=max_reply)
            body = encode_error(
                BcError(
                    ErrorCode.INTERNAL,
                    f"the reply of {route} ({len(body)} bytes) is larger than the bus carries"
                    f" ({max_reply} bytes); ask for less (a smaller limit, or follow the cursor)",
                    {"reason": "reply-too-large", "route": route, "size": len(body), "maxPayload": max_reply},
                )
            )
        # a request published without a reply subject gets no answer (ValueError)
        with contextlib.suppress(ValueError, nats.errors.ConnectionClosedError):
            await req.respond(body)

    async def health(self) -> dict[str, Any]:
        checks: dict[str, bool] = {"nats": bool(self.nc and self.nc.is_connected)}
        if self.db is not None:
            checks["postgres"] = await self.db.ping()
        return {
            "service": self.name,
            "instance": self.instance,
            "version": __version__,
            "uptimeSeconds": round(time.time() - self.started_at, 3),
            "ok": all(checks.values()),
            "checks": checks,
        }

    async def _health(self, _req: ApiRequest) -> dict[str, Any]:
        return await self.health()

    async def _health_http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=2.0)
            body = await self.health()
            data = encode(body)
            status = "200 OK" if body["ok"] else "503 Service Unavailable"
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
                + data
            )
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    # -- helpers for subclasses ----------------------------------------------

    async def publish_event(self, kind: str, ident: str, payload: Any) -> None:
        """Publish a state change on ``bc.events.<kind>.<id>``: a wake-up, never the truth."""
        if self.nc is None:
            return
        with contextlib.suppress(nats.errors.Error):
            await self.nc.publish(self.subjects.event(kind, ident), encode(payload))

    def on_message(
        self, handler: Callable[[Msg], Coroutine[Any, Any, None]]
    ) -> Callable[[Msg], Awaitable[None]]:
        """Wrap a plain subscription callback so it runs in its own tracked task."""

        async def cb(msg: Msg) -> None:
            task = asyncio.create_task(handler(msg))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

        return cb
