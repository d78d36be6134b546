"""Shard leases: each engine process owns some shards of the reconciler keys.

A lease lasts ``LEASE_TTL`` seconds and is renewed every ``RENEW_EVERY``; taking a
shard bumps its epoch, and every settle checks (shard, owner, epoch) in its own
transaction, so a process that lost a lease (paused, partitioned) cannot settle
anything afterwards. When a process dies its leases expire and the others take its
shards on their next round: within LEASE_TTL + RENEW_EVERY (< 10 s).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

from .queue import SHARDS

__all__ = ["LEASE_TTL", "RENEW_EVERY", "ShardLeases"]

LEASE_TTL = 6.0
RENEW_EVERY = 1.5


class ShardLeases:
    def __init__(
        self,
        db: Any,
        instance: str,
        *,
        on_gained: Callable[[set[int]], None],
        on_lost: Callable[[set[int]], None],
        log: Any,
    ) -> None:
        self.db = db
        self.instance = instance
        self.epochs: dict[int, int] = {}
        self.on_gained = on_gained
        self.on_lost = on_lost
        self.log = log

    def owns(self, shard: int) -> int | None:
        """The epoch under which this process holds ``shard``, or None."""
        return self.epochs.get(shard)

    async def round(self) -> None:
        async with self.db.transaction() as conn:
            await conn.execute(
                "INSERT INTO members (instance, expires_at)"
                " VALUES ($1, now() + make_interval(secs => $2))"
                " ON CONFLICT (instance) DO UPDATE SET expires_at = EXCLUDED.expires_at",
                self.instance,
                LEASE_TTL,
            )
            members = await conn.fetchval("SELECT count(*) FROM members WHERE expires_at > now()")
            renewed = await conn.fetch(
                "UPDATE shard_leases SET expires_at = now() + make_interval(secs => $2)"
                " WHERE owner = $1 AND expires_at > now() RETURNING shard, epoch",
                self.instance,
                LEASE_TTL,
            )
        held = {r["shard"]: r["epoch"] for r in renewed if self.epochs.get(r["shard"]) == r["epoch"]}
        lost = set(self.epochs) - set(held)
        target = math.ceil(SHARDS / max(1, int(members)))
        gained: dict[int, int] = {}
        if len(held) < target:
            async with self.db.transaction() as conn:
                rows = await conn.fetch(
                    "UPDATE shard_leases SET owner = $1, epoch = epoch + 1,"
                    " expires_at = now() + make_interval(secs => $3)"
                    " WHERE shard IN (SELECT shard FROM shard_leases"
                    "   WHERE owner IS NULL OR expires_at <= now()"
                    "   ORDER BY shard LIMIT $2 FOR UPDATE SKIP LOCKED)"
                    " RETURNING shard, epoch",
                    self.instance,
                    target - len(held),
                    LEASE_TTL,
                )
            gained = {r["shard"]: r["epoch"] for r in rows}
        elif len(held) > target:
            # Give back the surplus so a newcomer gets its share.
            extra = sorted(held)[target:]
            await self.db.execute(
                "UPDATE shard_leases SET owner = NULL, expires_at = now()"
                " WHERE owner = $1 AND shard = ANY($2::int[])",
                self.instance,
                extra,
            )
            for s in extra:
                held.pop(s)
            lost |= set(extra)
        self.epochs = {**held, **gained}
        if lost:
            self.log.info("shards_lost", shards=sorted(lost))
            self.on_lost(lost)
        if gained:
            self.log.info("shards_gained", shards=sorted(gained), members=int(members))
            self.on_gained(set(gained))

    async def run(self) -> None:
        while True:
            try:
                await self.round()
            except (TimeoutError, OSError) as exc:
                # The database is away: our leases will lapse and fencing keeps us safe.
                self.log.warning("shard_round_failed", error=type(exc).__name__)
            await asyncio.sleep(RENEW_EVERY)

    async def release_all(self) -> None:
        if self.epochs:
            await self.db.execute(
                "UPDATE shard_leases SET owner = NULL, expires_at = now() WHERE owner = $1",
                self.instance,
            )
            await self.db.execute("DELETE FROM members WHERE instance = $1", self.instance)
            self.epochs = {}
