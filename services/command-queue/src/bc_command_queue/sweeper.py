"""The sweeper: the command queue's timed duties, safe to run in every instance at once.

It expires commands, hands silent agents' unclaimed commands to others, fails lost agents'
commands, dispatches what became dispatchable and publishes again what was not delivered; a
slower loop deletes finished commands past the retention. Each duty is one statement that
takes its rows with ``FOR UPDATE SKIP LOCKED``; events and deliveries go out after it committed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from better_compute.service.faults import Backoff, describe, is_transient

from .config import CmdqConfig
from .delivery import Changed, Deliveries
from .storage import Store

__all__ = ["DispatchPending", "Sweeper"]

_DISPATCH_BATCH = 200
_RETENTION_EVERY_S = 600.0

DispatchPending = Callable[..., Awaitable[int]]
"""``Sweeper.dispatch_pending``: dispatch what may go now (of one site, or of one batch)."""


class Sweeper:
    """Timed duties and the dispatch of pending commands.

    Args:
        connected: whether the service's NATS connection is up now (agents can reach us).
        clock: seconds for ``heard_for_ms`` (monotonic; a test gives its store's clock).
    """

    def __init__(
        self,
        *,
        store: Store,
        config: CmdqConfig,
        deliveries: Deliveries,
        changed: Changed,
        connected: Callable[[], bool],
        log: Any,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.config = config
        self.deliveries = deliveries
        self.changed = changed
        self.connected = connected
        self.log = log
        self.clock = clock
        """Seconds, only ever compared with itself (a test moves it)."""
        self._heard_since: float | None = None  # by clock; see heard_for_ms
        self.duties: list[Callable[[], Awaitable[object]]] = []
        """More timed duties, run after the sweep's own (publishing batches' expiries)."""

    async def run(self) -> None:
        """Sweep every ``sweep_ms``; a store or bus outage backs off and never ends the loop."""
        backoff = Backoff(first=self.config.sweep_ms / 1000, cap=5.0)
        while True:
            delay = self.config.sweep_ms / 1000
            try:
                await self.sweep()
                backoff.reset()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                self._heard_since = None
                delay = max(delay, backoff.next())  # a store or bus outage: fewer tries, fewer lines
                self.log.warning("sweep_failed", error=describe(exc), retry_in_s=round(delay, 2))
            await asyncio.sleep(delay)

    def heard_for_ms(self) -> float:
        """How long agents have been able to reach us without a break: NATS connected and the
        store answering (heartbeats need both). An agent counts as silent or lost only after it
        was silent that long while we could hear it, never because of our own outage."""
        now = self.clock()
        if not self.connected():
            self._heard_since = None
        elif self._heard_since is None:
            self._heard_since = now
        return 0.0 if self._heard_since is None else (now - self._heard_since) * 1000

    async def sweep(self) -> None:
        """One pass of every timed duty; safe in several instances at once."""
        cfg = self.config
        expired = await self.store.expire_due(quorum=cfg.quorum.enabled)
        if cfg.quorum.enabled:
            expired += await self.store.expire_batch_expired()
        heard_ms = self.heard_for_ms()
        reassigned = (
            await self.store.reassign_silent(silent_after_ms=cfg.silent_after_ms)
            if heard_ms >= cfg.silent_after_ms
            else []
        )
        lost = (
            await self.store.fail_lost(lost_after_ms=cfg.lost_after_ms, silent_after_ms=cfg.silent_after_ms)
            if heard_ms >= cfg.lost_after_ms
            else []
        )
        for row in expired:
            self.log.info("command_expired", command_id=row.id, reason=row.reason)
        for row in reassigned:
            self.log.info("command_reassigned", command_id=row.id, reason="agent-silent")
        for row in lost:
            self.log.info("command_failed", command_id=row.id, reason="agent-lost")
        await self.changed([*expired, *reassigned, *lost])
        await self.dispatch_pending()
        await self.republish_due()
        for duty in self.duties:
            await duty()

    async def dispatch_pending(self, *, site_id: str | None = None, batch_id: str | None = None) -> int:
        """Dispatch pending commands that may go now (quorum reached, an agent connected), in
        one statement; then publish their events and deliveries."""
        rows = await self.store.dispatch_pending(
            quorum=self.config.quorum.enabled,
            site_id=site_id,
            batch_id=batch_id,
            limit=_DISPATCH_BATCH,
            silent_after_ms=self.config.silent_after_ms,
        )
        rows.sort(key=lambda r: r.created_at)  # oldest first, as they were queued
        await self.changed(rows)
        await self.deliveries.deliver(rows)
        return len(rows)

    async def republish_due(self) -> None:
        """Publish again what was dispatched and never published, or not claimed in time."""
        rows = await self.store.republish_due(
            redeliver_after_ms=self.config.redeliver_after_ms, silent_after_ms=self.config.silent_after_ms
        )
        failed: set[str] = set()  # sites whose leaf stream is out of reach (cmdq.site_domain)
        for row in rows:
            if row.site_id in failed:
                continue
            if not await self.deliveries.publish(row):
                if not self.deliveries.streams.on_leaves:
                    return  # the stream is in trouble: next sweep
                failed.add(row.site_id)
                continue
            self.log.info("command_republished", command_id=row.id)

    async def retention(self) -> None:
        """Purge every ten minutes; a store outage is logged and tried again next time."""
        while True:
            try:
                purged = await self.purge()
                if purged:
                    self.log.info("commands_purged", count=purged, older_than_days=self.config.retention_days)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                self.log.warning("purge_failed", error=describe(exc))
            await asyncio.sleep(_RETENTION_EVERY_S)

    async def purge(self) -> int:
        """Delete finished commands older than the retention, a thousand at a time, so the table
        does not grow for ever; safe in several instances at once."""
        if self.config.retention_days <= 0:
            return 0
        total = 0
        while True:
            deleted = await self.store.purge_finished(retention_days=self.config.retention_days)
            total += deleted
            if deleted < 1000:
                return total
