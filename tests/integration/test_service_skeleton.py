"""The service skeleton on a real nats-server and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from typing import Any, ClassVar

import asyncpg
import msgspec
import pytest
from nats.aio.client import Client as Nats
from prometheus_client.parser import text_string_to_metric_families

from bc_engine.service import EngineService
from better_compute.config import Settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.service import ApiClient, ApiRequest, Handler, Service, discover
from better_compute.service.db import Migration, apply_migrations
from better_compute.testing import until


class _Echo(msgspec.Struct, kw_only=True):
    text: str
    delay: float = 0.0


class EchoService(Service):
    """A service of the test's own, to exercise the skeleton's request handling."""

    name: ClassVar[str] = "bc-echo"
    api_name: ClassVar[str] = "echo"

    def routes(self) -> dict[str, Handler]:
        return {"echo.say": self.say, "echo.boom": self.boom, "echo.refuse": self.refuse}

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.serving = 0
        """Requests being answered right now."""

    async def say(self, req: ApiRequest) -> dict[str, Any]:
        body = req.decode(_Echo)
        self.serving += 1
        await asyncio.sleep(body.delay)
        self.serving -= 1
        return {"text": body.text}

    async def boom(self, _req: ApiRequest) -> None:
        raise RuntimeError("secret internals")

    async def refuse(self, _req: ApiRequest) -> None:
        raise BcError("CONFLICT", "already there", {"path": "id"})


async def test_routes_answer_results_and_typed_errors(bc_settings: Settings, bc_api: ApiClient) -> None:
    async with EchoService(bc_settings):
        assert await bc_api.call("echo", "echo.say", {"text": "hi"}) == {"text": "hi"}
        with pytest.raises(BcError) as e:
            await bc_api.call("echo", "echo.say", {"text": 3})
        assert (e.value.code, e.value.path) == (ErrorCode.INVALID_INPUT, "text")
        with pytest.raises(BcError) as e:
            await bc_api.call("echo", "echo.say", b"{not json")
        assert e.value.code is ErrorCode.INVALID_INPUT
        with pytest.raises(BcError) as e:
            await bc_api.call("echo", "echo.boom")
        assert e.value.code is ErrorCode.INTERNAL
        assert "secret internals" not in e.value.message
        with pytest.raises(BcError) as e:
            await bc_api.call("echo", "echo.refuse")
        assert (e.value.code, e.value.path) == (ErrorCode.CONFLICT, "id")


async def test_slow_requests_do_not_serialise_the_process(bc_settings: Settings, bc_api: ApiClient) -> None:
    async with EchoService(bc_settings):
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        got = await asyncio.gather(
            *(bc_api.call("echo", "echo.say", {"text": str(i), "delay": 0.5}) for i in range(10))
        )
        elapsed = loop.time() - t0
    assert [g["text"] for g in got] == [str(i) for i in range(10)]
    # ten half-second requests one after another would take five seconds
    assert elapsed < 2.5


async def test_no_instance_is_unavailable(bc_api: ApiClient) -> None:
    with pytest.raises(BcError) as e:
        await bc_api.call("engine", "health.get", timeout=2)
    assert e.value.code is ErrorCode.UNAVAILABLE
    assert "bc-engine" in e.value.message


async def test_micro_discovery_health_and_migrations(
    bc_settings: Settings, bc_api: ApiClient, bc_nats: Nats
) -> None:
    async with EngineService(bc_settings) as svc:
        health = await bc_api.call("engine", "health.get")
        assert health["ok"] is True
        assert health["checks"] == {"nats": True, "postgres": True}
        found = await discover(bc_nats, root=bc_settings.subject_root)
        assert [d["name"] for d in found] == ["bc-engine"]
        assert found[0]["metadata"]["instance"] == svc.instance
        ping = await bc_nats.request("$SRV.PING.bc-engine." + found[0]["id"], b"", timeout=2)
        assert json.loads(ping.data)["name"] == "bc-engine"
        run = asyncio.create_task(svc.run())
        conn = await asyncpg.connect(bc_settings.database_url)
        try:
            row = await until(lambda: conn.fetchrow("SELECT instance, pid FROM engine.instances"), timeout=10)
        finally:
            await conn.close()
        assert row["instance"] == svc.instance
        svc.request_stop()
        await asyncio.wait_for(run, 5)


async def test_migrations_apply_once_under_concurrent_starts(bc_database_url: str) -> None:
    migs = [
        Migration(1, "things", "CREATE TABLE things (id int PRIMARY KEY)"),
        Migration(2, "seed", "INSERT INTO things VALUES (1)"),
    ]
    conns = [await asyncpg.connect(bc_database_url) for _ in range(4)]
    try:
        applied = await asyncio.gather(*(apply_migrations(c, "mig_test", migs) for c in conns))
        assert sorted(applied, key=len) == [[], [], [], [1, 2]]
        assert await conns[0].fetchval("SELECT count(*) FROM mig_test.things") == 1
        migs.append(Migration(3, "more", "INSERT INTO things VALUES (2)"))
        assert await apply_migrations(conns[0], "mig_test", migs) == [3]
    finally:
        for c in conns:
            await c.close()


async def test_a_failing_side_loop_stops_the_service(bc_settings: Settings) -> None:
    class Failing(EchoService):
        def side_loops(self) -> dict[str, Any]:
            async def broken() -> None:
                raise RuntimeError("loop broke")

            return {"broken": broken}

    async with Failing(bc_settings) as svc:
        with pytest.raises(ExceptionGroup):
            await asyncio.wait_for(svc.run(), 5)


async def test_stop_is_safe_twice_and_in_flight_requests_finish(
    bc_settings: Settings, bc_api: ApiClient
) -> None:
    svc = EchoService(bc_settings)
    await svc.start()
    pending = asyncio.create_task(bc_api.call("echo", "echo.say", {"text": "late", "delay": 0.5}))
    await until(lambda: svc.serving, timeout=5, interval=0.01, what="the request in flight")
    await svc.stop()
    await svc.stop()
    assert (await pending) == {"text": "late"}


async def test_http_health_endpoint_for_probes(bc_settings: Settings) -> None:
    from better_compute.runtime.embedded import free_port

    port = free_port()

    def get(path: str) -> tuple[int, str, bytes]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read()

    async with EngineService(msgspec.structs.replace(bc_settings, health_port=port)):
        status, content_type, body = await asyncio.to_thread(get, "/healthz")
        _, metrics_type, metrics = await asyncio.to_thread(get, "/metrics")
    assert (status, content_type) == (200, "application/json")
    health = json.loads(body)
    assert health["service"] == "bc-engine"
    assert health["checks"] == {"nats": True, "postgres": True}
    assert metrics_type.startswith("text/plain")
    families = {f.name for f in text_string_to_metric_families(metrics.decode())}
    assert "bc_workflows_running" in families
