"""The site agent's ``/media/<capability>`` route over real HTTP (issue 23, virtual media): the
BMC's address gets the token image once (a HEAD first does not count), another address gets
404 and burns the token, and so does a second fetch. The whole path with sushy-emulator:
tests/e2e/test_metal_boot_identity.py."""

from __future__ import annotations

import asyncio
import http.client
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from bc_site_agent.cache import SiteCache
from bc_site_agent.config import load_config
from bc_site_agent.http import make_app
from bc_site_agent.media import MediaImages, token_image
from bc_site_agent.netboot import BootEntries
from better_compute.runtime.embedded import free_port

pytestmark = pytest.mark.integration

TOKEN = "bcjt_" + "m" * 43


def _ask(port: int, cap: str, *, method: str = "GET", source: str = "127.0.0.1") -> tuple[int, int]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5, source_address=(source, 0))
    try:
        conn.request(method, f"/media/{cap}")
        resp = conn.getresponse()
        return resp.status, len(resp.read())
    finally:
        conn.close()


async def test_the_bmc_gets_the_image_once_and_every_other_ask_burns_it(tmp_path: Path) -> None:
    port = free_port()
    cfg = tmp_path / "site-agent.toml"
    cfg.write_text(
        f'site_id = "s"\nnats_url = "nats://127.0.0.1:1"\nstate_dir = "{tmp_path}/state"\n'
        f'http_listen = "127.0.0.1:{port}"\n'
    )
    config = load_config(cfg)
    cache = SiteCache(config.cache_dir, max_bytes=1000)
    media = MediaImages()
    burns: list[dict[str, Any]] = []
    app = make_app(config, BootEntries(config.netboot_dir), cache, lambda: {"status": "ok"},
                   served_again=burns.append, media=media)  # fmt: skip
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    image = token_image(TOKEN)

    def put() -> str:
        return media.put(
            image, allowed=frozenset({"127.0.0.1"}), not_after=4e9, token=TOKEN, node_id="n", mac=""
        )

    try:
        cap = put()
        assert await asyncio.to_thread(_ask, port, cap, method="HEAD") == (200, 0)  # a size check
        assert await asyncio.to_thread(_ask, port, cap) == (200, len(image))  # the BMC's fetch
        assert burns == []
        assert await asyncio.to_thread(_ask, port, cap) == (404, 9)  # again: nothing, and a burn
        assert [b["reason"] for b in burns] == ["boot-medium-fetched-twice"]
        # another address first: nothing for it, nor for the BMC after it; one burn
        other = put()
        assert (await asyncio.to_thread(_ask, port, other, source="127.0.0.2"))[0] == 404
        assert (await asyncio.to_thread(_ask, port, other, method="HEAD", source="127.0.0.2"))[0] == 404
        assert (await asyncio.to_thread(_ask, port, other))[0] == 404
        assert len(burns) == 2
        assert (await asyncio.to_thread(_ask, port, "f" * 32))[0] == 404  # unknown: no burn
        assert len(burns) == 2
    finally:
        await runner.cleanup()
        cache.close()
