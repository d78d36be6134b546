"""Marks each test with its tier, from the folder it lives in."""

from __future__ import annotations

import os
import signal
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


# A test's own time limit (pytest-timeout, `timeout` in pyproject, with timeout_func_only) covers
# the test function: it fails that test with a traceback and the run goes on. It no longer covers
# pytest's own reporting, where a timeout's exception became an INTERNALERROR that ended the whole
# run. Setup and teardown (stacks starting, a ramdisk building, processes stopping) get their own
# limit here, armed only while pytest runs them: an exception raised there is that test's error,
# never pytest's. (Killing a hung worker instead would not do: xdist's loadfile scheduling gives
# the crashed test to the next worker, which hangs the same way, until no worker is left.)
SETUP_LIMIT = float(os.environ.get("BC_TEST_SETUP_TIMEOUT", "600"))


class PhaseTimeoutError(Exception):
    """A test's setup or teardown ran past its limit."""


def _phase_limit(phase: str) -> Iterator[None]:
    def expired(signum: int, frame: object) -> None:
        raise PhaseTimeoutError(f"{phase} took more than {SETUP_LIMIT:.0f}s (BC_TEST_SETUP_TIMEOUT)")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, SETUP_LIMIT)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    yield from _phase_limit("setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield from _phase_limit("teardown")


@pytest.fixture
def sims() -> Iterator[list[SimAgent]]:
    """Simulated agents a test starts (``start_sim_agent``) and appends here: closed at its end."""
    made: list[SimAgent] = []
    yield made
    for sim in made:
        sim.close()
