"""An engine told to stop stops, even in the instant it gains its shards.

Regression: the work poll waited with ``asyncio.wait_for(event.wait(), timeout)``; on Python
3.11, when the event is set (shards gained) in the same loop turn as the stop's cancellation,
``wait_for`` returns the event's result and drops the cancellation, so the poll loop went on and
``run()`` never returned (every stop made in that turn hung).
"""

from __future__ import annotations

import asyncio

from bc_engine.service import EngineService
from better_compute.config import Settings


async def shards_gained(svc: EngineService) -> None:
    """Return in the very loop turn the engine holds its shards (``until`` sleeps between looks,
    which lets the poll loop take the wake-up first and hides the race)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while svc.leases.owns(0) is None:
        assert loop.time() < deadline, "the engine gained no shard in 30 s"
        await asyncio.sleep(0)


async def test_a_stop_as_the_shards_are_gained_ends_the_run(bc_settings: Settings) -> None:
    hung = []
    for attempt in range(6):
        svc = EngineService(bc_settings)
        async with svc:
            run = asyncio.create_task(svc.run())
            await shards_gained(svc)
            for _ in range(attempt % 2):  # the stop lands in the same loop turn, or the next
                await asyncio.sleep(0)
            svc.request_stop()
            done, _ = await asyncio.wait([run], timeout=10)
            if not done:
                hung.append(attempt)
                run.cancel()
                await asyncio.wait([run], timeout=10)
    assert hung == [], f"run() did not return after request_stop() in attempts {hung}"
