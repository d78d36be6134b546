"""Fixtures the integration tests share."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest_asyncio

from better_compute.config import Settings
from engine_test_app import TABLES


@pytest_asyncio.fixture(loop_scope="session")
async def db(bc_settings: Settings) -> AsyncIterator[asyncpg.Connection]:
    """A connection to the test database, with the test app's plugin tables made."""
    conn = await asyncpg.connect(bc_settings.database_url)
    await conn.execute(TABLES)
    yield conn
    await conn.close()
