"""The site cache: filled once from its source, verified, LRU-bounded, served with ranges over
the agent's own HTTP server (aiohttp on loopback), sources served by a plain HTTP server."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from bc_site_agent.cache import SiteCache
from bc_site_agent.config import load_config
from bc_site_agent.http import make_app
from bc_site_agent.netboot import BootEntries
from bc_site_agent.ssrf import AddressGuard
from better_compute.core.errors import BcError, ErrorCode
from better_compute.runtime.embedded import free_port

LOOPBACK_SOURCES = AddressGuard(allow=["127.0.0.1/32"])
"""The test's sources listen on 127.0.0.1 (an operator's ``allow_source_networks``)."""


@dataclass
class Source:
    blobs: dict[str, bytes]
    hits: list[str] = field(default_factory=list)
    redirects: dict[str, str] = field(default_factory=dict)
    server: ThreadingHTTPServer | None = None

    def url(self, name: str) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_port}/{name}"


@pytest.fixture
def source() -> Iterator[Source]:
    src = Source(
        blobs={n: bytes([i]) * size for i, (n, size) in enumerate([("a", 1000), ("b", 1000), ("c", 1500)])}
    )

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            name = self.path.lstrip("/")
            src.hits.append(name)
            if name in src.redirects:
                self.send_response(302)
                self.send_header("Location", src.redirects[name])
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if name == "secret":
                self.send_response(401)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            data = src.blobs.get(name)
            if data is None:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    src.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=src.server.serve_forever, daemon=True).start()
    yield src
    src.server.shutdown()
    src.server.server_close()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest_asyncio.fixture(loop_scope="session")
async def served(tmp_path: Path) -> AsyncIterator[tuple[SiteCache, str]]:
    port = free_port()
    cfg = tmp_path / "site-agent.toml"
    cfg.write_text(
        f'site_id = "s"\nnats_url = "nats://127.0.0.1:1"\nstate_dir = "{tmp_path}/state"\n'
        f'http_listen = "127.0.0.1:{port}"\n[cache]\nmax_bytes = 3000\n'
    )
    config = load_config(cfg)
    cache = SiteCache(config.cache_dir, max_bytes=config.cache_max_bytes, guard=LOOPBACK_SOURCES)
    runner = web.AppRunner(make_app(config, BootEntries(config.netboot_dir), cache, lambda: {"status": "ok"}))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield cache, f"http://127.0.0.1:{port}"
    await runner.cleanup()
    cache.close()


async def test_filled_once_verified_and_served_with_ranges(
    source: Source, served: tuple[SiteCache, str]
) -> None:
    cache, url = served
    a = source.blobs["a"]
    await asyncio.gather(*(cache.ensure(sha(a), source.url("a")) for _ in range(5)))
    await cache.ensure(sha(a), source.url("a"))
    assert source.hits == ["a"]  # five at once and one later: one download
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/cache/{sha(a)}") as resp:
            assert resp.status == 200
            assert await resp.read() == a
        async with http.get(f"{url}/cache/{sha(a)}", headers={"Range": "bytes=10-19"}) as resp:
            assert resp.status == 206
            assert await resp.read() == a[10:20]
        async with http.get(f"{url}/cache/{'0' * 64}") as resp:
            assert resp.status == 404


async def test_a_source_that_does_not_match_its_digest_is_never_stored(
    source: Source, served: tuple[SiteCache, str]
) -> None:
    cache, url = served
    with pytest.raises(BcError) as exc:
        await cache.ensure(sha(b"something else"), source.url("a"))
    assert exc.value.code is ErrorCode.DRIVER_ERROR
    assert exc.value.details["reason"] == "cache-source-error"
    assert cache.stats()["objects"] == 0
    assert [p.name for p in cache.objects.iterdir()] == []
    async with aiohttp.ClientSession() as http, http.get(f"{url}/cache/{sha(b'something else')}") as resp:
        assert resp.status == 404


async def test_lru_eviction_spares_pinned_and_recent_objects(
    source: Source, served: tuple[SiteCache, str]
) -> None:
    cache, _url = served
    a, b, c = source.blobs["a"], source.blobs["b"], source.blobs["c"]
    await cache.ensure(sha(a), source.url("a"), holder="netboot:52:54:00:aa:bb:01:kernel")
    await cache.ensure(sha(b), source.url("b"))
    await cache.ensure(sha(c), source.url("c"))  # 3500 > 3000: b (unpinned, least recent) goes
    assert cache.has(sha(a))
    assert not cache.has(sha(b))
    assert cache.has(sha(c))
    assert cache.used_bytes() <= 3000
    source.blobs["d"] = b"d" * 2500
    with pytest.raises(BcError) as exc:  # only c may go, and that is not enough
        await cache.ensure(sha(source.blobs["d"]), source.url("d"))
    assert exc.value.details["reason"] == "cache-full"
    assert cache.stats()["pinned"] == 1
    cache.release("netboot:52:54:00:aa:bb:01:", prefix=True)  # the entry was consumed
    await cache.ensure(sha(source.blobs["d"]), source.url("d"))  # now a may go too
    assert not cache.has(sha(a))
    assert cache.used_bytes() <= 3000


async def test_an_object_changed_on_disk_is_not_served(source: Source, tmp_path: Path) -> None:
    a = source.blobs["a"]
    cache = SiteCache(tmp_path / "cache", max_bytes=10_000, guard=LOOPBACK_SOURCES)
    await cache.ensure(sha(a), source.url("a"))
    cache.close()
    (tmp_path / "cache" / "objects" / sha(a)).write_bytes(b"x" + a[1:])
    again = SiteCache(tmp_path / "cache", max_bytes=10_000, guard=LOOPBACK_SOURCES)  # the next process life
    try:
        assert await again.open_for_serving(sha(a)) is None
        assert not again.has(sha(a))
        await again.ensure(sha(a), source.url("a"))  # filled again from the source
        assert await again.open_for_serving(sha(a)) is not None
    finally:
        again.close()


@pytest.mark.parametrize("discovery", [True, False])
async def test_an_unknown_mac_gets_discovery_only_when_the_site_has_it_on(
    tmp_path: Path, discovery: bool
) -> None:
    port = free_port()
    cfg = tmp_path / "site-agent.toml"
    cfg.write_text(
        f'site_id = "s"\nnats_url = "nats://127.0.0.1:1"\nstate_dir = "{tmp_path}/state"\n'
        f'http_listen = "127.0.0.1:{port}"\n[netboot]\ndiscovery = {str(discovery).lower()}\n'
        'discovery_kernel = "http://10.0.2.2:1/cache/discovery-kernel"\ndiscovery_cmdline = "bc.discover=1"\n'
        f'discovery_token_file = "{tmp_path}/discovery-token"\ndiscovery_control_plane = "nats://10.0.2.2:4222"\n'
    )
    token = "bcjt_" + "A" * 43
    (tmp_path / "discovery-token").write_text(token + "\n")
    config = load_config(cfg)
    cache = SiteCache(config.cache_dir, max_bytes=1000)
    runner = web.AppRunner(make_app(config, BootEntries(config.netboot_dir), cache, lambda: {"status": "ok"}))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/boot/mac/52-54-00-00-00-99") as resp:
                script = await resp.text()
            async with http.get(f"http://127.0.0.1:{port}/boot/mac/not-a-mac") as resp:
                assert resp.status == 400
    finally:
        await runner.cleanup()
        cache.close()
    assert script.startswith("#!ipxe")
    if discovery:
        # the site's discovery token, its site and the control plane ride on the kernel command line
        assert (
            "kernel http://10.0.2.2:1/cache/discovery-kernel bc.discover=1 bcd.site=s"
            f" bcd.token={token} bcd.control_plane=nats://10.0.2.2:4222\n"
        ) in script
    else:
        assert "kernel" not in script
        assert token not in script
        assert script.rstrip().endswith("exit")


async def _failure(cache: SiteCache, url: str, digest: str = "0" * 64) -> tuple[object, ...]:
    with pytest.raises(BcError) as exc:
        await cache.ensure(digest, url)
    err = exc.value
    return err.code, err.message, tuple(sorted(err.details.items()))


async def test_a_fill_never_reaches_loopback_link_local_or_cloud_metadata(
    source: Source, tmp_path: Path
) -> None:
    """Issue 23 L1: the fill fetched any URL (loopback included) and followed any redirect; it
    now has site.httpProxy's guard, checked again at every redirect, before any connection."""
    local = SiteCache(tmp_path / "default", max_bytes=10_000)  # what the process has by default
    a = source.blobs["a"]
    refused = [
        source.url("a"),  # loopback
        f"http://localhost:{source.url('a').rsplit(':', 1)[1]}",
        "http://169.254.169.254/latest/meta-data/",
        "http://[fd00:ec2::254]/latest/meta-data/",
        "http://100.100.100.200/latest/meta-data/",
        "http://192.0.0.192/opc/v2/instance/",
        "http://168.63.129.16/machine",
        "http://[::ffff:169.254.169.254]/",
        "http://[fe80::1]/",
        "http://0.0.0.0/",
    ]
    for url in refused:
        await _failure(local, url, sha(a))
    assert source.hits == []
    assert local.stats()["objects"] == 0
    # an allowed source that redirects to a refused one: the redirect is not followed
    cache = SiteCache(tmp_path / "allowed", max_bytes=10_000, guard=LOOPBACK_SOURCES)
    port = source.url("a").rsplit(":", 1)[1].split("/")[0]
    source.redirects.update(
        {"to-metadata": "http://169.254.169.254/latest/meta-data/", "to-loopback": f"http://127.0.0.2:{port}/a",
         "to-a": "/a"}
    )  # fmt: skip
    for name in ("to-metadata", "to-loopback"):
        await _failure(cache, source.url(name), sha(a))
    assert "a" not in source.hits  # 127.0.0.2 is this host's loopback too: never asked
    await cache.ensure(sha(a), source.url("to-a"))  # a redirect to an allowed place is followed
    assert source.hits[-1] == "a"


async def test_every_failed_fill_looks_the_same(source: Source, tmp_path: Path) -> None:
    """A fill is no port scanner: a refused address, a closed port, an HTTP 401, a 404 and a 200
    with other bytes are one and the same error (the agent's log keeps which)."""
    cache = SiteCache(tmp_path / "cache", max_bytes=10_000, guard=LOOPBACK_SOURCES)
    closed = free_port()
    got = {
        await _failure(cache, "http://127.0.0.2/a"),  # refused by the guard
        await _failure(cache, f"http://127.0.0.1:{closed}/a"),  # nothing listens
        await _failure(cache, source.url("secret")),  # 401
        await _failure(cache, source.url("nothing")),  # 404
        await _failure(cache, source.url("a")),  # 200, other bytes
        await _failure(cache, "http://no-such-host.invalid/a"),
    }
    assert len(got) == 1, got
    ((code, message, details),) = got
    assert code is ErrorCode.DRIVER_ERROR
    assert dict(details) == {"reason": "cache-source-error", "path": "url"}
    assert "401" not in str(message)
    assert "refused" not in str(message).lower()
