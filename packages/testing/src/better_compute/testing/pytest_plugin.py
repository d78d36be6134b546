"""pytest fixtures for Better Compute and its plugins' suites.

Enable with ``-p better_compute.testing.pytest_plugin``. One nats-server and one
PostgreSQL serve the whole session; every test gets its own database (a clone of a
migrated template) and its own subject root, so tests never see each other. A test past its
time limit fails alone (``deadlines``).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from nats.aio.client import Client as Nats

from ..config import Settings
from ..logging import configure_logging
from ..service.client import ApiClient, connect
from ..wire import Subjects
from .databases import DatabaseFactory
from .deadlines import (  # noqa: F401 -- hooks: a timeout fails one test, never the run
    pytest_runtest_call,
    pytest_runtest_setup,
    pytest_runtest_teardown,
    pytest_timeout_cancel_timer,
    pytest_timeout_set_timer,
)
from .processes import ServiceProcesses
from .servers import TestServers, test_servers

_roots = itertools.count(1)


def pytest_configure(config: pytest.Config) -> None:
    """Services run in the test process log as they do in their own (redacted, plain
    tracebacks): structlog's defaults would render every local variable of a traceback, which
    is slow (seconds for one step failure) and could show a secret."""
    configure_logging(level="debug", json=False)


@pytest.fixture(autouse=True)
def _bc_logging_kept() -> Iterator[None]:
    """A test that runs a program's ``main`` in this process (``bcd join`` under ``capsys``)
    points structlog at that test's captured stream, which closes when the test ends: every
    later test in the process then failed on "I/O operation on closed file" at its first log
    line. The configuration is put back as it was after each test."""
    import structlog

    saved = structlog.get_config()
    yield
    if structlog.get_config() != saved:
        structlog.configure(**saved)


@pytest.fixture(scope="session")
def bc_servers() -> Iterator[TestServers]:
    """The session's nats-server and PostgreSQL."""
    with test_servers() as servers:
        yield servers


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def bc_database_factory(bc_servers: TestServers) -> AsyncIterator[DatabaseFactory]:
    factory = DatabaseFactory(bc_servers.database_url)
    await factory.create_template()
    yield factory
    await factory.drop([factory.template])


@pytest_asyncio.fixture(loop_scope="session")
async def bc_database_url(bc_database_factory: DatabaseFactory) -> AsyncIterator[str]:
    """A fresh, migrated database for this test."""
    url = await bc_database_factory.clone()
    yield url
    await bc_database_factory.drop([url.rsplit("/", 1)[1]])


@pytest.fixture
def bc_subjects() -> Subjects:
    """A subject root of this test's own (``t<pid>x<n>``)."""
    return Subjects(root=f"t{os.getpid()}x{next(_roots)}")


@pytest.fixture
def bc_settings(
    bc_servers: TestServers, bc_database_url: str, bc_subjects: Subjects, tmp_path: Path
) -> Settings:
    """Settings that point a service at this test's database and subject root."""
    return Settings(
        nats_url=bc_servers.nats_url,
        database_url=bc_database_url,
        subject_root=bc_subjects.root,
        state_dir=str(tmp_path / "state"),
        log_level="debug",
    )


@pytest_asyncio.fixture(loop_scope="session")
async def bc_nats(bc_servers: TestServers) -> AsyncIterator[Nats]:
    nc = await connect(bc_servers.nats_url, name="bc-test")
    yield nc
    await nc.close()


@pytest.fixture
def bc_api(bc_nats: Nats, bc_subjects: Subjects) -> ApiClient:
    """An API client on this test's subject root."""
    return ApiClient(bc_nats, bc_subjects)


@pytest.fixture
def bc_processes(bc_settings: Settings, tmp_path: Path) -> Iterator[ServiceProcesses]:
    """Start services as OS processes: ``bc_processes.start("bc-engine")``."""
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    procs = ServiceProcesses(bc_settings, log_dir)
    yield procs
    procs.close()
    # pytest shows this only for a failed test: the tail of what each service said
    for p in procs.procs:
        tail = p.output().splitlines()[-40:]
        print(f"--- {p.service} (pid {p.pid}) last {len(tail)} lines ---", *tail, sep="\n")
