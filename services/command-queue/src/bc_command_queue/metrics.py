"""The command queue's Prometheus metrics (docs/metrics.md)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Final

from msgspec.structs import asdict
from prometheus_client import Counter, Gauge, Histogram

from better_compute.service.metrics import LATENCY_BUCKETS, set_gauge_rows
from better_compute.wire.cmdq import TERMINAL_STATES

from .rows import CommandRow
from .storage import Store

__all__ = ["AGENT_EVENTS_IN_HAND", "AGENT_EVENTS_SHED", "collect", "observe_changes"]

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
AGENT_EVENTS_IN_HAND: Final = Gauge(
    "bc_agent_events_in_hand", "Agent events this instance received and has not answered yet"
)
AGENT_EVENTS_SHED: Final = Counter(
    "bc_agent_events_shed_total",
    "Agent events answered busy without being applied, by kind and why (full: too many in hand;"
    " late: waited for the store past agent_event_wait_ms)",
    ["kind", "why"],
)
BATCHES: Final = Gauge(
    "bc_batches_awaiting_approval", "Destructive-command batches neither approved, closed nor expired"
)


async def collect(store: Store, *, silent_after_ms: int) -> None:
    """The gauges read from the store, before a scrape."""
    live = await store.live_counts()
    set_gauge_rows(COMMANDS_LIVE, [asdict(r) for r in live], ("kind", "state", "site"))
    agents = await store.agents_connected(silent_after_ms=silent_after_ms)
    set_gauge_rows(AGENTS, [asdict(r) for r in agents], ("site", "role"))
    BATCHES.set(float(await store.batches_waiting()))


def observe_changes(rows: Sequence[CommandRow]) -> None:
    """Commands whose state changed: count and time the ones that finished."""
    now = time.time()
    for row in rows:
        if row.state not in TERMINAL_STATES:
            continue
        RESULTS.labels(row.kind, row.state).inc()
        LATENCY.labels(row.kind, row.state).observe(max(0.0, now - row.created_at))
