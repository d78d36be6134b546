"""Marks each test with its tier, from the folder it lives in."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from better_compute.testing.agents import SimAgent

_TIERS = {"unit", "integration", "e2e", "chaos", "adversarial"}


# Long sweeps (minutes each) stay out of `make test` so it fits its budget; `make test-long`
# (BC_LONG=1) runs them too. They are deselected, not skipped: a run says how many it left out.
_LONG = os.environ.get("BC_LONG", "") not in ("", "0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = Path(str(item.path)).relative_to(Path(__file__).parent).parts[0]
        if tier in _TIERS:
            item.add_marker(getattr(pytest.mark, tier))
    if not _LONG:
        long = [i for i in items if i.get_closest_marker("long")]
        if long:
            config.hook.pytest_deselected(items=long)
            items[:] = [i for i in items if not i.get_closest_marker("long")]


# Service processes started by tests load test apps from tests/support.
_SUPPORT = str(Path(__file__).parent / "support")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_SUPPORT, os.environ.get("PYTHONPATH", "")) if p)
if _SUPPORT not in sys.path:
    sys.path.insert(0, _SUPPORT)


@pytest.fixture
def sims() -> Iterator[list[SimAgent]]:
    """Simulated agents a test starts (``start_sim_agent``) and appends here: closed at its end."""
    made: list[SimAgent] = []
    yield made
    for sim in made:
        sim.close()
