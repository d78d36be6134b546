"""The engine's Prometheus metrics (docs/metrics.md)."""

from __future__ import annotations

from typing import Any, Final

from prometheus_client import Counter, Gauge, Histogram

from better_compute.service.metrics import LATENCY_BUCKETS, set_gauge_rows

__all__ = [
    "RECONCILER_LAG",
    "STEP_SECONDS",
    "WORKFLOWS_FINISHED",
    "WORKFLOWS_QUEUED",
    "WORKFLOWS_RUNNING",
    "collect",
    "observe_step",
]

WORKFLOWS_RUNNING: Final = Gauge(
    "bc_workflows_running", "Running workflows in the store, by profile (read on scrape)", ["profile"]
)
WORKFLOWS_QUEUED: Final = Gauge(
    "bc_workflows_queued",
    "Running workflows waiting for their site's admission (engine.site_admission), by site (read on scrape)",
    ["site"],
)
WORKFLOWS_FINISHED: Final = Counter(
    "bc_workflows_finished_total",
    "Workflows that finished in this instance, by profile and state (succeeded, failed, aborted)",
    ["profile", "state"],
)
STEP_SECONDS: Final = Histogram(
    "bc_step_duration_seconds",
    "From a step attempt's start to its settling, by action and outcome (succeeded or failed)",
    ["action", "outcome"],
    buckets=LATENCY_BUCKETS,
)
RECONCILER_LAG: Final = Histogram(
    "bc_reconciler_lag_seconds",
    "From the moment a reconciler key was due (its not_before, or its wake-up) to its pass starting",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)

# Only the running ones: finished workflows pile up for ever, and a grouped count of them grows
# with history (bench/bench_metrics.py); they are counted as they finish instead.
_RUNNING_BY_PROFILE: Final = (
    "SELECT profile_id AS profile, count(*) AS n FROM workflows WHERE state = 'running' GROUP BY profile_id"
)

_QUEUED_BY_SITE: Final = (
    "SELECT site_id AS site, count(*) AS n FROM workflows WHERE state = 'running' AND NOT admitted"
    " GROUP BY site_id"
)


async def collect(db: Any) -> None:
    """The gauges read from the store, before a scrape."""
    set_gauge_rows(WORKFLOWS_RUNNING, await db.fetch(_RUNNING_BY_PROFILE), ("profile",))
    set_gauge_rows(WORKFLOWS_QUEUED, await db.fetch(_QUEUED_BY_SITE), ("site",))


def observe_step(action: str, outcome: str, started_at: Any, now: float) -> None:
    """A step attempt settled: its duration, when it has a start."""
    if started_at is not None:
        STEP_SECONDS.labels(action, outcome).observe(max(0.0, now - started_at.timestamp()))
