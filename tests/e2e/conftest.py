"""Fixtures the end-to-end files share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from better_compute.testing.agents import SimAgent
from better_compute.testing.bcd import BcdProcess


@pytest.fixture
def bcds() -> Iterator[list[BcdProcess]]:
    """bcd processes a test starts; each is closed after it, its last lines shown on failure."""
    made: list[BcdProcess] = []
    yield made
    for bcd in made:
        bcd.close()
        print(f"--- bcd (pid {bcd.proc.pid}) ---", *bcd.output().splitlines()[-30:], sep="\n")


@pytest.fixture
def agents_closed() -> Iterator[list[SimAgent]]:
    """Simulated agents a test starts (append each): closed when it ends."""
    made: list[SimAgent] = []
    yield made
    for sim in made:
        sim.close()
