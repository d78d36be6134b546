"""``Recent``: a map of what was learnt lately, by key, that forgets what is past its time.

For caches keyed by something every machine makes anew (a certificate per join): a plain dict
would keep an entry for every key ever seen. Used by the command queue's cache of signers and
bc-pki's auth callout's confirmed certificates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Recent"]

K = TypeVar("K")
V = TypeVar("V")

SWEEP_FIRST = 1024
"""Entries held before the first sweep of those past their time (then twice as many as the
sweep kept)."""


class Recent(Generic[K, V]):
    """Values by key, each stamped with when it was learnt (``stamp(value)``, on the clock of
    its caller). An entry whose stamp is ``ttl`` seconds old or more is of no use to the caller
    and is swept out when the map has doubled since the last sweep (first at ``SWEEP_FIRST``
    entries), at the next store, which is taken as the time now: so the map holds the entries
    of about the last ``ttl`` seconds (at most twice those, or ``SWEEP_FIRST``), each sweep
    paid for by as many stores as it scans. Reading never sweeps; callers judge each value's
    age themselves."""

    def __init__(self, ttl: float, stamp: Callable[[V], float]) -> None:
        self.ttl = ttl
        self._stamp = stamp
        self._entries: dict[K, V] = {}
        self._sweep_at = SWEEP_FIRST

    def get(self, key: K) -> V | None:
        return self._entries.get(key)

    def __setitem__(self, key: K, value: V) -> None:
        if len(self._entries) >= self._sweep_at:
            now, stamp = self._stamp(value), self._stamp
            self._entries = {k: v for k, v in self._entries.items() if now - stamp(v) < self.ttl}
            self._sweep_at = max(SWEEP_FIRST, 2 * len(self._entries))
        self._entries[key] = value

    def pop(self, key: K) -> None:
        self._entries.pop(key, None)

    def __len__(self) -> int:
        return len(self._entries)
