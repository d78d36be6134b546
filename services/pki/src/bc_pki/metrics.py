"""bc-pki's Prometheus metrics (docs/metrics.md)."""

from __future__ import annotations

from typing import Final

from prometheus_client import Counter

__all__ = ["JOINS"]

JOINS: Final = Counter(
    "bc_joins_total",
    "Join attempts by result (accepted or refused) and reason (the join audit's outcome:"
    " joined, malformed, token-unknown, token-revoked, token-expired, token-used-up,"
    " claims-mismatch, …)",
    ["result", "reason"],
)
