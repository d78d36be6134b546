"""PostgreSQL access for services: a pool, and numbered migrations applied at start.

Each service owns one schema; its migrations are ``NNNN_name.sql`` files in a package
folder, applied in order under an advisory lock (so instances starting together apply
each file once) and recorded in ``<schema>.schema_migrations``.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import logging
import re
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import asyncpg

from ..core.errors import BcError, ErrorCode
from .audit import AUDIT_TABLE
from .faults import describe, is_transient

__all__ = ["Database", "Migration", "apply_migrations", "load_migrations"]

CONNECT_TIMEOUT = 10.0  # seconds for one new connection (asyncpg's default is 60)
_NAME_RE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


class Migration:
    def __init__(self, version: int, name: str, sql: str) -> None:
        self.version = version
        self.name = name
        self.sql = sql


def load_migrations(package: str) -> list[Migration]:
    """The migration files of ``package`` (a folder of ``NNNN_name.sql``), in order."""
    found: list[Migration] = []
    for entry in importlib.resources.files(package).iterdir():
        m = _NAME_RE.match(entry.name)
        if m:
            found.append(Migration(int(m.group(1)), m.group(2), entry.read_text()))
    found.sort(key=lambda mig: mig.version)
    versions = [mig.version for mig in found]
    if len(set(versions)) != len(versions):
        raise BcError(ErrorCode.INVALID_CONFIG, "two migrations share a number", {"path": package})
    return found


async def apply_migrations(conn: Any, schema: str, migrations: list[Migration]) -> list[int]:
    """Apply what is missing; returns the versions applied now."""
    lock_key = zlib.crc32(f"bc-migrate:{schema}".encode())
    applied_now: list[int] = []
    await conn.execute("SELECT pg_advisory_lock($1)", lock_key)
    try:
        await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
        await conn.execute(
            f'CREATE TABLE IF NOT EXISTS "{schema}".schema_migrations ('
            " version int PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        await conn.execute(
            f'CREATE TABLE IF NOT EXISTS "{schema}".instances ('
            " instance text PRIMARY KEY, host text NOT NULL, pid int NOT NULL,"
            " version text NOT NULL, started_at timestamptz NOT NULL,"
            " last_seen timestamptz NOT NULL)"
        )
        await conn.execute(AUDIT_TABLE.format(schema=schema))
        done = {r["version"] for r in await conn.fetch(f'SELECT version FROM "{schema}".schema_migrations')}
        for mig in migrations:
            if mig.version in done:
                continue
            async with conn.transaction():
                await conn.execute(f'SET LOCAL search_path TO "{schema}", public')
                await conn.execute(mig.sql)
                await conn.execute(
                    f'INSERT INTO "{schema}".schema_migrations (version, name) VALUES ($1, $2)',
                    mig.version,
                    mig.name,
                )
            applied_now.append(mig.version)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", lock_key)
    return applied_now


class _OutageWithoutTraceback(logging.Filter):
    """asyncpg's pool logs a traceback each time it fails to reconnect its minimum of
    connections; during a PostgreSQL outage that is one line, not a stack, per try."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and is_transient(exc):
            record.msg = f"{record.msg} ({describe(exc)})"
            record.exc_info = None
        return True


logging.getLogger("asyncpg.pool").addFilter(_OutageWithoutTraceback())


async def _keep_session(_conn: Any) -> None:
    """Return a connection to the pool without asyncpg's reset query.

    The default reset (UNLISTEN, RESET ALL, advisory unlock …) costs a round trip on every
    release, which is most of a short query's cost. Services keep no session state: no
    LISTEN, no SET outside a transaction (``SET LOCAL`` only), advisory locks released
    explicitly, so there is nothing to reset.
    """


class Database:
    """An asyncpg pool whose connections see ``schema`` first on the search path."""

    def __init__(
        self,
        url: str,
        schema: str,
        *,
        min_size: int = 1,
        max_size: int = 10,
        init: Callable[[Any], Awaitable[None]] | None = None,
    ) -> None:
        self.url = url
        self.schema = schema
        self.min_size = min_size
        self.max_size = max_size
        self.init = init
        self._pool: Any = None

    async def open(self) -> None:
        try:
            self._pool = await asyncpg.create_pool(
                self.url,
                min_size=self.min_size,
                max_size=self.max_size,
                server_settings={"search_path": f'"{self.schema}", public'},
                init=self.init,
                reset=_keep_session,
                timeout=CONNECT_TIMEOUT,
            )
        except Exception as exc:
            if is_transient(exc):
                raise BcError(
                    ErrorCode.UNAVAILABLE, f"cannot reach PostgreSQL: {type(exc).__name__}"
                ) from exc
            if isinstance(exc, asyncpg.PostgresError):  # a wrong database, user or password
                raise BcError(
                    ErrorCode.INVALID_CONFIG,
                    f"PostgreSQL refused the connection: {type(exc).__name__}",
                    {"path": "database_url"},
                ) from exc
            raise

    async def migrate(self, migrations: list[Migration]) -> list[int]:
        async with self.pool.acquire() as conn:
            return await apply_migrations(conn, self.schema, migrations)

    @property
    def pool(self) -> Any:
        if self._pool is None:
            raise BcError(ErrorCode.INVALID_STATE, "database is not open")
        return self._pool

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        async with self.pool.acquire() as conn, conn.transaction():
            yield conn

    async def fetch(self, sql: str, *args: Any) -> list[Any]:
        return list(await self.pool.fetch(sql, *args))

    async def fetchrow(self, sql: str, *args: Any) -> Any:
        return await self.pool.fetchrow(sql, *args)

    async def fetchval(self, sql: str, *args: Any) -> Any:
        return await self.pool.fetchval(sql, *args)

    async def execute(self, sql: str, *args: Any) -> str:
        return str(await self.pool.execute(sql, *args))

    async def ping(self) -> bool:
        """Whether PostgreSQL answers within a couple of seconds."""
        try:
            async with asyncio.timeout(2.0):
                return bool(await self.pool.fetchval("SELECT true"))
        except Exception as exc:
            if is_transient(exc):
                return False
            raise

    async def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()
