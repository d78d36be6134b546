"""Shard leases: each engine process owns some shards of the reconciler keys.

A lease lasts ``LEASE_TTL`` seconds and is renewed every ``RENEW_EVERY``; taking a
shard bumps its epoch, and every settle checks (shard, owner, epoch) in its own
transaction, so a process that lost a lease (paused, partitioned) cannot settle
anything afterwards. When a process dies its leases expire and the others take its
shards on their next round: within LEASE_TTL + RENEW_EVERY (< 10 s).

The owner of a lease is a process *life*, ``<instance>#<incarnation>``: a supervisor
restarts an engine under the same instance name (``--instance %H``), and the new life
must neither renew the dead one's leases as if they were its own nor wait for them to
lapse. Incarnations are ordered by start time, so a life adopts at once (epoch bumped) the
leases and the membership of every earlier life of its name, and a life that finds a later
one of its name (it was paused, not dead) steps aside and holds nothing.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections.abc import Callable
from typing import Any

from better_compute.service.faults import is_transient

from .. import store
from .queue import SHARDS

__all__ = ["LEASE_TTL", "RENEW_EVERY", "ShardLeases", "new_incarnation"]

LEASE_TTL = 6.0
RENEW_EVERY = 1.5


def new_incarnation() -> str:
    """16 hex digits: the start time in milliseconds, then random bits; later lives sort later."""
    return f"{time.time_ns() // 1_000_000:012x}{secrets.token_hex(2)}"


class ShardLeases:
    def __init__(
        self,
        db: Any,
        instance: str,
        *,
        on_gained: Callable[[set[int]], None],
        on_lost: Callable[[set[int]], None],
        log: Any,
        incarnation: str | None = None,
    ) -> None:
        self.db = db
        self.instance = instance
        self.incarnation = incarnation or new_incarnation()
        self.owner = f"{instance}#{self.incarnation}"
        """What this life writes as the owner of its leases (and what its settles are fenced on)."""
        self.epochs: dict[int, int] = {}
        self.on_gained = on_gained
        self.on_lost = on_lost
        self.log = log
        self.superseded = False
        self._valid_until = 0.0  # monotonic: our leases lapse in the database by then at the latest

    def owns(self, shard: int) -> int | None:
        """The epoch under which this process holds ``shard``, or None.

        None also once the last renewal is older than the TTL (the database was away): the lease
        has lapsed there by now, so nothing new starts under it; the fence checks again anyway.
        """
        if time.monotonic() > self._valid_until:
            return None
        return self.epochs.get(shard)

    async def round(self) -> None:
        started = time.monotonic()
        prefix = f"{self.instance}#"
        async with self.db.transaction() as conn:
            later = await conn.fetchval(store.LATER_LIFE, self.owner, prefix)
            if later:
                adopted: dict[int, int] = {}
                members = 0
                renewed = []
            else:
                await conn.execute(store.MEMBER, self.owner, LEASE_TTL)
                await conn.execute(store.FORGET_EARLIER, self.owner, prefix)
                taken = await conn.fetch(store.ADOPT, self.owner, prefix, LEASE_TTL)
                adopted = {r["shard"]: r["epoch"] for r in taken}
                members = await conn.fetchval(store.LIVE_MEMBERS)
                renewed = await conn.fetch(store.RENEW, self.owner, LEASE_TTL)
        if later:
            self._step_aside()
            return
        self._valid_until = started + LEASE_TTL
        held = {r["shard"]: r["epoch"] for r in renewed if self.epochs.get(r["shard"]) == r["epoch"]}
        lost = set(self.epochs) - set(held)
        if adopted:
            self.log.info("shards_adopted", shards=sorted(adopted), owner=self.owner)
        target = math.ceil(SHARDS / max(1, int(members)))
        gained: dict[int, int] = dict(adopted)
        if len(held) + len(gained) < target:
            async with self.db.transaction() as conn:
                rows = await conn.fetch(
                    store.TAKE,
                    self.owner,
                    target - len(held) - len(gained),
                    LEASE_TTL,
                )
            gained.update({r["shard"]: r["epoch"] for r in rows})
        elif len(held) + len(gained) > target:
            # Give back the surplus so a newcomer gets its share.
            mine = {**held, **gained}
            extra = sorted(mine)[target:]
            await self.db.execute(store.GIVE_BACK, self.owner, extra)
            for s in extra:
                if held.pop(s, None) is not None:
                    lost.add(s)
                gained.pop(s, None)
        self.epochs = {**held, **gained}
        if lost:
            self.log.info("shards_lost", shards=sorted(lost))
            self.on_lost(lost)
        if gained:
            self.log.info("shards_gained", shards=sorted(gained), members=int(members))
            self.on_gained(set(gained))

    def _step_aside(self) -> None:
        """A later life of our name runs: we were paused, not dead. Hold nothing from now on."""
        if not self.superseded:
            self.log.warning("instance_superseded", owner=self.owner, instance=self.instance)
            self.superseded = True
        lost = set(self.epochs)
        self.epochs = {}
        if lost:
            self.on_lost(lost)

    async def run(self) -> None:
        failing_since: float | None = None
        while True:
            try:
                await self.round()
                if failing_since is not None:
                    self.log.info("shard_rounds_resumed", after_s=round(time.monotonic() - failing_since, 1))
                failing_since = None
            except Exception as exc:
                if not is_transient(exc):
                    raise
                # The database is away: our leases lapse and the fence keeps us safe; the next
                # round after it comes back takes shards again.
                if failing_since is None:
                    failing_since = time.monotonic()
                    self.log.warning("shard_round_failed", error=type(exc).__name__)
            await asyncio.sleep(RENEW_EVERY)

    async def release_all(self) -> None:
        """On a clean stop: hand every shard back at once and leave the members."""
        self.epochs = {}
        await self.db.execute(store.RELEASE_ALL, self.owner)
        await self.db.execute(store.LEAVE, self.owner)
