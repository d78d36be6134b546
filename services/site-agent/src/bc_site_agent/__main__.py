"""``bc-site-agent --config site-agent.toml``: the agent an operator installs in each site.

On the first start it joins through bc-pki with the ``site`` join token read from
``join_token_file`` and keeps its key and certificate in ``state_dir/enrollment.json`` (0600);
later starts reuse them (the token is not read again). It then runs the agent SDK (at-most-once
journal in ``state_dir/journal.db``, signed events) with the BMC and boot-entry handlers, serves
network boot, the site cache and ``/healthz`` over HTTP, and stops cleanly on SIGTERM.
A NATS or bc-pki outage at start is waited out with a jittered backoff, never an exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from better_compute.agent import Agent, Enrollment, enroll, load_enrollment, save_enrollment
from better_compute.agent.bus import agent_options, joining_options
from better_compute.backoff import Backoff
from better_compute.clients.pki import PkiClient
from better_compute.clients.secrets import SecretsClient
from better_compute.core.errors import BcError, ErrorCode
from better_compute.logging import configure_logging, get_logger, register_secret
from better_compute.service.client import ApiClient, connect
from better_compute.service.loop import run_loop
from better_compute.wire import Subjects
from better_compute.wire.cmdq import AgentStatus

from . import __version__
from .cache import SiteCache
from .config import SiteAgentConfig, load_config
from .drivers import DRIVERS
from .handlers import SiteHandlers
from .http import make_app, metrics_app
from .media import MediaImages
from .netboot import BootEntries
from .relay import HttpRelay
from .reports import Reports
from .ssrf import AddressGuard

_WAIT_FOR = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT})


def _control_plane(config: SiteAgentConfig) -> list[str]:
    """Addresses never relayed to nor filled from: the configured ones and the NATS server's."""
    addresses = list(config.control_plane_addresses)
    host = urlsplit(config.nats_url.split(",")[0]).hostname
    if host:
        with contextlib.suppress(OSError):
            addresses += [str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)]
    return list(dict.fromkeys(a.split("%")[0] for a in addresses))


def _status(cache: SiteCache, site: SiteHandlers, failing: Sequence[tuple[str, float]]) -> AgentStatus:
    stats = cache.stats()
    # a BMC that fails now (tried again) is the last error until it answers again
    return AgentStatus(
        drivers=list(DRIVERS),
        cache_used_bytes=stats["usedBytes"],
        cache_max_bytes=stats["maxBytes"],
        cache_objects=stats["objects"],
        cache_pinned=stats["pinned"],
        last_error=failing[0][0] if failing else site.last_error,
        last_error_at_ms=int(failing[0][1] * 1000) if failing else site.last_error_at_ms,
    )


async def _enrollment(config: SiteAgentConfig, stop: asyncio.Event) -> Enrollment | None:
    log = get_logger(site_id=config.site_id)
    enrollment = load_enrollment(config.enrollment_file)
    if enrollment is None:
        if config.join_token_file is None:
            raise BcError(
                ErrorCode.INVALID_CONFIG, "not joined yet: set join_token_file", {"path": "join_token_file"}
            )
        try:
            token = config.join_token_file.read_text().strip()
        except OSError as exc:
            raise BcError(
                ErrorCode.INVALID_CONFIG,
                f"cannot read the join token file: {type(exc).__name__}",
                {"path": "join_token_file"},
            ) from exc
        register_secret(token)
        # it has no certificate yet: it joins as the site's joining identity (deploy/nats)
        nc = await _connect(
            config, stop, **joining_options(
                cert_file=_opt(config.join_cert_file), key_file=_opt(config.join_key_file), ca=config.nats_ca
            )
        )  # fmt: skip
        api = ApiClient(nc, Subjects(root=config.subject_root))
        backoff = Backoff(first=0.2, cap=5.0)
        try:
            while enrollment is None:
                enrollment = await _enroll_once(api, token, log)
                if enrollment is None:
                    if stop.is_set():
                        return None
                    await asyncio.sleep(backoff.next())
        finally:
            await nc.close()
        save_enrollment(config.enrollment_file, enrollment)
        log.info("joined", agent_id=enrollment.agent_id)
    if enrollment.site_id != config.site_id:
        raise BcError(
            ErrorCode.INVALID_CONFIG,
            f"this state folder belongs to site {enrollment.site_id}",
            {"path": "site_id"},
        )
    if enrollment.role != "site":
        raise BcError(
            ErrorCode.INVALID_CONFIG, "the join token was not a site token", {"path": "join_token_file"}
        )
    return enrollment


async def _enroll_once(api: ApiClient, token: str, log: Any) -> Enrollment | None:
    """One join; None when bc-pki is away for now (the caller waits and asks again)."""
    try:
        return await enroll(PkiClient(api), token=token)
    except BcError as err:
        if err.code not in _WAIT_FOR:
            raise
        log.info("join_waiting_for_pki", code=err.code.value)
        return None


def _opt(path: Path | None) -> str | None:
    return str(path) if path is not None else None


async def _connect(config: SiteAgentConfig, stop: asyncio.Event, **options: Any) -> Any:
    log = get_logger(site_id=config.site_id)
    options.setdefault("name", f"bc-site-agent:{config.site_id}")
    backoff = Backoff(first=0.2, cap=5.0)
    while True:
        try:
            return await connect(config.nats_url, **options)
        except BcError as err:
            if err.code not in _WAIT_FOR or stop.is_set():
                raise
            log.info("nats_waiting", code=err.code.value)
            await asyncio.sleep(backoff.next())


async def _close_clean(entries: BootEntries, reports: Reports, quiet_seconds: float) -> None:
    """Close the served node entries whose quiet period has passed, and confirm them to bc-pki
    (the holds are files: a restart picks up where this left off)."""
    log = get_logger(component="netboot")
    while True:
        try:
            for hold in entries.closed_clean(quiet_seconds):
                log.info("netboot_entry_closed_clean", mac=hold.mac, node_id=hold.node_id)
                reports.confirm(hold)
        except OSError as exc:  # a full or failing disk: try again at the next look
            log.warning("netboot_holds_failed", error=type(exc).__name__)
        await asyncio.sleep(min(1.0, quiet_seconds / 4))


async def run(config: SiteAgentConfig) -> None:
    log = get_logger(site_id=config.site_id)
    config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(config.state_dir, 0o700)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    enrollment = await _enrollment(config, stop)
    if enrollment is None:
        return
    # as itself: its certificate shown to NATS, replies under its own inbox (deploy/nats)
    nc = await _connect(config, stop, **agent_options(enrollment, ca=config.nats_ca))
    try:
        subjects = Subjects(root=config.subject_root)
        api = ApiClient(nc, subjects)
        entries = BootEntries(config.netboot_dir)
        control_plane = _control_plane(config)
        cache = SiteCache(
            config.cache_dir,
            max_bytes=config.cache_max_bytes,
            guard=AddressGuard(control_plane=control_plane, allow=config.cache_allow_source_networks),
        )
        public_url = config.public_url or f"http://{config.http_host}:{config.http_port}"
        media = MediaImages()
        site = SiteHandlers(
            secrets=SecretsClient(api),
            identity=enrollment.identity,
            entries=entries,
            cache=cache,
            public_url=public_url,
            relay=HttpRelay(control_plane=control_plane),
            media=media,
            bus_ca=_bus_ca(config),
            media_url=config.media_url,
            credentials_keep_s=config.bmc_credentials_keep_s,
        )
        agent = Agent(
            enrollment=enrollment,
            handlers=site.handlers(),
            journal=config.journal_file,
            nc=nc,
            subjects=subjects,
            version=__version__,
            status=lambda: _status(cache, site, agent.call_failures()),
        )

        def health() -> dict[str, Any]:
            # Anyone on the boot network reads this: whether the agent works, nothing more (no
            # boot entries, versions or errors: an entry count told an attacker when a node's
            # token was there to take). The rest is in its heartbeat (bcx agents list).
            return {
                "status": "ok" if agent.ready.is_set() and nc.is_connected else "degraded",
                "connected": bool(nc.is_connected),
                "ready": agent.ready.is_set(),
            }

        reports = Reports(PkiClient(api), enrollment.identity, config.netboot_dir / "reports")
        app = make_app(config, entries, cache, health, served_again=reports.burn, media=media)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        http_site = web.TCPSite(runner, config.http_host, config.http_port)
        await http_site.start()
        log.info("http_listening", host=config.http_host, port=config.http_port)
        metrics_runner: web.AppRunner | None = None
        if config.metrics_host is not None:
            metrics_runner = web.AppRunner(metrics_app(), access_log=None)
            await metrics_runner.setup()
            await web.TCPSite(metrics_runner, config.metrics_host, config.metrics_port).start()
            log.info("metrics_listening", host=config.metrics_host, port=config.metrics_port)
        side = [
            asyncio.create_task(reports.run(), name="boot-reports"),
            asyncio.create_task(_close_clean(entries, reports, config.quiet_seconds), name="boot-holds"),
        ]
        try:
            async with agent:
                run_task = asyncio.create_task(agent.run())
                stop_task = asyncio.create_task(stop.wait())
                await asyncio.wait({run_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
                agent.request_stop()
                await run_task
                stop_task.cancel()
        finally:
            for task in side:
                task.cancel()
            await asyncio.gather(*side, return_exceptions=True)
            await runner.cleanup()
            if metrics_runner is not None:
                await metrics_runner.cleanup()
            cache.close()
        log.info("site_agent_stopped")
    finally:
        if not nc.is_closed:
            await nc.close()


def _bus_ca(config: SiteAgentConfig) -> bytes | None:
    """The bus CA, for the token media (``bus-ca.pem`` beside the token)."""
    if not config.nats_ca:
        return None
    try:
        return Path(config.nats_ca).read_bytes()
    except OSError as exc:
        raise BcError(
            ErrorCode.INVALID_CONFIG, f"cannot read {config.nats_ca}: {exc.strerror}", {"path": "nats_ca"}
        ) from exc


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bc-site-agent", description=__doc__)
    parser.add_argument("--config", required=True, help="site-agent.toml")
    parser.add_argument("--log-level", default=os.environ.get("BC_LOG_LEVEL", "info"))
    args = parser.parse_args(argv)
    configure_logging(level=args.log_level)
    try:
        config = load_config(Path(args.config))
        run_loop(run(config))
    except BcError as err:
        print(f"bc-site-agent: {err}", file=sys.stderr)
        # 2: a bad config file or state folder, which a restart cannot fix (deploy/systemd)
        raise SystemExit(2 if err.code is ErrorCode.INVALID_CONFIG else 1) from None
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
