"""Waiting between tries: ``Backoff``, the one retry delay of every loop that rides out a fault.

It imports nothing of ``better_compute`` and no library: every layer and service may use it
(``better_compute.service.faults`` re-exports it, where the services found it first).
"""

from __future__ import annotations

import random

__all__ = ["Backoff"]


class Backoff:
    """Exponential delays with "equal jitter": each is ``d/2 + random(0, d/2)``, ``d`` doubling
    from ``first`` up to ``cap``. Jitter keeps many processes that lost the same server from
    coming back in step."""

    def __init__(self, *, first: float = 0.1, cap: float = 5.0) -> None:
        self.first = first
        self.cap = cap
        self.failures = 0

    def next(self) -> float:
        """The delay before the next try, counting this failure."""
        ceiling = min(self.cap, self.first * (2 ** min(self.failures, 32)))
        self.failures += 1
        return float(ceiling / 2 + random.uniform(0, ceiling / 2))  # jitter, not a secret

    def reset(self) -> None:
        self.failures = 0
