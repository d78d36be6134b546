"""The reconciler work queue in PostgreSQL: one entry per key, the earliest time wins.

Every write that wants a key looked at (a new workflow, a verb, a finished child) bumps
``seq``; a reconciler pass only moves or removes the entry when ``seq`` is still what it
read at its start, so a wake-up that lands during a pass is never overwritten.
"""

from __future__ import annotations

import zlib
from typing import Any

from .. import store

__all__ = ["SHARDS", "done", "owner_key", "queue_at", "queue_now", "read_seq", "shard_of"]

SHARDS = 64  # also seeded by migration 0001; every engine process must agree


def shard_of(rkey: str) -> int:
    return zlib.crc32(rkey.encode()) % SHARDS


def owner_key(owner: str, workflow_id: str) -> str:
    return f"{owner}:{workflow_id}"


async def queue_now(conn: Any, rkey: str) -> None:
    """Ask for a pass of ``rkey`` at once (within the caller's transaction)."""
    await conn.execute(store.QUEUE_NOW, rkey, shard_of(rkey))


async def read_seq(conn: Any, rkey: str) -> int | None:
    seq = await conn.fetchval(store.QUEUE_SEQ, rkey)
    return int(seq) if seq is not None else None


async def queue_at(conn: Any, rkey: str, at: float, seen_seq: int | None) -> None:
    """After a pass: the next moment the key cares about, unless a wake came meanwhile."""
    if seen_seq is None:
        await conn.execute(store.QUEUE_NEW_AT, rkey, shard_of(rkey), at)
    else:
        await conn.execute(store.QUEUE_MOVE, rkey, at, seen_seq)


async def done(conn: Any, rkey: str, seen_seq: int | None) -> None:
    """After a pass that needs nothing more: drop the entry, unless a wake came meanwhile."""
    if seen_seq is not None:
        await conn.execute(store.QUEUE_DONE, rkey, seen_seq)
