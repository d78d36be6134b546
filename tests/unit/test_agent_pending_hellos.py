"""An agent whose certificate is pending (a held join token whose boot entry has not closed
clean) says hello again with pauses doubling from 0.5 s to 10 s: a machine held for a production
quiet period (120 s) said 120 hellos a boot at one a second, each a certificate read at bc-pki."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from better_compute.agent import runner
from better_compute.core.errors import BcError, ErrorCode

pytestmark = pytest.mark.unit


async def test_hellos_while_pending_back_off_to_ten_seconds_and_stop_at_the_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pauses: list[float] = []

    async def sleep(seconds: float) -> None:
        pauses.append(seconds)

    monkeypatch.setattr(runner.asyncio, "sleep", sleep)
    agent: Any = object.__new__(runner.Agent)
    agent._stop = asyncio.Event()
    agent.log = runner.get_logger()
    hellos: list[float] = []

    async def hello() -> str:
        now = sum(pauses)  # the agent's time: the pauses it slept
        hellos.append(now)
        if now < 120.0:  # the quiet period of a production site
            raise BcError(ErrorCode.UNAUTHENTICATED, "held", {"reason": "cert-pending"})
        return "welcome"

    assert await agent._retrying("hello", hello) == "welcome"
    assert 0.25 <= pauses[0] <= 0.5
    assert max(pauses) <= 10.0
    assert all(b >= a / 2 for a, b in itertools.pairwise(pauses))  # no quick retries again
    assert len(hellos) <= 25, f"{len(hellos)} hellos in a 120 s quiet period"
    assert sum(pauses) - 120.0 <= 10.0  # connected within 10 s of the confirm
