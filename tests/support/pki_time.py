"""Expiry without waiting: bc-pki compares stored times with the database's ``now()``, so a test
moves the stored expiry into the past instead of sleeping past it."""

from __future__ import annotations

import asyncpg

from better_compute.config import Settings

_EXPIRE = {
    "token": "UPDATE pki.join_tokens SET expires_at = now() - interval '1 second' WHERE id = $1",
    "certificate": "UPDATE pki.certificates SET not_after = now() - interval '1 second' WHERE id = $1",
}


async def expire(settings: Settings, what: str, ident: str) -> None:
    """Make join token or certificate ``ident`` (``what``: "token" or "certificate") expired now."""
    conn = await asyncpg.connect(settings.database_url)
    try:
        done = await conn.execute(_EXPIRE[what], ident)
    finally:
        await conn.close()
    assert done == "UPDATE 1", f"no {what} {ident}"
