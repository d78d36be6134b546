"""``bc-pki callout``: the auth callout responder of one site's NATS leaf node.

One runs beside each leaf node (deploy/systemd/bc-callout@.service). It connects to its leaf as
the ``callout`` user (an ``auth_users`` entry, so the leaf does not ask it about itself) and
answers ``$SYS.REQ.USER.AUTH`` with ``better_compute.service.bus_auth.CalloutResponder``: an agent
that shows the certificate bc-pki issued it becomes a NATS user of its own, with its own
subjects only; the site's joining certificate gets ``agents.join`` and nothing else.

Revocation is bc-pki's: the responder asks ``certs.get`` (through the leaf's import of it) and
keeps a good answer for ``cache_seconds``. It hears every revocation on ``bc.events.cert.*`` and
then cuts the agent's connections at once (``$SYS.REQ.SERVER.<id>.KICK``, imported from the leaf's
system account): those it let in, and those the leaf's connz shows with that certificate
(let in before the responder restarted). A revocation nobody heard (the responder stopped, or
the leaf's link to the hub down) is caught by a sweep: when the responder starts, whenever its
connection to the leaf comes back, and every ``sweep_seconds``, it lists the leaf's connections
in the site's account and asks bc-pki afresh (no cache) about the certificate of each agent
connection, cutting off those revoked. A sweep that cannot ask (the leaf's link to the hub
down) is tried again every 5 s until one can. The user it gave the agent expires within the hour
anyway.

.. code-block:: toml

    site_id = "eu1"
    nats_url = "tls://127.0.0.1:4222"                 # this host's leaf node
    nats_ca = "/etc/better-compute/nats/tls/ca.pem"   # the bus CA: checks the leaf
    cert_file = "/etc/better-compute/callout/bc-callout-eu1.pem"      # bcx bus callout
    key_file = "/etc/better-compute/callout/bc-callout-eu1-key.pem"
    password_file = "/etc/better-compute/callout/callout-eu1-password"
    issuer_seed_file = "/etc/better-compute/callout/callout-eu1-issuer.nk"
    pki_ca_file = "/etc/better-compute/callout/pki-ca.pem"  # bcx certs ca
    bus_ca_file = "/etc/better-compute/nats/tls/ca.pem"     # joining certificates (default nats_ca)
    # user = "callout"; account = "SITE"; js_api = "$JS.API"; subject_root = "bc"
    # cache_seconds = 10; stale_seconds = 300; sweep_seconds = 60

Every problem with it is ``INVALID_CONFIG`` with ``details.path`` naming the key (exit status 2).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import re
import signal
import ssl
import sys
import time
import tomllib
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from better_compute.agent.runner import connect_waiting
from better_compute.clients.pki import PkiClient
from better_compute.core.errors import BcError, ErrorCode
from better_compute.logging import configure_logging, get_logger
from better_compute.service.bus_auth import (
    AUTH_SUBJECT,
    Admitted,
    AgentCertificate,
    CalloutResponder,
    cert_id_of_user,
)
from better_compute.service.client import ApiClient, tls_context
from better_compute.service.recent import Recent
from better_compute.wire import Subjects
from better_compute.wire.pki import CertRevoked, decode_cert_event
from better_compute.wire.subjects import service_inbox_prefix, valid_token

__all__ = [
    "CalloutConfig",
    "Connections",
    "Revocations",
    "Swept",
    "load_config",
    "main",
    "run",
    "sweep",
    "sweeps",
]

KICK_SUBJECT = "$SYS.REQ.SERVER.{server}.KICK"
CONNZ_SUBJECT = "$SYS.REQ.SERVER.{server}.CONNZ"
CONNZ_PAGE = 1024
SWEEP_RETRY_S = 5.0  # after a sweep that could not ask the leaf or bc-pki
CONNECTIONS_PER_CERT = 16  # the latest connections remembered per certificate (kicks them all)


class CalloutConfig(msgspec.Struct, frozen=True, kw_only=True):
    """``callout.toml`` (the module's docstring shows one)."""

    site_id: str
    nats_url: str
    nats_ca: str
    cert_file: str
    key_file: str
    password_file: str
    issuer_seed_file: str
    pki_ca_file: str
    bus_ca_file: str | None = None
    user: str = "callout"
    account: str = "SITE"
    js_api: str = "$JS.API"
    subject_root: str = "bc"
    cache_seconds: float = 10.0
    stale_seconds: float = 300.0
    sweep_seconds: float = 60.0


def _bad(path: str, message: str) -> BcError:
    return BcError(ErrorCode.INVALID_CONFIG, message, {"path": path})


def load_config(file: str | Path) -> CalloutConfig:
    """The responder's config; ``INVALID_CONFIG`` at the key that is wrong."""
    try:
        doc = tomllib.loads(Path(file).read_text())
    except OSError as exc:
        raise _bad("config", f"cannot read {file}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise _bad("config", f"{file} is not TOML: {exc}") from exc
    unknown = sorted(set(doc) - set(CalloutConfig.__struct_fields__))
    if unknown:  # a misspelt key would otherwise be a default silently
        raise _bad(unknown[0], f"{file}: no such setting: {unknown[0]}")
    try:
        config = msgspec.convert(doc, CalloutConfig)
    except msgspec.ValidationError as exc:
        # "Expected `str`, got `int` - at `$.site_id`", "Object missing required field `nats_url`"
        at = re.search(r"at `\$\.([\w.]+)`|field `(\w+)`", str(exc))
        raise _bad(next((g for g in at.groups() if g), "") if at else "", f"{file}: {exc}") from None
    if not valid_token(config.site_id):
        raise _bad("site_id", "a site id (letters, digits, '-', '_')")
    for key in ("cache_seconds", "stale_seconds"):
        if getattr(config, key) < 0:
            raise _bad(key, "a number of seconds, 0 or more")
    if config.sweep_seconds < 1:
        raise _bad("sweep_seconds", "a number of seconds, 1 or more")
    return config


def _read(config: CalloutConfig, key: str) -> bytes:
    path = getattr(config, key)
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise _bad(key, f"cannot read {path}: {exc.strerror}") from exc


class Revocations:
    """Whether bc-pki revoked an agent's certificate, asked through the leaf (``certs.get``).

    A good answer is kept ``fresh`` seconds; while bc-pki cannot be asked, one up to ``stale``
    seconds old still counts (logged), older ones do not: the agent is refused until bc-pki
    answers. A revocation heard on the event feed, or in an answer, counts at once and for good.
    A ``pending`` certificate is refused as such, and asked about again at its next try."""

    def __init__(
        self,
        pki: PkiClient,
        *,
        fresh: float,
        stale: float,
        log: Any,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pki = pki
        self.fresh = fresh
        self.stale = stale
        self.log = log
        self.clock = clock
        # cert id -> when bc-pki last said it is valid; swept of answers too old to count even
        # with bc-pki away, as every join makes a certificate
        self._good: Recent[str, float] = Recent(max(fresh, stale), lambda said: said)
        self._revoked: set[str] = set()

    def heard_revoked(self, cert_id: str) -> None:
        self._revoked.add(cert_id)
        self._good.pop(cert_id)

    @property
    def confirmed(self) -> int:
        """Certificates whose good answer from bc-pki is kept now."""
        return len(self._good)

    async def revoked(self, agent: AgentCertificate) -> bool:
        cert_id = agent.cert_id
        if cert_id is None:  # issued before bc-pki wrote it there: it cannot be asked about
            raise BcError(
                ErrorCode.UNAUTHENTICATED, "the certificate names no bc-pki certificate id: join again"
            )
        if cert_id in self._revoked:
            return True
        now = self.clock()
        said = self._good.get(cert_id)
        if said is not None and now - said < self.fresh:
            return False
        try:
            info = await self.pki.get_certificate(cert_id=cert_id)
        except BcError as err:
            if err.code is ErrorCode.NOT_FOUND:
                raise BcError(ErrorCode.UNAUTHENTICATED, "bc-pki does not know this certificate") from None
            if err.code not in (ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT):
                raise
            if said is not None and now - said < self.stale:
                self.log.warning("pki_unreachable_cached_answer", cert_id=cert_id, age_s=round(now - said, 1))
                return False
            self.log.warning("pki_unreachable_refused", cert_id=cert_id, code=err.code.value)
            raise BcError(
                ErrorCode.UNAUTHENTICATED, "bc-pki cannot be asked about this certificate now"
            ) from None
        if info.serial != agent.serial or info.agent_id != agent.agent_id:
            raise BcError(
                ErrorCode.UNAUTHENTICATED, "bc-pki knows this certificate id for another certificate"
            )
        if info.state == "revoked":
            self.heard_revoked(cert_id)  # for good: its later tries cost bc-pki nothing
        if info.state == "pending":  # a held join whose boot entry has not closed clean yet
            raise BcError(
                ErrorCode.UNAUTHENTICATED,
                "the certificate is pending: its boot entry has not closed clean yet",
            )
        if info.state != "valid":
            return True
        self._good[cert_id] = now
        return False


class Connections:
    """The agent connections the responder let in, by certificate id, to cut them off."""

    def __init__(self) -> None:
        self._by_cert: dict[str, OrderedDict[tuple[str, int], None]] = {}

    def admitted(self, admitted: Admitted) -> None:
        cert_id = admitted.agent.cert_id
        if cert_id is None:  # never admitted: Revocations refuses it
            return
        seen = self._by_cert.setdefault(cert_id, OrderedDict())
        seen[(admitted.server_id, admitted.client_id)] = None
        while len(seen) > CONNECTIONS_PER_CERT:
            seen.popitem(last=False)

    def take(self, cert_id: str) -> list[tuple[str, int]]:
        """The connections of certificate ``cert_id``, forgotten as they are handed out."""
        return list(self._by_cert.pop(cert_id, {}))


async def _kick(nc: Any, server_id: str, client_id: int, log: Any) -> None:
    subject = KICK_SUBJECT.format(server=server_id)
    try:
        reply = await nc.request(subject, json.dumps({"cid": client_id}).encode(), timeout=2)
    except Exception as exc:
        log.warning("kick_failed", server_id=server_id, client_id=client_id, error=type(exc).__name__)
        return
    error = None
    with contextlib.suppress(ValueError, AttributeError):
        error = (json.loads(reply.data) or {}).get("error")
    if error:  # most often: the connection had already gone
        log.info("kick_refused", server_id=server_id, client_id=client_id, error=str(error)[:200])
    else:
        log.info("agent_cut_off", server_id=server_id, client_id=client_id)


def _secrets(config: CalloutConfig) -> tuple[bytes, str, bytes, bytes]:
    """The issuer seed, the callout user's password on the leaf, bc-pki's CA and the bus CA, from
    their files."""
    bus_ca_key = "bus_ca_file" if config.bus_ca_file else "nats_ca"
    return (
        _read(config, "issuer_seed_file").strip(),
        _read(config, "password_file").decode().strip(),
        _read(config, "pki_ca_file"),
        _read(config, bus_ca_key),
    )


class Swept(NamedTuple):
    """A connection a sweep cuts off, and why (``revoked``, ``expired``, ``unknown``,
    ``other-certificate``)."""

    cert_id: str
    server_id: str
    client_id: int
    why: str


async def connections(nc: Any, server_id: str, account: str, log: Any) -> list[dict[str, Any]] | None:
    """The leaf's open connections in ``account`` as connz shows them (with their user and
    TLS peer certificates); None when the leaf does not answer."""
    found: list[dict[str, Any]] = []
    offset = 0
    while True:
        query = {"auth": True, "acc": account, "state": 0, "offset": offset, "limit": CONNZ_PAGE}
        try:
            reply = await nc.request(
                CONNZ_SUBJECT.format(server=server_id), json.dumps(query).encode(), timeout=2
            )
            conns = (json.loads(reply.data).get("data") or {}).get("connections") or []
        except Exception as exc:  # the leaf away: the user's expiry still ends it
            log.warning("connz_failed", server_id=server_id, error=type(exc).__name__)
            return None
        found.extend(c for c in conns if isinstance(c, dict) and isinstance(c.get("cid"), int))
        if len(conns) < CONNZ_PAGE:
            return found
        offset += CONNZ_PAGE


def _cert_sha256(conn: dict[str, Any]) -> str:
    certs = conn.get("tls_peer_certs") or [{}]
    return str(certs[0].get("cert_sha256", "")).lower()


def _der_sha256(pem: str) -> str:
    der = x509.load_pem_x509_certificate(pem.encode()).public_bytes(serialization.Encoding.DER)
    return hashlib.sha256(der).hexdigest()


async def holding(nc: Any, server_id: str, account: str, cert_sha256: str, log: Any) -> list[tuple[str, int]]:
    """The leaf's open connections in ``account`` that showed the certificate whose DER has
    SHA-256 ``cert_sha256``: also those a responder let in before it restarted, which it does
    not remember."""
    conns = await connections(nc, server_id, account, log) or []
    return [(server_id, int(c["cid"])) for c in conns if _cert_sha256(c) == cert_sha256]


async def sweep(nc: Any, pki: PkiClient, server_id: str, account: str, log: Any) -> list[Swept] | None:
    """Re-check every agent connection the leaf has in ``account`` with bc-pki, afresh: those to
    cut off (a certificate bc-pki says is not valid, does not know, or knows as another
    certificate than the one the connection showed). None when the leaf or bc-pki cannot be
    asked now (the next sweep tries again)."""
    conns = await connections(nc, server_id, account, log)
    if conns is None:
        return None
    by_cert: dict[str, list[dict[str, Any]]] = {}
    for conn in conns:
        cert_id = cert_id_of_user(str(conn.get("authorized_user") or ""))
        if cert_id is not None:  # an agent (joining connections and the responder have none)
            by_cert.setdefault(cert_id, []).append(conn)
    cut: list[Swept] = []
    for cert_id, held in by_cert.items():
        try:
            info = await pki.get_certificate(cert_id=cert_id)
        except BcError as err:
            if err.code is not ErrorCode.NOT_FOUND:
                log.warning("sweep_pki_unreachable", code=err.code.value)
                return None
            cut.extend(Swept(cert_id, server_id, int(c["cid"]), "unknown") for c in held)
            continue
        shown = _der_sha256(info.certificate_pem)
        for conn in held:
            if info.state != "valid":
                cut.append(Swept(cert_id, server_id, int(conn["cid"]), info.state))
            elif _cert_sha256(conn) != shown:
                cut.append(Swept(cert_id, server_id, int(conn["cid"]), "other-certificate"))
    log.info("sweep_done", connections=len(conns), certificates=len(by_cert), cut_off=len(cut))
    return cut


async def sweeps(
    sweep_once: Callable[[], Awaitable[list[Swept] | None]],
    cut: Callable[[Swept], Awaitable[None]],
    *,
    wanted: asyncio.Event,
    stop: asyncio.Event,
    period: float,
    log: Any,
) -> None:
    """Sweep whenever ``wanted`` is set (the start, a reconnect) and every ``period`` seconds,
    until ``stop``; ``cut`` each connection a sweep finds. A sweep that could not ask (the leaf's
    link or bc-pki away, when revocation events are lost too) is tried again after
    ``SWEEP_RETRY_S``, not at the next period."""
    wait = 0.0
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                await wanted.wait()
        wanted.clear()
        if stop.is_set():
            return
        wait = min(SWEEP_RETRY_S, period)
        try:
            found = await sweep_once()
        except Exception as exc:  # never the end of the responder: the next sweep
            log.warning("sweep_failed", error=type(exc).__name__)
            continue
        if found is None:
            continue
        wait = period
        for conn in found:
            await cut(conn)


def _server_id(nc: Any) -> str:
    return str(getattr(nc, "_server_info", {}).get("server_id") or "")


def _tls(config: CalloutConfig) -> ssl.SSLContext:
    tls = tls_context(config.nats_ca)
    try:
        tls.load_cert_chain(config.cert_file, config.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise _bad("cert_file", f"cannot load {config.cert_file} with {config.key_file}: {exc}") from exc
    return tls


async def run(config: CalloutConfig, *, stop: asyncio.Event | None = None) -> None:
    """Answer the leaf's auth callout until ``stop`` (SIGTERM, SIGINT) is set."""
    log = get_logger(service="bc-pki-callout", site_id=config.site_id)
    stop = stop or asyncio.Event()
    issuer_seed, password, pki_ca, bus_ca = _secrets(config)
    subjects = Subjects(root=config.subject_root)
    wanted = asyncio.Event()  # a sweep is due: at the start, and after each reconnect
    wanted.set()

    async def reconnected() -> None:
        log.info("leaf_reconnected")
        wanted.set()

    nc = await connect_waiting(
        config.nats_url,
        name=f"bc-pki-callout:{config.site_id}",
        log=log,
        stop=stop,
        tls=_tls(config),
        user=config.user,
        password=password,
        inbox_prefix=service_inbox_prefix("callout"),
        reconnected_cb=reconnected,
    )
    try:
        pki = PkiClient(ApiClient(nc, subjects))
        revocations = Revocations(
            pki,
            fresh=config.cache_seconds,
            stale=config.stale_seconds,
            log=log,
        )
        connections = Connections()
        kicks: set[asyncio.Task[None]] = set()

        def admitted(conn: Admitted) -> None:
            connections.admitted(conn)
            log.info("agent_admitted", agent_id=conn.agent.agent_id, client_id=conn.client_id)

        responder = CalloutResponder(
            ca_pem=pki_ca,
            issuer_seed=issuer_seed,
            site_id=config.site_id,
            account=config.account,
            revoked=revocations.revoked,
            subjects=subjects,
            js_api=config.js_api,
            bus_ca_pem=bus_ca,
            admitted=admitted,
            log=log,
        )

        async def on_cert_event(msg: Any) -> None:
            event = decode_cert_event(msg.data)
            if not isinstance(event, CertRevoked):
                return
            revocations.heard_revoked(event.cert_id)
            task = asyncio.create_task(cut_off(event.cert_id))
            kicks.add(task)
            task.add_done_callback(kicks.discard)

        async def cut_off(cert_id: str) -> None:
            known = connections.take(cert_id)
            for server_id, client_id in known:  # the ones it let in: at once
                await _kick(nc, server_id, client_id, log)
            # and any it let in before a restart, as the leaf knows them by their certificate
            server_id = _server_id(nc)
            try:
                pem = (await pki.get_certificate(cert_id=cert_id)).certificate_pem
            except BcError as err:
                log.warning("revoked_certificate_unknown", cert_id=cert_id, code=err.code.value)
                return
            for conn in await holding(nc, server_id, config.account, _der_sha256(pem), log):
                if conn not in known:
                    await _kick(nc, *conn, log)

        async def sweep_once() -> list[Swept] | None:
            return await sweep(nc, pki, _server_id(nc), config.account, log)

        async def cut(found: Swept) -> None:
            if found.why == "revoked":
                revocations.heard_revoked(found.cert_id)
            log.info("sweep_cuts_off", cert_id=found.cert_id, why=found.why)
            await _kick(nc, found.server_id, found.client_id, log)

        await nc.subscribe(subjects.events_all("cert"), cb=on_cert_event)
        await responder.start(nc)
        log.info("callout_answering", subject=AUTH_SUBJECT, issuer=responder.issuer)
        sweeping = asyncio.create_task(
            sweeps(sweep_once, cut, wanted=wanted, stop=stop, period=config.sweep_seconds, log=log),
            name="callout-sweep",
        )
        await stop.wait()
        sweeping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeping
    finally:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5):
                await nc.close()
    log.info("callout_stopped")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bc-pki callout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="callout.toml")
    parser.add_argument("--log-level", default=os.environ.get("BC_LOG_LEVEL", "info"))
    args = parser.parse_args(argv)
    configure_logging(level=args.log_level)
    try:
        config = load_config(args.config)
        _tls(config)
        _secrets(config)
    except BcError as err:
        print(f"bc-pki callout: {err}", file=sys.stderr)
        raise SystemExit(2) from None

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run(config, stop=stop)

    try:
        asyncio.run(serve())
    except BcError as err:
        get_logger(service="bc-pki-callout").error("callout_failed", code=err.code.value, error=err.message)
        raise SystemExit(1) from None
