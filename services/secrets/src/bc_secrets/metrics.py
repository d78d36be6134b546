"""bc-secrets' Prometheus metrics (docs/metrics.md)."""

from __future__ import annotations

from typing import Final

from prometheus_client import Counter

__all__ = ["FETCHES"]

FETCHES: Final = Counter(
    "bc_secret_fetches_total",
    "Agents' secret fetches through the fetch gate, by outcome (granted or denied) and the"
    " refusal's reason (empty when granted)",
    ["outcome", "reason"],
)
