"""The agent's HTTP side: network boot scripts, the site cache, ``/healthz`` (on the boot
network's listener), and ``/metrics`` on a listener of its own (``metrics_app``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from better_compute.core.errors import BcError, ErrorCode
from better_compute.logging import get_logger
from better_compute.service.metrics import CONTENT_TYPE, render

from .cache import SiteCache
from .config import SiteAgentConfig
from .media import MediaImages
from .netboot import (
    ALREADY_SERVED_SCRIPT,
    LOCAL_BOOT_SCRIPT,
    BootEntries,
    bus_cmdline,
    discovery_cmdline,
    discovery_script,
    entry_script,
    first_stage,
    normalize_mac,
)

__all__ = ["make_app", "metrics_app"]

_IPXE = "text/plain"


def _read(path: str | Path, key: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise BcError(ErrorCode.INVALID_CONFIG, f"cannot read {path}: {exc.strerror}", {"path": key}) from exc


def make_app(
    config: SiteAgentConfig,
    entries: BootEntries,
    cache: SiteCache,
    health: Callable[[], dict[str, Any]],
    served_again: Callable[[dict[str, Any]], None] = lambda _mark: None,
    media: MediaImages | None = None,
) -> web.Application:
    """The routes of the boot network's listener; ``served_again(mark)`` is told of each ask for
    a MAC whose one-time node entry was already served to another address or closed (the agent
    reports it to bc-pki), and of each ask for a token medium that burns it (``media``). No
    ``/metrics`` here: anyone on the boot network reaches this port."""
    log = get_logger(component="http")
    # the bus files bcd fetches (bcd.bus=, checked by the digest on the kernel line): the bus CA
    # and the site's joining certificate with its key, which lets a machine ask to join, no more
    bus_ca = _read(config.nats_ca, "nats_ca") if config.nats_ca else None
    joining = (
        _read(config.join_cert_file, "join_cert_file") + _read(config.join_key_file, "join_key_file")
        if config.join_cert_file and config.join_key_file
        else None
    )
    public_url = config.public_url or f"http://{config.http_host}:{config.http_port}"
    bus_words = bus_cmdline(public_url, bus_ca)

    async def bus_file(request: web.Request) -> web.Response:
        body = bus_ca if request.match_info["name"] == "ca.pem" else joining
        if body is None:
            return web.Response(status=404, text="not served here\n")
        return web.Response(body=body, content_type="application/x-pem-file")

    async def cached(request: web.Request) -> web.StreamResponse:
        sha = request.match_info["sha256"]
        path = await cache.open_for_serving(sha)
        if path is None:
            return web.Response(status=404, text="not in the site cache\n")
        log.info("cache_served", sha256=sha, range=request.headers.get("Range"))
        # FileResponse answers Range requests (206) and HEAD
        return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})

    async def healthz(_request: web.Request) -> web.Response:
        doc = health()
        return web.json_response(doc, status=200 if doc.get("status") == "ok" else 503)

    async def boot_ipxe(_request: web.Request) -> web.Response:
        return web.Response(text=first_stage(), content_type=_IPXE)

    async def boot_mac(request: web.Request) -> web.Response:
        try:
            mac = normalize_mac(request.match_info["mac"])
        except BcError:
            return web.Response(status=400, text="#!ipxe\necho bad MAC\nexit\n", content_type=_IPXE)
        served = entries.take(mac, source=request.remote or "")
        entry = served.entry
        if served.again is not None:
            # never the discovery ramdisk either: its token is no business of a node's MAC
            log.warning("netboot_entry_asked_again", mac=mac, served_mac=served.again.get("servedMac"))
            served_again(served.again)
            return web.Response(text=ALREADY_SERVED_SCRIPT, content_type=_IPXE)
        if served.local:
            log.info("netboot_local_boot_served", mac=mac, reason="booted again after its entry closed clean")
            return web.Response(text=LOCAL_BOOT_SCRIPT, content_type=_IPXE)
        if entry is not None and entry.one_time:
            cache.release(f"netboot:{mac}:", prefix=True)  # its kernel may go once it is served
        if entry is not None:
            log.info("netboot_entry_served", mac=mac, one_time=entry.one_time)
            return web.Response(text=entry_script(entry, extra=bus_words), content_type=_IPXE)
        if config.discovery:
            log.info("netboot_discovery_served", mac=mac)
            cmdline = discovery_cmdline(
                config.discovery_cmdline, site_id=config.site_id,
                token_file=config.discovery_token_file, control_plane=config.discovery_control_plane,
            )  # fmt: skip
            cmdline = f"{cmdline} {bus_words}".strip()
            script = discovery_script(config.discovery_kernel, config.discovery_initrd, cmdline)
            return web.Response(text=script, content_type=_IPXE)
        log.info("netboot_local_boot_served", mac=mac)
        return web.Response(text=LOCAL_BOOT_SCRIPT, content_type=_IPXE)

    async def medium(request: web.Request) -> web.Response:
        if media is None:
            return web.Response(status=404, text="not here\n")
        cap, source = request.match_info["cap"], request.remote or ""
        if request.method == "HEAD" and (body := media.peek(cap, source=source)) is not None:
            return web.Response(body=body, content_type="application/octet-stream")  # HEAD: no body sent
        taken = media.take(cap, source=source)
        if taken.burn is not None:
            log.warning("boot_medium_asked_again", source=(request.remote or "")[:64])
            served_again(taken.burn)
        if taken.body is None:
            return web.Response(status=404, text="not here\n")  # one answer, whatever the reason
        log.info("boot_medium_served")
        return web.Response(body=taken.body, content_type="application/octet-stream",
                            headers={"Content-Disposition": 'attachment; filename="bcboot.iso"'})  # fmt: skip

    app = web.Application()
    app.add_routes(
        [
            web.get("/healthz", healthz),
            web.get("/media/{cap:[0-9a-f]{32}}", medium),
            web.get("/boot.ipxe", boot_ipxe),
            web.get("/boot/mac/{mac}", boot_mac),
            web.get("/cache/{sha256}", cached),
            web.get("/bus/{name:ca\\.pem|join\\.pem}", bus_file),
        ]
    )
    return app


def metrics_app() -> web.Application:
    """``/metrics`` alone, for ``metrics_listen`` (loopback by default): the boot network's
    listener answers everyone, and the counters tell who boots when."""

    async def metrics_text(_request: web.Request) -> web.Response:
        return web.Response(body=render(), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics_text)])
    return app
