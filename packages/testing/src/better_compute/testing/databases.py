"""A migrated template database, cloned for every test (``CREATE DATABASE … TEMPLATE``)."""

from __future__ import annotations

import importlib.util
import itertools
import os
from collections.abc import Iterable

import asyncpg

from ..service.db import apply_migrations, load_migrations
from .servers import with_database

__all__ = ["DEFAULT_SCHEMAS", "DatabaseFactory"]

# schema -> migrations package, for every service whose package is installed
DEFAULT_SCHEMAS: dict[str, str] = {
    "engine": "bc_engine.migrations",
    "cmdq": "bc_command_queue.migrations",
    "pki": "bc_pki.migrations",
    "secrets": "bc_secrets.migrations",
}


class DatabaseFactory:
    """Makes one migrated template, then a fresh clone of it per test."""

    def __init__(self, admin_url: str, *, schemas: dict[str, str] | None = None) -> None:
        self.admin_url = admin_url
        self.schemas = {
            schema: pkg
            for schema, pkg in (schemas or DEFAULT_SCHEMAS).items()
            if importlib.util.find_spec(pkg.split(".")[0]) is not None
        }
        self.prefix = f"bct{os.getpid()}"
        self.template = f"{self.prefix}_template"
        self._n = itertools.count(1)

    async def _admin(self) -> asyncpg.Connection:
        return await asyncpg.connect(with_database(self.admin_url, "postgres"))

    async def create_template(self) -> None:
        admin = await self._admin()
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{self.template}"')
            await admin.execute(f'CREATE DATABASE "{self.template}"')
        finally:
            await admin.close()
        conn = await asyncpg.connect(with_database(self.admin_url, self.template))
        try:
            for schema, pkg in self.schemas.items():
                await apply_migrations(conn, schema, load_migrations(pkg))
        finally:
            await conn.close()

    async def clone(self) -> str:
        """A new database from the template; returns its URL."""
        name = f"{self.prefix}_{next(self._n)}"
        admin = await self._admin()
        try:
            await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{self.template}"')
        finally:
            await admin.close()
        return with_database(self.admin_url, name)

    async def drop(self, names: Iterable[str]) -> None:
        admin = await self._admin()
        try:
            for name in names:
                await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()
