"""The skeleton every service process is built on.

``async with MyService(settings) as svc: await svc.run()`` connects NATS and
PostgreSQL, applies the service's migrations, serves its routes as a NATS micro
service (so ``$SRV.PING/INFO/STATS`` answer), runs its side loops in a TaskGroup and
stops gracefully: in-flight requests get a grace period, then are cancelled.

Outages of NATS or PostgreSQL, of any length, never end a service (``faults``): start-up
waits for both with a jittered, capped backoff; a side loop that fails on a transient fault
is logged and started again after a backoff; a request that meets one is answered
``UNAVAILABLE``; NATS reconnects for ever and nats-py subscribes again by itself. Only a
bug (an error retrying cannot fix) stops the service, for its supervisor to restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import EndpointConfig
from nats.micro.service import Service as MicroService

from ..config import Settings, SettingsSource, settings_changes
from ..core import __version__
from ..core.errors import BcError, ErrorCode
from ..logging import get_logger, safe_url
from ..runtime.urls import resolve_database_url, resolve_nats_url
from ..wire import Subjects, encode_error, encode_ok
from ..wire.audit import AuditList, ListAudit
from ..wire.codec import decode, encode, validation_path
from ..wire.paging import PAGE_BUDGET, decode_cursor, take_page
from ..wire.subjects import service_inbox_prefix
from . import audit
from .client import ApiClient, connect

if TYPE_CHECKING:
    from .probes import ProbeServer
from .db import Database, load_migrations
from .faults import Backoff, describe, is_transient

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


def _under(path: str, sections: tuple[str, ...]) -> bool:
    return any(path == s or path.startswith(f"{s}.") for s in sections)


def _setting(settings: msgspec.Struct, path: str) -> Any:
    value: Any = settings
    for key in path.split("."):
        value = getattr(value, key)
    return value


def _replaced(settings: Any, path: str, value: Any) -> Any:
    """``settings`` (a frozen Struct) with the setting at ``path`` made ``value``."""
    head, _, rest = path.partition(".")
    inner = _replaced(getattr(settings, head), rest, value) if rest else value
    return msgspec.structs.replace(settings, **{head: inner})


class Service:
    """Base of bc-engine, bc-command-queue, bc-pki and bc-secrets."""

    name: ClassVar[str] = "bc-service"
    api_name: ClassVar[str] = "service"
    schema: ClassVar[str | None] = None
    migrations_package: ClassVar[str | None] = None
    description: ClassVar[str] = ""
    stop_grace: ClassVar[float] = 3.0
    audit_routes: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    """Routes whose success is an operator action to record (docs/audit.md), each with the
    request fields (dotted paths) the record keeps: a whitelist, never a secret. A service that
    names any serves ``audit.list`` and needs the ``audit`` table in its schema."""
    live_settings: ClassVar[tuple[str, ...]] = ()
    """Settings (dotted paths, a section's covers its keys) this service applies while it runs
    when its config file changes (``apply_settings``); a change to any other is logged
    (``not_applied``: a restart applies it)."""
    settings_watch_s: ClassVar[float] = 1.0
    """How often the config file's inode, size and modification time are looked at."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.settings_source: SettingsSource | None = None
        """Where ``settings`` came from (``run_service`` sets it): its file is watched, and the
        ``live_settings`` read again from it are applied without a restart."""
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
        self._serving = False
        self._probes: ProbeServer | None = None

    # -- hooks for subclasses -------------------------------------------------

    def routes(self) -> Mapping[str, Handler]:
        """``resource.verb`` → handler. ``health.get`` is always there."""
        return {}

    def side_loops(self) -> Mapping[str, SideLoop]:
        """Named background loops. One that fails on a transient fault starts again after a
        backoff; one that fails on anything else stops the service."""
        return {}

    async def apply_settings(self, settings: Settings, changed: list[str]) -> None:
        """Put in force ``settings``' values of ``changed`` (paths under ``live_settings``), read
        again from the config file. Check everything before changing anything.

        Raises:
            BcError: ``INVALID_CONFIG`` with ``details.path`` when the new values are wrong: the
                settings in force stay.
        """

    def _all_side_loops(self) -> Mapping[str, SideLoop]:
        loops = dict(self.side_loops())
        if self.db is not None:
            loops["instance_heartbeat"] = self._instance_heartbeat
        source = self.settings_source
        if source is not None and source.file is not None and self.live_settings:
            loops["settings_watch"] = self._settings_watch
        return loops

    async def _settings_watch(self) -> None:
        """The config file read again when it changes: the ``live_settings`` that changed are
        applied (``settings_reloaded``); a file that cannot be read or is wrong is logged
        (``settings_invalid``, with its code and path) and the settings in force stay."""
        source = self.settings_source
        assert source is not None
        while True:
            await asyncio.sleep(self.settings_watch_s)
            if source.changed():
                await self.reload_settings()

    async def reload_settings(self) -> list[str]:
        """Read the config file again and apply what changed of ``live_settings``; the paths
        applied (none when the file is wrong: logged, the settings in force stay)."""
        source = self.settings_source
        assert source is not None
        file = str(source.file)
        try:
            new = source.read()
            changes = settings_changes(self.settings, new)
            live = [c for c in changes if _under(c, self.live_settings)]
            if live:
                try:
                    await self.apply_settings(new, live)
                except BcError:
                    raise
                except Exception:
                    source.forget()  # a server away mid-apply: the same file is applied once back
                    raise
        except BcError as err:
            self.log.error(
                "settings_invalid", file=file, code=err.code.value, path=err.path, error=err.message,
                detail="the settings in force stay; fix the file (it is read again when it changes)",
            )  # fmt: skip
            return []
        # what this service does not change while it runs: a restart applies those it uses
        rest = [c for c in changes if c not in live]
        if live:
            settings = self.settings
            for path in live:
                settings = _replaced(settings, path, _setting(new, path))
            self.settings = settings
            self.log.info("settings_reloaded", file=file, applied=live, not_applied=rest)
        elif rest:
            detail = "none of these changes while this service runs: restart it to use them"
            self.log.info("settings_changed", file=file, applied=[], not_applied=rest, detail=detail)
        return live

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
        """After connections and migrations, before serving.

        Runs again when it fails on a transient fault: do database work before subscribing.
        """

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
        """Connect, migrate, ``on_start``, serve. Waits for NATS and PostgreSQL as long as they
        are away (returns early, serving nothing, when asked to stop meanwhile)."""
        # Where the servers are is configuration: without it, fail now with what to do.
        nats_url = resolve_nats_url(self.settings)
        db_url = resolve_database_url(self.settings) if self.schema is not None else None
        if not await self._patiently("nats", lambda: self._connect_nats(nats_url)):
            return
        if db_url is not None and not await self._patiently("postgres", lambda: self._open_database(db_url)):
            return
        if not await self._patiently("on_start", self.on_start):
            return
        assert self.nc is not None
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
        if self.audit_routes and self.db is not None:
            routes["audit.list"] = self._audit_list
        for route, handler in routes.items():
            resource, _, verb = route.partition(".")
            await self.micro.add_endpoint(
                EndpointConfig(
                    name=route.replace(".", "-"),
                    subject=self.subjects.api(self.api_name, resource, verb),
                    handler=self._dispatcher(route, self._unavailable_on_fault(route, handler)),
                    queue_group=f"{self.subjects.root}.{self.api_name}",
                )
            )
        if self.settings.health_port:
            # imported here: bcx imports this module, and it never serves probes
            from .probes import ProbeServer

            self._probes = ProbeServer(
                port=self.settings.health_port,
                loop=asyncio.get_running_loop(),
                health=self.health,
                collect=self._collect_for_scrape,
            )
        await self.nc.flush()
        self.started_at = time.time()
        self._serving = True
        self.log.info("service_started", version=__version__, routes=sorted(routes))

    async def _connect_nats(self, url: str) -> None:
        self.nc = await connect(
            url,
            name=f"{self.name}:{self.instance}",
            creds=self.settings.nats_creds,
            ca=self.settings.nats_ca,
            # its replies under its own prefix, the only inboxes its NATS user may read
            inbox_prefix=service_inbox_prefix(self.api_name),
            error_cb=self._nats_error,
            disconnected_cb=self._nats_disconnected,
            reconnected_cb=self._nats_reconnected,
        )
        self.api = ApiClient(self.nc, self.subjects, actor=f"{audit.SERVICE_ACTOR_PREFIX}{self.name}")

    async def _open_database(self, url: str) -> None:
        db = self.make_database(url)
        try:
            await db.open()
            if self.migrations_package:
                applied = await db.migrate(load_migrations(self.migrations_package))
                if applied:
                    self.log.info("migrations_applied", schema=self.schema, versions=applied)
        except BaseException:
            with contextlib.suppress(Exception):
                await db.close()
            raise
        self.db = db

    async def _patiently(self, what: str, step: Callable[[], Awaitable[None]]) -> bool:
        """``step()`` until it gets through a transient fault; False when asked to stop first."""
        backoff = Backoff(first=0.2, cap=5.0)
        while not self._stop_event.is_set():
            try:
                await step()
                if backoff.failures:
                    self.log.info("dependency_reachable", waited_for=what)
                return True
            except Exception as exc:
                if not is_transient(exc):
                    raise
                delay = backoff.next()
                self.log.warning(
                    "waiting_for_dependency", waited_for=what, error=describe(exc), retry_in_s=round(delay, 2)
                )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._stop_event.wait()
        return False

    async def _nats_error(self, exc: Exception) -> None:
        self.log.debug("nats_error", error=type(exc).__name__)

    async def _nats_disconnected(self) -> None:
        if not self._stopped:
            self.log.warning("nats_disconnected")

    async def _nats_reconnected(self) -> None:
        url = self.nc.connected_url if self.nc is not None else None
        self.log.info("nats_reconnected", url=safe_url(url.geturl()) if url is not None else None)

    async def run(self) -> None:
        """Serve until ``request_stop()`` (or SIGTERM via ``run_service``) or a side loop fails."""
        if not self._serving:
            return  # asked to stop while waiting for NATS or PostgreSQL
        loops = self._all_side_loops()
        tasks = [asyncio.create_task(self._guard(name, fn), name=name) for name, fn in loops.items()]
        try:
            await self._stop_event.wait()
        finally:
            # Cancel until every loop has ended: on 3.11 a cancellation that lands as an inner
            # ``asyncio.wait_for`` times out (nats-py's requests) is dropped, and the loop would
            # carry on (a discovery sweep's 30 s sleep held a stop for that long).
            pending = {t for t in tasks if not t.done()}
            while pending:
                for task in pending:
                    task.cancel()
                _, pending = await asyncio.wait(pending, timeout=1.0)
        failed = [e for t in tasks if not t.cancelled() and (e := t.exception()) is not None]
        if failed:  # a side loop's real bug (it set the stop event): the service stops, as a
            # TaskGroup would have said it
            raise BaseExceptionGroup("a side loop failed", failed)  # an ExceptionGroup for Exceptions

    async def _guard(self, name: str, fn: SideLoop) -> None:
        """Run a side loop; start it again after a backoff when a transient fault ends it."""
        backoff = Backoff(first=0.2, cap=5.0)
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            try:
                await fn()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not await self._transient(exc):
                    self.log.exception("side_loop_failed", loop=name)
                    self._stop_event.set()
                    raise
                if loop.time() - began > 60.0:
                    backoff.reset()  # it ran fine for a while: this is a new outage
                delay = backoff.next()
                self.log.warning(
                    "side_loop_interrupted", loop=name, error=describe(exc), retry_in_s=round(delay, 2)
                )
            await asyncio.sleep(delay)

    async def _transient(self, exc: Exception) -> bool:
        """A transient fault, or any error while NATS or PostgreSQL is away (its likely cause)."""
        if is_transient(exc):
            return True
        if self.nc is not None and not self.nc.is_connected:
            return True
        return self.db is not None and not await self.db.ping()

    def _unavailable_on_fault(self, route: str, handler: Handler) -> Handler:
        """A request that meets a transient fault is answered ``UNAVAILABLE`` (try again), not
        ``INTERNAL``."""

        async def guarded(request: ApiRequest) -> Any:
            try:
                return await handler(request)
            except (BcError, msgspec.ValidationError):
                raise
            except Exception as exc:
                if not is_transient(exc):
                    raise
                self.log.warning("request_unavailable", route=route, error=describe(exc))
                raise BcError(
                    ErrorCode.UNAVAILABLE,
                    f"{route} cannot be served now: a server it needs is away; try again",
                ) from exc

        return guarded

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
        if self._probes is not None:
            await self._probes.close()
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
                async with asyncio.timeout(2.0):
                    await self.nc.drain()
        if self.db is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await self.db.close()
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
            if route in self.audit_routes:
                await self._record_action(route, request, result)
            body = encode_ok(result)
        except BcError as err:
            body = encode_error(err)
        except msgspec.ValidationError as exc:
            # a handler's own msgspec.convert: still typed, still with the path
            body = encode_error(BcError(ErrorCode.INVALID_INPUT, str(exc), {"path": validation_path(exc)}))
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

    def audit_target(self, route: str, body: Any, result: Any) -> str | None:
        """What an audited action was about (the entry's ``target``): by default the first id in
        the reply, else in the request. A service overrides it for a route whose reply names
        other things first."""
        del route
        return audit.audit_target(body, result)

    async def _record_action(self, route: str, request: ApiRequest, result: Any) -> None:
        """Record an operator action that succeeded. A failure to record is logged, not
        answered: the change is made, and the caller must learn that it was."""
        who = audit.requester(request.headers)
        actor = who.actor
        if self.db is None or who.is_service:
            return
        try:
            # the handler took the request, so it is JSON within bounds; a route that reads no
            # body (keys.rewrap) may have been sent anything, kept as no detail
            body = msgspec.json.decode(request.data) if request.data else {}
        except (msgspec.DecodeError, RecursionError):
            body = {}
        try:
            await self.db.execute(
                audit.AUDIT_INSERT,
                actor,
                route,
                self.audit_target(route, body, audit.builtins(result)),
                encode(audit.audit_detail(body, self.audit_routes[route], claimed=who.claimed)).decode(),
                self.instance,
                who.verified,
            )
        except Exception as exc:
            self.log.error("audit_write_failed", route=route, actor=actor, error=describe(exc))

    async def _audit_list(self, request: ApiRequest) -> AuditList:
        assert self.db is not None
        body = request.decode(ListAudit)
        (before,) = decode_cursor(body.cursor, int) or (None,)
        who = body.who
        prefix = who[:-1] if who is not None and who.endswith("*") else None
        exact = who if prefix is None else None
        rows = await self.db.fetch(audit.AUDIT_LIST, body.since, exact, prefix, before, body.limit + 1)
        entries, next_ = take_page(
            [audit.audit_entry(r, self.name) for r in rows], limit=body.limit, key=lambda e: (e.id,),
            budget=request.page_budget,
        )  # fmt: skip
        return AuditList(entries=entries, next=next_)

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

    async def collect_metrics(self) -> None:
        """Before a scrape of ``/metrics``: set the gauges read from the store (override)."""

    async def _collect_for_scrape(self) -> None:
        try:
            async with asyncio.timeout(5.0):
                await self.collect_metrics()
        except Exception as exc:  # the store is away: serve the counters, say so in the log
            self.log.warning("metrics_collect_failed", error=describe(exc))

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
