"""Fixtures for tests that stop, kill and restart the servers: a private nats-server and
PostgreSQL per test (the session's servers are shared by every test and must stay up)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio

from better_compute.config import Settings
from better_compute.service import ApiClient, connect
from better_compute.testing import ServiceProcesses
from better_compute.wire import Subjects
from chaos_stack import FAST, PrivateServers, Stack
from engine_test_app import create_tables


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[PrivateServers]:
    srv = PrivateServers(tmp_path / "servers")
    yield srv
    srv.close()


@pytest_asyncio.fixture(loop_scope="session")
async def stack(
    servers: PrivateServers, bc_processes: ServiceProcesses, bc_settings: Settings, tmp_path: Path
) -> AsyncIterator[Stack]:
    settings = msgspec.structs.replace(
        bc_settings,
        nats_url=servers.nats_url,
        database_url=servers.database_url,
        app="engine_test_app:app",
    )
    await create_tables(servers.database_url)
    bc_processes.settings = settings
    bc_processes.extra_env.update(FAST)
    nc = await connect(servers.nats_url, name="bc-test")
    api = ApiClient(nc, Subjects(root=settings.subject_root))
    s = Stack(servers, bc_processes, api, tmp_path)
    try:
        yield s
    finally:
        s.close_agents()
        await nc.close()


# The engine alone as processes on the session's servers (test_restarts, test_engine_crashes).


@pytest.fixture
def settings(bc_settings: Settings) -> Settings:
    return msgspec.structs.replace(bc_settings, app="engine_test_app:app")


@pytest.fixture
def procs(settings: Settings, bc_processes: ServiceProcesses) -> ServiceProcesses:
    bc_processes.settings = settings
    return bc_processes
