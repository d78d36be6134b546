"""Prometheus metrics: what every service serves at ``/metrics`` on its health port.

Each service defines its own metrics (in its ``metrics`` module, at import, on the process's
default registry) and, for what is a count of rows in its store (workflows by state, commands by
kind/state/site, connected agents, batches awaiting approval), reads them on scrape in
``Service.collect_metrics``: one grouped query per gauge, so a scrape costs a few cheap
statements and the numbers are the store's, the same in every instance.

Counters and histograms count what *this process* saw (steps settled, commands finished, joins,
fetches): Prometheus sums them over instances. Labels are bounded sets (actions, kinds, states,
sites, profiles, reasons), never node, workflow or command ids (docs/metrics.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Gauge, generate_latest

__all__ = ["CONTENT_TYPE", "LATENCY_BUCKETS", "render", "set_gauge_rows"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
"""The text exposition format's content type."""

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Buckets for calls and steps: from a few milliseconds to the minutes a power cycle takes."""


def render() -> bytes:
    """Every metric of this process, in the text exposition format."""
    return generate_latest(REGISTRY)


def set_gauge_rows(
    gauge: Gauge, rows: Iterable[Mapping[str, Any]], labels: Sequence[str], *, value: str = "n"
) -> None:
    """Set ``gauge`` to exactly the label sets in ``rows`` (a grouped count): label sets that no
    longer have a row are dropped, so a state that emptied does not linger at its last value."""
    gauge.clear()
    for row in rows:
        gauge.labels(*(str(row[name] if row[name] is not None else "") for name in labels)).set(
            float(row[value])
        )
