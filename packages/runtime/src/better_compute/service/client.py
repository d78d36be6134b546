"""Calling services over NATS, and finding which instances run."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
import ssl
import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from .._imports import import_quietly
from ..core.errors import BcError, ErrorCode
from ..logging import safe_url
from ..wire import Subjects, unwrap
from ..wire.audit import ACTOR_HEADER
from ..wire.codec import encode
from ..wire.subjects import SERVICE_NAMES

if TYPE_CHECKING:
    from nats.aio.client import Client as Nats

__all__ = ["ApiClient", "LazyTls", "connect", "discover", "nats_client", "tls_context", "when_reconnected"]

_Listener = Callable[[], Awaitable[None]]
_RECONNECTED: weakref.WeakKeyDictionary[Any, list[_Listener]] = weakref.WeakKeyDictionary()


def when_reconnected(nc: Any, callback: Callable[[], Awaitable[None]]) -> bool:
    """Call ``callback`` after each reconnect of ``nc``, besides the ``reconnected_cb`` it was
    opened with (an agent handed its owner's connection hears of reconnects this way). False
    for a connection ``connect`` did not open: then nothing will call it."""
    listeners = _RECONNECTED.get(nc)
    if listeners is None:
        return False
    listeners.append(callback)
    return True


_REFUSED = re.compile(r"authorization violation|authentication", re.IGNORECASE)
CONNECT_TRIES = 2  # a first connection gives up after this many tries (seconds, not minutes)


async def _quiet(_exc: Exception) -> None:
    """nats-py's default error callback logs a traceback for every failed (re)connect try;
    callers get a typed error (or a reconnect) instead, and services log through their own."""


def _check_creds(creds: str) -> None:
    try:
        with open(creds, "rb"):
            pass
    except OSError as exc:
        raise BcError(
            ErrorCode.INVALID_CONFIG,
            f"cannot read the NATS credentials file {creds}: {exc.strerror}",
            {"path": "nats_creds", "file": creds},
        ) from exc


def tls_context(ca: str) -> ssl.SSLContext:
    """A client TLS context that trusts only the CA in the file ``ca`` (the ``nats_ca`` setting),
    checking the server's name; ``INVALID_CONFIG`` at ``nats_ca`` when it is not a readable CA."""
    try:
        return ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise BcError(
            ErrorCode.INVALID_CONFIG,
            f"cannot load the NATS CA file {ca}: {getattr(exc, 'strerror', None) or exc}",
            {"path": "nats_ca", "file": ca},
        ) from exc


class LazyTls:
    """A TLS context made the first time a server asks for TLS (``connect(tls=LazyTls(make))``),
    then kept for the connection's reconnects; ``make`` raises what loading it raises, then
    (``INVALID_CONFIG``). A connection to a server without TLS (a plain ``nats://`` server: the
    dev stack's, the metal simulator's) never makes one: an agent's context trusting the
    system's CAs is about a MiB, and the simulator's lean host (``bcd.lean``) holds thousands
    of agents' connections in one process."""

    def __init__(self, make: Callable[[], ssl.SSLContext]) -> None:
        self._make = make
        self._made: ssl.SSLContext | None = None

    @property
    def made(self) -> bool:
        """Whether a server asked for TLS (the context was made)."""
        return self._made is not None

    def context(self) -> ssl.SSLContext:
        if self._made is None:
            self._made = self._make()
        return self._made


@functools.cache
def _ordered_client() -> type[Nats]:
    from nats.aio.client import Client as NatsClient

    class OrderedClient(NatsClient):
        """nats-py's client whose ``flush()`` means what it says: every command queued before it
        has reached the server.

        nats-py (2.16, and its main branch) writes a flush's PING straight to the socket while
        the commands before it (a SUB, a PUB) wait in its buffer for the flusher task, so the
        PING can overtake them: the PONG comes back before the server has the SUB. A service
        that said "started" after its flush then met, one time in 100 to 500, a first
        request answered "no responders" (CI, ``test_secrets``; measured with the raw client:
        20 of 2,000 subscribe-flush-request rounds on nats-server 2.15.1, 5 of 1,000 on 2.9.10).
        The queued commands are written first, in order, then the PING. While disconnected the
        queue is left for the reconnect to send, as nats-py does."""

        async def _send_ping(self, future: asyncio.Future[bool] | None = None) -> None:
            if self._pending and self.is_connected and self._transport is not None:
                self._transport.writelines(self._pending[:])
                self._pending = []
                self._pending_data_size = 0
            await super()._send_ping(future)

    return OrderedClient


def nats_client() -> Nats:
    """A nats-py client, not connected yet, whose ``flush()`` keeps order (``OrderedClient``):
    for a caller that connects with options ``connect`` does not take (a list of servers, a
    user and password). Call ``await nc.connect(...)`` on it."""
    import_quietly("nats")
    return _ordered_client()()


@functools.cache
def _lazy_tls_client() -> type[Nats]:
    class LazyTlsClient(_ordered_client()):  # type: ignore[misc]
        """nats-py's client, asking a ``LazyTls`` for its context when TLS starts."""

        @property
        def ssl_context(self) -> ssl.SSLContext:
            tls = self.options.get("tls")
            return tls.context() if isinstance(tls, LazyTls) else super().ssl_context

    return LazyTlsClient


async def connect(
    url: str, *, name: str, creds: str | None = None, ca: str | None = None, **kwargs: Any
) -> Nats:
    """Connect to NATS; ``UNAVAILABLE`` naming ``url`` (without credentials) when nothing answers.

    The first connection is bounded (``CONNECT_TRIES`` tries of ``connect_timeout`` seconds), so a
    caller never hangs on a wrong or dead URL; a service that must wait for NATS retries this
    itself. Once connected, a connection with ``allow_reconnect`` (the default) reconnects for
    ever (``max_reconnect_attempts=-1``) and nats-py subscribes again by itself.

    ``creds`` is a NATS credentials file (the ``nats_creds`` setting): ``INVALID_CONFIG`` at
    ``nats_creds`` when it cannot be read, ``UNAUTHENTICATED`` when the server refuses it. ``ca``
    (the ``nats_ca`` setting) is the CA file that TLS checks the servers against; a ``tls://`` URL
    without it trusts the system's CAs. ``tls`` may be a ``LazyTls`` (made when a server asks).
    """
    import_quietly("nats")  # loaded on the first connection, not when a bcx parser is built
    import nats.errors

    reconnects = kwargs.pop("max_reconnect_attempts", -1)
    callback = kwargs.pop("error_cb", _quiet)
    seen: list[Exception] = []  # what nats-py reported on the way: its final error hides the cause
    untrusted = asyncio.Event()  # a server certificate we do not trust: no point in trying again

    async def error_cb(exc: Exception) -> None:
        if len(seen) < 16:
            seen.append(exc)
        if isinstance(exc, ssl.SSLCertVerificationError):
            untrusted.set()
        await callback(exc)

    if creds:
        _check_creds(creds)
        kwargs["user_credentials"] = creds
    if ca:
        kwargs["tls"] = tls_context(ca)
    connect_timeout = kwargs.pop("connect_timeout", 2)
    reconnect_time_wait = kwargs.pop("reconnect_time_wait", 0.5)
    nc = _lazy_tls_client()() if isinstance(kwargs.get("tls"), LazyTls) else _ordered_client()()
    listeners: list[_Listener] = []
    if (given := kwargs.pop("reconnected_cb", None)) is not None:
        listeners.append(given)
    _RECONNECTED[nc] = listeners

    async def reconnected_cb() -> None:
        for listener in list(listeners):
            await listener()

    kwargs["reconnected_cb"] = reconnected_cb
    attempt = asyncio.ensure_future(
        nc.connect(
            url,
            name=name,
            connect_timeout=connect_timeout,
            # nats-py uses the same limit for the first connection, where -1 (or 0) means trying
            # for ever: bound it here, and lift it once connected.
            max_reconnect_attempts=CONNECT_TRIES - 1,
            reconnect_time_wait=reconnect_time_wait,
            allow_reconnect=kwargs.pop("allow_reconnect", True),
            error_cb=error_cb,
            **kwargs,
        )
    )
    stop = asyncio.ensure_future(untrusted.wait())
    try:
        # bounded: nats-py can hang after a failed TLS handshake (nats-py 2.x on Python 3.11)
        await asyncio.wait(
            {attempt, stop},
            timeout=CONNECT_TRIES * (connect_timeout + reconnect_time_wait) + 2,
            return_when=asyncio.FIRST_COMPLETED,
        )
    except BaseException:
        attempt.cancel()
        raise
    finally:
        stop.cancel()
    failure: BaseException | None = None
    if not attempt.done():
        attempt.cancel()
        failure = TimeoutError("no connection in time")
    elif attempt.exception() is not None:
        failure = attempt.exception()
    if failure is not None:
        if not isinstance(failure, (OSError, nats.errors.Error, TimeoutError)):
            with contextlib.suppress(BaseException):  # a LazyTls that could not load: its socket
                async with asyncio.timeout(0.2):
                    await nc.close()
            raise failure
        with contextlib.suppress(
            BaseException
        ):  # its transport's close can hang after a failed TLS handshake
            async with asyncio.timeout(0.2):
                await nc.close()
        raise _connect_error(url, [failure, *seen]) from failure
    nc.options["max_reconnect_attempts"] = reconnects
    return nc


def _connect_error(url: str, causes: list[BaseException]) -> BcError:
    """The typed error of a first connection that failed, from everything nats-py reported."""
    import nats.errors

    where = safe_url(url)
    if any(isinstance(c, ssl.SSLCertVerificationError) for c in causes):
        said = next(c for c in causes if isinstance(c, ssl.SSLCertVerificationError))
        return BcError(
            ErrorCode.INVALID_CONFIG,
            f"the TLS certificate of NATS at {where} is not trusted ({said.verify_message}):"
            " set nats_ca to the CA that signed it",
            {"path": "nats_ca", "url": where},
        )
    # nats-py reports the server's refusal as a plain Error carrying the server's words
    if any(isinstance(c, nats.errors.AuthorizationError) or _REFUSED.search(str(c)) for c in causes):
        return BcError(
            ErrorCode.UNAUTHENTICATED,
            f"NATS at {where} refused this connection's credentials",
            {"url": where},
        )
    return BcError(ErrorCode.UNAVAILABLE, f"cannot reach NATS at {where}", {"url": where})


T = TypeVar("T")

NO_RESPONDERS_RETRY = (0.05, 0.2, 0.5)  # seconds between tries when no instance listens


class ApiClient:
    """Request/reply calls to ``bc.api.<service>.<resource>.<verb>``."""

    def __init__(self, nc: Nats, subjects: Subjects | None = None, *, actor: str | None = None) -> None:
        self.nc = nc
        self.subjects = subjects or Subjects()
        self.actor = actor
        """Who asks: sent in the ``Bc-Actor`` header of every request, kept in the services'
        audit of the actions it takes (docs/audit.md). A claim: nothing verifies it yet."""
        self._headers = {ACTOR_HEADER: actor} if actor else None

    async def call(self, service: str, route: str, payload: Any = None, *, timeout: float = 10.0) -> Any:
        """Call ``route`` (``resource.verb``) of ``service`` and return its result.

        Raises the service's ``BcError``; ``UNAVAILABLE`` when no instance listens or NATS is
        away, ``TIMEOUT`` when none answers in time.
        """
        import nats.errors  # loaded with the connection (``connect``)

        resource, _, verb = route.partition(".")
        subject = self.subjects.api(service, resource, verb)
        data = payload if isinstance(payload, bytes) else encode(payload if payload is not None else {})
        if len(data) > self.nc.max_payload:
            # nats-py would raise MaxPayloadError; the caller wants to know which limit, typed.
            raise BcError(
                ErrorCode.INVALID_INPUT,
                f"the request to {route} ({len(data)} bytes) is larger than the bus carries"
                f" ({self.nc.max_payload} bytes)",
                {"path": "", "reason": "request-too-large", "size": len(data),
                 "maxPayload": self.nc.max_payload},
            )  # fmt: skip
        # "No responders" means nobody received the request, so asking again is always safe;
        # a short retry rides over an instance restarting (a rolling deploy) before giving up.
        for pause in (*NO_RESPONDERS_RETRY, None):
            try:
                msg = await self.nc.request(subject, data, timeout=timeout, headers=self._headers)
            except nats.errors.NoRespondersError as exc:
                if pause is not None:
                    await asyncio.sleep(pause)
                    continue
                name = SERVICE_NAMES.get(service, service)
                raise BcError(
                    ErrorCode.UNAVAILABLE, f"no {name} instance is running", {"service": name}
                ) from exc
            except nats.errors.TimeoutError as exc:
                raise BcError(ErrorCode.TIMEOUT, f"{subject} did not answer within {timeout}s") from exc
            except nats.errors.Error as exc:  # the connection is closed, or reconnecting and full
                raise BcError(ErrorCode.UNAVAILABLE, f"NATS: {type(exc).__name__}") from exc
            return unwrap(msg.data)
        raise AssertionError("unreachable")

    async def call_as(
        self, service: str, route: str, payload: Any, typ: type[T], *, timeout: float = 10.0
    ) -> T:
        """``call``, with the result converted to ``typ``; a reply that does not fit is the
        service's fault (``INTERNAL``), never the caller's input."""
        got = await self.call(service, route, payload, timeout=timeout)
        try:
            return msgspec.convert(got, typ, strict=False)
        except msgspec.ValidationError as exc:
            name = SERVICE_NAMES.get(service, service)
            raise BcError(ErrorCode.INTERNAL, f"malformed reply from {name}: {exc}") from exc


async def discover(nc: Nats, *, root: str | None = None, wait: float = 0.5) -> list[dict[str, Any]]:
    """Every service instance that answers ``$SRV.STATS`` within ``wait`` seconds.

    With ``root``, only instances serving that subject root (tests share a server).
    """
    import nats.errors  # loaded with the connection (``connect``)

    replies: list[dict[str, Any]] = []
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish("$SRV.STATS", b"", reply=inbox)
        await nc.flush()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while (left := deadline - loop.time()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except nats.errors.TimeoutError:
                break
            try:
                data = json.loads(msg.data)
            except ValueError:
                continue
            if not isinstance(data, dict):
                continue
            meta = data.get("metadata") or {}
            if root is not None and meta.get("root") != root:
                continue
            replies.append(data)
    finally:
        await sub.unsubscribe()
    replies.sort(key=lambda d: (str(d.get("name")), str(d.get("started"))))
    return replies
