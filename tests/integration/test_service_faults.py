"""The service skeleton under transient faults: side loops and requests that meet a server
outage, and a start while NATS is down (real nats-server and PostgreSQL)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, ClassVar

import asyncpg
import msgspec
import pytest

from better_compute.config import Settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.runtime.embedded import EmbeddedNats
from better_compute.service import ApiClient, ApiRequest, Handler, Service, connect
from better_compute.service.client import CONNECT_TRIES
from better_compute.testing import until
from better_compute.wire import Subjects


class FlakyService(Service):
    """A side loop and a route that fail the way a dropped database connection does."""

    name: ClassVar[str] = "bc-flaky"
    api_name: ClassVar[str] = "flaky"

    def __init__(
        self, settings: Settings, *, loop_failures: int = 2, failure: BaseException | None = None
    ) -> None:
        super().__init__(settings)
        self.loop_runs = 0
        self.loop_failures = loop_failures
        self.failure = failure or ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 5432)")

    def routes(self) -> dict[str, Handler]:
        return {"store.read": self.read}

    async def read(self, _req: ApiRequest) -> None:
        raise asyncpg.exceptions.ConnectionDoesNotExistError(
            "connection was closed in the middle of operation"
        )

    def side_loops(self) -> dict[str, Any]:
        async def poll() -> None:
            self.loop_runs += 1
            if self.loop_runs <= self.loop_failures:
                raise self.failure
            await asyncio.Event().wait()

        return {"poll": poll}


async def test_a_side_loop_failing_on_an_outage_starts_again_and_the_service_stays(
    bc_settings: Settings,
) -> None:
    async with FlakyService(bc_settings) as svc:
        run = asyncio.create_task(svc.run())
        await until(lambda: svc.loop_runs == 3 or run.done())
        assert not run.done()  # the service still runs …
        assert svc.loop_runs == 3  # … its loop failed twice and ran again after a backoff
        svc.request_stop()
        await asyncio.wait_for(run, 5)


async def _deadlock(settings: Settings) -> asyncpg.exceptions.DeadlockDetectedError:
    """A real deadlock: two transactions lock two rows in opposite orders; PostgreSQL rolls one
    back. Returns that one's error."""
    a = await asyncpg.connect(settings.database_url)
    b = await asyncpg.connect(settings.database_url)
    try:
        await a.execute("CREATE TABLE IF NOT EXISTS bc_test_deadlock (id int PRIMARY KEY)")
        await a.execute("INSERT INTO bc_test_deadlock VALUES (1), (2) ON CONFLICT DO NOTHING")
        ta, tb = a.transaction(), b.transaction()
        await ta.start()
        await tb.start()
        await a.execute("UPDATE bc_test_deadlock SET id = id WHERE id = 1")
        await b.execute("UPDATE bc_test_deadlock SET id = id WHERE id = 2")
        got = await asyncio.gather(
            a.execute("UPDATE bc_test_deadlock SET id = id WHERE id = 2"),
            b.execute("UPDATE bc_test_deadlock SET id = id WHERE id = 1"),
            return_exceptions=True,
        )
        for tx in (ta, tb):
            await tx.rollback()
        (err,) = [g for g in got if isinstance(g, BaseException)]
        assert isinstance(err, asyncpg.exceptions.DeadlockDetectedError), got
        return err
    finally:
        await a.close()
        await b.close()


async def test_a_side_loop_whose_transaction_postgresql_rolled_back_for_a_deadlock_runs_again(
    bc_settings: Settings,
) -> None:
    """Regression (10,000 machines, 2026-12-07): both command-queue instances' presence loops
    met a deadlock with the other's journal writes and stopped their services."""
    async with FlakyService(bc_settings, failure=await _deadlock(bc_settings)) as svc:
        run = asyncio.create_task(svc.run())
        await until(lambda: svc.loop_runs == 3 or run.done())
        assert not run.done()
        assert svc.loop_runs == 3
        svc.request_stop()
        await asyncio.wait_for(run, 5)


async def test_a_request_that_meets_an_outage_is_unavailable_not_internal(
    bc_settings: Settings, bc_api: ApiClient
) -> None:
    async with FlakyService(bc_settings) as svc:
        run = asyncio.create_task(svc.run())
        with pytest.raises(BcError) as err:
            await bc_api.call("flaky", "store.read", {})
        assert err.value.code is ErrorCode.UNAVAILABLE
        assert "try again" in err.value.message
        svc.request_stop()
        await asyncio.wait_for(run, 5)


async def test_a_service_started_while_nats_is_down_waits_and_then_serves(
    bc_settings: Settings, tmp_path: Path
) -> None:
    nats = EmbeddedNats(tmp_path)
    url = nats.start()
    nats.stop()
    port = int(url.rsplit(":", 1)[1])
    tries = 0

    async def hang_up(_r: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal tries
        tries += 1
        writer.close()  # something listens, but it is not a NATS server (yet)

    refuser = await asyncio.start_server(hang_up, "127.0.0.1", port, reuse_address=True)
    settings = msgspec.structs.replace(bc_settings, nats_url=url)
    svc = FlakyService(settings, loop_failures=0)
    starting = asyncio.create_task(svc.start())
    try:
        await until(lambda: tries >= 2 * CONNECT_TRIES + 1 or starting.done())
        assert not starting.done()  # it gave up on a connection and tried again, without exiting
        refuser.close()
        await refuser.wait_closed()
        assert nats.start() == url
        await asyncio.wait_for(starting, 15)
        nc = await connect(url, name="bc-test")
        try:
            health = await ApiClient(nc, Subjects(root=settings.subject_root)).call("flaky", "health.get")
            assert health["checks"]["nats"] is True
        finally:
            await nc.close()
    finally:
        refuser.close()
        await svc.stop()
        nats.stop()
