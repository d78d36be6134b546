"""The command queue's Prometheus metrics (docs/metrics.md)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Final

from prometheus_client import Counter, Gauge, Histogram

from better_compute.service.metrics import LATENCY_BUCKETS, set_gauge_rows
from better_compute.wire.cmdq import TERMINAL_STATES

from .rows import CommandRow

__all__ = ["BATCHES_WAITING", "collect", "observe_changes"]

COMMANDS_LIVE: Final = Gauge(
    "bc_commands_live",
    "Live commands in the store (pending, dispatched, acked, running) by kind, state and site"
    " (read on scrape)",
    ["kind", "state", "site"],
)
RESULTS: Final = Counter(
    "bc_command_results_total",
    "Commands that reached a final state in this instance, by kind and state",
    ["kind", "state"],
)
LATENCY: Final = Histogram(
    "bc_command_latency_seconds",
    "From a command's enqueue to its final state, by kind and state",
    ["kind", "state"],
    buckets=LATENCY_BUCKETS,
)
AGENTS: Final = Gauge(
    "bc_agents_connected", "Agents heard from within the silence limit, by site and role", ["site", "role"]
)
BATCHES: Final = Gauge(
    "bc_batches_awaiting_approval", "Destructive-command batches neither approved, closed nor expired"
)

# Only the live ones (the commands_live partial index): finished commands pile up until retention,
# and a grouped count of them would grow with history (bench/bench_metrics.py); they are counted
# as they finish instead (RESULTS).
_LIVE_BY_STATE: Final = (
    "SELECT kind, state, site_id AS site, count(*) AS n FROM commands"
    " WHERE state IN ('pending', 'dispatched', 'acked', 'running') GROUP BY kind, state, site_id"
)
_AGENTS_CONNECTED: Final = (
    "SELECT site_id AS site, role, count(*) AS n FROM agents"
    " WHERE last_seen > now() - make_interval(secs => $1::double precision / 1000)"
    " GROUP BY site_id, role"
)
BATCHES_WAITING: Final = (
    "SELECT count(*) FROM batches WHERE approved_at IS NULL AND closed_at IS NULL AND expires_at > now()"
)


async def collect(db: Any, *, silent_after_ms: int) -> None:
    """The gauges read from the store, before a scrape."""
    set_gauge_rows(COMMANDS_LIVE, await db.fetch(_LIVE_BY_STATE), ("kind", "state", "site"))
    set_gauge_rows(AGENTS, await db.fetch(_AGENTS_CONNECTED, silent_after_ms), ("site", "role"))
    BATCHES.set(float(await db.fetchval(BATCHES_WAITING)))


def observe_changes(rows: Sequence[CommandRow]) -> None:
    """Commands whose state changed: count and time the ones that finished."""
    now = time.time()
    for row in rows:
        if row.state not in TERMINAL_STATES:
            continue
        RESULTS.labels(row.kind, row.state).inc()
        LATENCY.labels(row.kind, row.state).observe(max(0.0, now - row.created_at))
