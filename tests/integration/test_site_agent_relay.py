"""site.httpProxy's SSRF checks: every refused target tried and refused, before any connection;
a redirect to a refused target refused; bounded body and time; poll waits for the node's API.
The node is a real HTTP server (aiohttp) on loopback; only there is loopback allowed."""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from aiohttp import web

from bc_site_agent.relay import MAX_BODY, HttpRelay
from better_compute.agent import CommandRejected
from better_compute.core.errors import BcError, ErrorCode
from better_compute.runtime.embedded import free_port
from better_compute.wire.commands import HttpProxy, decode_payload


def own_address() -> str | None:
    """This machine's primary non-loopback address (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(("192.0.2.1", 9))
            addr: str = sock.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


async def refusal(relay: HttpRelay, url: str, addresses: list[str] | None) -> str:
    payload = {"url": url, "method": "GET", "headers": {}, "poll": False}
    if addresses is not None:
        payload["nodeAddresses"] = addresses
    with pytest.raises(CommandRejected) as exc:
        await relay.request(decode_payload(payload, HttpProxy), deadline=time.time() + 5)
    return exc.value.reason


async def test_every_refused_target_is_refused_before_connecting() -> None:
    connects: list[object] = []

    def spy_local(ip: object) -> bool:  # never reached for targets refused earlier
        connects.append(ip)
        return False

    relay = HttpRelay(control_plane=["192.0.2.50"])
    assert "loopback" in await refusal(relay, "http://127.0.0.1:8080/", ["127.0.0.1"])
    assert "loopback" in await refusal(relay, "http://localhost:8080/", ["localhost"])
    assert "loopback" in await refusal(relay, "http://[::1]:8080/", ["::1"])
    assert "metadata" in await refusal(relay, "http://169.254.169.254/latest/meta-data/", ["169.254.169.254"])
    assert "link-local" in await refusal(relay, "http://169.254.10.1/", ["169.254.10.1"])
    assert "link-local" in await refusal(relay, "http://[fe80::1]/", ["fe80::1"])
    assert "unicast" in await refusal(relay, "http://0.0.0.0:80/", ["0.0.0.0"])
    assert "control-plane" in await refusal(relay, "http://192.0.2.50:4222/", ["192.0.2.50"])
    spying = HttpRelay(is_local=spy_local)
    assert "recorded addresses" in await refusal(spying, "http://192.0.2.60/", ["192.0.2.61"])
    assert "nodeAddresses" in await refusal(spying, "http://192.0.2.60/", None)
    mine = own_address()
    if mine is not None:
        assert "own address" in await refusal(relay, f"http://{mine}:8081/healthz", [mine])
    # a refused target is refused whatever the recorded addresses say, and nothing connected
    assert "metadata" in await refusal(spying, "http://169.254.169.254/", ["169.254.169.254"])
    # the command queue refuses it already; the relay checks again (a Struct built by hand)
    sneaked = HttpProxy(url="file:///etc/passwd", node_addresses=["x"])
    with pytest.raises(BcError) as bad:
        await relay.request(sneaked, deadline=time.time() + 5)
    assert bad.value.path == "url"


async def test_cloud_metadata_addresses_are_refused_even_when_listed_as_the_nodes() -> None:
    """Issue 23 L1: Alibaba's, Oracle's, AWS's IPv6 and Azure's metadata addresses passed when
    the command listed them as node addresses (only 169.254.0.0/16 was refused)."""
    connects: list[object] = []

    def spy_local(ip: object) -> bool:
        connects.append(ip)
        return False

    relay = HttpRelay(is_local=spy_local)
    for host in (
        "100.100.100.200",
        "192.0.0.192",
        "[fd00:ec2::254]",
        "168.63.129.16",
        "169.254.170.2",
        "[::ffff:169.254.169.254]",
        "[64:ff9b::a9fe:a9fe]",
    ):
        listed = host.strip("[]")
        assert "metadata" in await refusal(relay, f"http://{host}/latest/meta-data/", [listed]), host
    assert connects == []


@pytest_asyncio.fixture(loop_scope="session")
async def node() -> AsyncIterator[str]:
    flaky = {"left": 2}
    other_port = free_port()

    async def ok(_r: web.Request) -> web.Response:
        return web.Response(text="machine v1.2")

    async def same(_r: web.Request) -> web.Response:
        raise web.HTTPFound("/ok")

    async def metadata(_r: web.Request) -> web.Response:
        raise web.HTTPFound("http://169.254.169.254/latest/meta-data/")

    async def elsewhere(_r: web.Request) -> web.Response:
        raise web.HTTPFound(f"http://127.0.0.1:{other_port}/ok")

    async def big(_r: web.Request) -> web.Response:
        return web.Response(body=b"x" * (MAX_BODY + 10))

    async def booting(_r: web.Request) -> web.Response:
        if flaky["left"] > 0:
            flaky["left"] -= 1
            return web.Response(status=503, text="not yet")
        return web.Response(text="up")

    app = web.Application()
    app.add_routes(
        [
            web.get("/ok", ok),
            web.get("/same", same),
            web.get("/metadata", metadata),
            web.get("/elsewhere", elsewhere),
            web.get("/big", big),
            web.get("/booting", booting),
        ]
    )
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def relay_to(node: str, path: str, *, poll: bool = False, seconds: float = 10) -> dict[str, object]:
    relay = HttpRelay(allow_loopback=True, is_local=lambda _ip: False)
    payload = {
        "url": node + path,
        "method": "GET",
        "headers": {},
        "poll": poll,
        "nodeAddresses": ["127.0.0.1"],
    }
    return await relay.request(decode_payload(payload, HttpProxy), deadline=time.time() + seconds)


async def test_a_redirect_is_followed_only_to_the_same_origin(node: str) -> None:
    assert (await relay_to(node, "/ok"))["body"] == "machine v1.2"
    assert (await relay_to(node, "/same"))["body"] == "machine v1.2"
    for path, why in (("/metadata", "169.254.169.254"), ("/elsewhere", "elsewhere")):
        with pytest.raises(CommandRejected) as exc:
            await relay_to(node, path)
        assert why in exc.value.reason


async def test_body_and_time_are_bounded_and_poll_waits_for_the_api(node: str) -> None:
    with pytest.raises(BcError) as exc:
        await relay_to(node, "/big")
    assert exc.value.details["reason"] == "response-too-large"
    with pytest.raises(BcError) as exc:
        await relay_to(node, "/booting")  # no poll: the 503 is the end
    assert exc.value.code is ErrorCode.DRIVER_ERROR
    got = await relay_to(node, "/booting", poll=True)
    assert got["body"] == "up"
    dead = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(BcError) as exc:
        await relay_to(dead, "/ok", poll=True, seconds=2)
    assert time.monotonic() - t0 < 4
    assert "cannot reach the node" in exc.value.details["reason"]
