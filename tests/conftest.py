"""Marks each test with its tier, from the folder it lives in."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import pytest_asyncio

from better_compute.testing.agents import SimAgent

if TYPE_CHECKING:
    import asyncpg

    from better_compute.config import Settings

_TIERS = {"unit", "integration", "e2e", "chaos", "adversarial"}


# Long sweeps (minutes each) stay out of `make test` so it fits its budget; `make test-long`
# (BC_LONG=1) runs them too. They are deselected, not skipped: a run says how many it left out.
_LONG = os.environ.get("BC_LONG", "") not in ("", "0")


# The heaviest files first (seconds per file from an earlier run, scripts/file_weights.py): with
# `--dist loadfile --no-loadscope-reorder` the two workers take files in this order, so a VM test
# starts early instead of running alone at the end while the other worker idles. A file not in the
# list weighs by its tier.
_HERE = Path(__file__).parent
_WEIGHTS: dict[str, float] = json.loads((_HERE / "file-weights.json").read_text())
_TIER_WEIGHT = {"e2e": 30.0, "chaos": 30.0, "integration": 5.0, "adversarial": 10.0, "unit": 0.5}


def _weight(item: pytest.Item) -> float:
    rel = _file(item)
    return _WEIGHTS.get(rel, _TIER_WEIGHT.get(rel.split("/")[1], 1.0))


# xdist hands worker 1 the 1st and 3rd files, worker 2 the 2nd and 4th: the two files that boot the
# built ramdisk in a VM go 1st and 3rd, so one worker builds it (minutes on a fresh machine) while
# the other runs, instead of the second waiting on the build's lock.
_RAMDISK_FILES = ("tests/e2e/test_vm_lifecycle.py", "tests/e2e/test_ramdisk_vm.py")


def _file(item: pytest.Item) -> str:
    return Path(str(item.path)).relative_to(_HERE.parent).as_posix()


def _heaviest_first(items: list[pytest.Item]) -> None:
    items.sort(key=_weight, reverse=True)  # stable: a file's tests keep their order
    files = list(dict.fromkeys(_file(i) for i in items))
    if all(f in files for f in _RAMDISK_FILES) and len(files) > 3:
        for f in _RAMDISK_FILES:
            files.remove(f)
        files[0:0] = [_RAMDISK_FILES[0], files.pop(0), _RAMDISK_FILES[1]]
        rank = {f: n for n, f in enumerate(files)}
        items.sort(key=lambda i: rank[_file(i)])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _heaviest_first(items)
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


@pytest_asyncio.fixture(loop_scope="session")
async def db(bc_settings: Settings) -> AsyncIterator[asyncpg.Connection]:
    """A connection (asyncpg) to the test database, with the engine test app's plugin tables made:
    the integration and chaos tiers' (imported here, so a unit run loads neither)."""
    import asyncpg

    from engine_test_app import TABLES

    conn = await asyncpg.connect(bc_settings.database_url)
    await conn.execute(TABLES)
    yield conn
    await conn.close()
