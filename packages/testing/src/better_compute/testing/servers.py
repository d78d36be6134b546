"""Test servers: one nats-server and one PostgreSQL for a whole test session.

Backends, chosen by ``BC_TEST_BACKEND``:

* ``embedded`` (default): the wheels' servers under a temporary folder;
* ``external``: ``BC_NATS_URL`` / ``BC_DATABASE_URL`` (also used whenever they are set);
* ``testcontainers``: Docker containers, only where a Docker engine answers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from ..core.errors import BcError, ErrorCode
from ..runtime.embedded import EmbeddedNats, EmbeddedPostgres
from .guard import unwatch, watch

__all__ = ["TestServers", "test_servers", "with_database"]


@dataclass(frozen=True)
class TestServers:
    __test__ = False  # not a test class, whatever pytest thinks of the name

    nats_url: str
    database_url: str  # the admin database; tests get clones, never this one
    backend: str


def with_database(url: str, database: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{database}", parts.query, parts.fragment))


@contextlib.contextmanager
def test_servers() -> Iterator[TestServers]:
    backend = os.environ.get("BC_TEST_BACKEND", "embedded")
    if backend == "testcontainers":
        with _containers() as servers:
            yield servers
        return
    nats_url = os.environ.get("BC_NATS_URL") or None
    db_url = os.environ.get("BC_DATABASE_URL") or None
    if backend == "external" and not (nats_url and db_url):
        raise BcError(
            ErrorCode.INVALID_CONFIG,
            "BC_TEST_BACKEND=external needs BC_NATS_URL and BC_DATABASE_URL",
            {"path": "BC_TEST_BACKEND"},
        )
    state = Path(tempfile.mkdtemp(prefix="bc-test-"))
    nats = pg = None
    pids: list[int] = []  # stopped with the run, even a SIGKILLed one (guard.watch)
    try:
        if nats_url is None:
            nats = EmbeddedNats(state)
            nats_url = nats.start()
            pids.append(_watched(nats.running_pid()))
        if db_url is None:
            # fsync off: a test cluster is thrown away, and durability is not under test here
            pg = EmbeddedPostgres(state, durable=False, database="postgres")
            db_url = pg.start()
            pids.append(_watched(pg.running_pid()))
        yield TestServers(
            nats_url=nats_url,
            database_url=db_url,
            backend="embedded" if nats or pg else "external",
        )
    finally:
        if nats is not None:
            nats.stop()
        if pg is not None:
            pg.stop()
        for pid in pids:
            unwatch(pid)
        shutil.rmtree(state, ignore_errors=True)


def _watched(pid: int | None) -> int:
    if pid is None:
        raise BcError(ErrorCode.UNAVAILABLE, "an embedded server stopped as soon as it started")
    watch(pid)
    return pid


@contextlib.contextmanager
def _containers() -> Iterator[TestServers]:
    try:
        from testcontainers.core.container import DockerContainer
        from testcontainers.postgres import PostgresContainer
    except ImportError as exc:
        raise BcError(
            ErrorCode.UNAVAILABLE,
            "BC_TEST_BACKEND=testcontainers needs the testcontainers group: uv sync --group testcontainers",
        ) from exc
    nats_c = DockerContainer("nats:2.11").with_command("-js").with_exposed_ports(4222)
    pg_c = PostgresContainer("postgres:16", username="postgres", password="postgres")
    with nats_c, pg_c:
        nats_url = f"nats://{nats_c.get_container_host_ip()}:{nats_c.get_exposed_port(4222)}"
        raw = pg_c.get_connection_url().replace("postgresql+psycopg2://", "postgresql://")
        yield TestServers(nats_url=nats_url, database_url=raw, backend="testcontainers")
