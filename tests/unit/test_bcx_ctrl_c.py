"""Ctrl-C stops a following bcx (``events tail``, ``nodes watch``, ``bulk --watch``, ``workflows
watch``) at once, even while events flow. On Python 3.11 ``asyncio.wait_for`` swallows a
cancellation that arrives as the awaited wait completes (fixed in 3.12), and a following bcx
waits for its next event that way in a loop: the Ctrl-C (asyncio.run cancels the main task) was
lost whenever an event came at the same moment, and ``bcx events tail`` went on following. Seen
in a fresh-clone run: the doc test's ``events tail`` example ran to its 60 s job limit. bcx waits
with ``asyncio.timeout`` instead, which keeps the cancel; so does all product code (the command
queue client's wait for a command, bcd's lean host at its end)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
from pathlib import Path

import pytest

from better_compute.cli.common import stop_if_interrupted

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [*ROOT.glob("packages/*/src"), *ROOT.glob("services/*/src")]


async def _follow(woken: asyncio.Event) -> None:
    """The shape of bcx's follow loops: wait for a wake-up or a timeout, read again."""
    while True:
        woken.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                await woken.wait()


async def test_a_cancel_arriving_with_an_event_stops_the_follow_loop() -> None:
    for _ in range(50):
        woken = asyncio.Event()
        task = asyncio.create_task(_follow(woken))
        await asyncio.sleep(0)
        woken.set()  # an event arrives...
        task.cancel()  # ...as the reader presses Ctrl-C
        done, _ = await asyncio.wait([task], timeout=0.5)
        assert done, "the follow loop went on after its cancel"


async def _follow_through_a_library(arrived: list[asyncio.Future[None]], *, checked: bool) -> None:
    """A follow loop whose read waits as nats-py's request and ``next_msg`` do (wait_for)."""
    while True:
        if checked:
            stop_if_interrupted()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        arrived.append(fut)
        await asyncio.wait_for(fut, 5.0)  # the library's wait, on purpose


@pytest.mark.parametrize(
    "checked",
    [True, pytest.param(False, marks=pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12 fixed"))],
)
async def test_a_cancel_a_library_swallowed_still_stops_the_next_round(checked: bool) -> None:
    """nats-py waits with wait_for; a Ctrl-C arriving with its answer was lost in the library,
    so bcx's loops ask ``stop_if_interrupted`` each round (unchecked, the loop goes on: the test
    shows the swallow it guards against is real on this Python)."""
    arrived: list[asyncio.Future[None]] = []
    task = asyncio.create_task(_follow_through_a_library(arrived, checked=checked))
    await asyncio.sleep(0)
    arrived[-1].set_result(None)  # the answer arrives...
    task.cancel()  # ...as the reader presses Ctrl-C
    done, _ = await asyncio.wait([task], timeout=0.5)
    try:
        assert bool(done) is checked, "stopped" if done else "went on after its Ctrl-C"
        if done:
            assert task.cancelled()
    finally:
        task.cancel()
        await asyncio.wait([task])


def test_no_product_code_waits_with_asyncio_wait_for() -> None:
    """Not bcx, nor the services, clients and bcd: each loop waiting that way can lose a stop."""
    assert len(SOURCES) > 5, SOURCES
    users = [
        f"{p.relative_to(ROOT)}:{n}"
        for src in SOURCES
        for p in sorted(src.rglob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"\bwait_for\(", line) and not line.lstrip().startswith("#")
    ]
    assert users == [], f"asyncio.wait_for can swallow a Ctrl-C on Python 3.11: {users}"
