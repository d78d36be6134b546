"""When each reconciler key runs next, in this process.

Keys come from three places: wake-ups (NATS, at once), the end of a pass (the next moment
the key cares about) and the safety-net poll of the work queue. One pass per key at a
time: a wake-up for a key that is running marks it to run again right after.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from better_compute.service.faults import Backoff

from .. import metrics
from .engine import FencedError

__all__ = ["Scheduler"]

RETRY_FIRST_S = 2.0  # a failed pass runs again after about this long …
RETRY_CAP_S = 10.0  # … doubling while it keeps failing, up to this


class Scheduler:
    def __init__(
        self,
        run: Callable[[str], Awaitable[float | None]],
        *,
        log: Any,
        concurrency: int = 32,
    ) -> None:
        self._run_pass = run
        self._log = log
        self._timers: dict[str, tuple[float, asyncio.TimerHandle]] = {}
        self._running: set[str] = set()
        self._dirty: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._sem = asyncio.Semaphore(concurrency)
        self._closed = False
        self._failing: dict[str, Backoff] = {}  # keys whose last pass raised

    def at(self, key: str, when: float, *, from_poll: bool = False) -> None:
        """Run ``key`` at ``when`` (epoch seconds); the earliest request wins."""
        if self._closed:
            return
        if key in self._running:
            if not from_poll:
                self._dirty.add(key)
            return
        current = self._timers.get(key)
        if current is not None:
            if current[0] <= when:
                return
            current[1].cancel()
        loop = asyncio.get_running_loop()
        delay = max(0.0, when - time.time())
        self._timers[key] = (when, loop.call_later(delay, self._fire, key))

    def now(self, key: str) -> None:
        self.at(key, time.time())

    def drop(self, keep: Callable[[str], bool]) -> None:
        """Forget timers of keys this process no longer owns."""
        for key in [k for k in self._timers if not keep(k)]:
            self._timers.pop(key)[1].cancel()
        for key in [k for k in self._failing if not keep(k)]:
            del self._failing[key]

    def _fire(self, key: str) -> None:
        timer = self._timers.pop(key, None)
        if key in self._running:
            self._dirty.add(key)
            return
        self._running.add(key)
        due = timer[0] if timer is not None else time.time()
        task = asyncio.create_task(self._pass(key, due), name=f"pass:{key}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _pass(self, key: str, due: float) -> None:
        nxt: float | None = None
        try:
            async with self._sem:
                metrics.RECONCILER_LAG.observe(max(0.0, time.time() - due))
                nxt = await self._run_pass(key)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._log.warning("pass_failed", rkey=key, error=f"{type(exc).__name__}: {exc}")
            if isinstance(exc, FencedError):
                nxt = None
            else:
                # Again soon, backing off (jittered) while it keeps failing: during a database
                # outage every key fails, and they must not all come back in step. The poll of
                # the work queue brings due keys back at once when the database is there again.
                backoff = self._failing.setdefault(key, Backoff(first=RETRY_FIRST_S, cap=RETRY_CAP_S))
                nxt = time.time() + backoff.next()
        else:
            self._failing.pop(key, None)
        finally:
            self._running.discard(key)
        if key in self._dirty:
            self._dirty.discard(key)
            self.now(key)
        elif nxt is not None:
            self.at(key, nxt)

    async def close(self, grace: float) -> None:
        self._closed = True
        for _when, handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        if self._tasks:
            _done, pending = await asyncio.wait(set(self._tasks), timeout=grace)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
