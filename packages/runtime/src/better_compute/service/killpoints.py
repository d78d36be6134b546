"""Named kill points: where a chaos test SIGKILLs a process on purpose (docs/chaos.md).

A service declares each point once, as a module constant, and calls ``kill_point`` there::

    BEFORE_SETTLE = declare("engine.before-settle", "engine", "a step's outcome is known, not settled")
    ...
    kill_point(BEFORE_SETTLE)

When the process's ``BC_KILL_AT`` names the point (``engine.before-settle``, or
``engine.before-settle@2`` for its second hit in this process; several, comma-separated),
the process creates a marker file in ``BC_KILL_MARKER_DIR`` and SIGKILLs itself: no cleanup,
no flush, no goodbye. The marker (created exclusively, so only one process of those sharing
the folder fires) keeps the point from firing again after the supervisor restarts the process
with the same environment. Without ``BC_KILL_MARKER_DIR`` nothing is armed (a crash loop is
worse than no crash). The environment is read once, at import: unset, ``kill_point`` is one
global lookup and a return.

``REGISTRY`` holds every declared point (import the declaring modules first;
``better_compute.testing.killpoints.all_points`` does), so a test can enumerate them.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["REGISTRY", "KillPoint", "armed", "configure", "declare", "kill_point", "marker_name"]


@dataclass(frozen=True)
class KillPoint:
    name: str
    """``<process>.<where>``, e.g. ``engine.before-settle``."""
    process: str
    """Which program hits it: ``engine``, ``command-queue``, ``agent`` (the agent runtime, so
    both the site agent and bcd), ``bcd``."""
    what: str
    """What is done and what is not when the process dies there."""


REGISTRY: dict[str, KillPoint] = {}


def declare(name: str, process: str, what: str) -> str:
    """Register a point; returns its name (the constant a module passes to ``kill_point``)."""
    known = REGISTRY.get(name)
    if known is not None and known != KillPoint(name, process, what):
        raise ValueError(f"kill point {name!r} declared twice, differently")
    REGISTRY[name] = KillPoint(name, process, what)
    return name


# name -> the hit that fires it (1: the first); None when nothing is armed
_ARMED: dict[str, int] | None = None
_HITS: dict[str, int] = {}
_MARKERS: Path | None = None


def configure(spec: str | None, marker_dir: str | os.PathLike[str] | None) -> None:
    """Arm the points of ``spec`` (``BC_KILL_AT``'s syntax); called at import with the
    environment, and by unit tests."""
    global _ARMED, _MARKERS
    _HITS.clear()
    _ARMED, _MARKERS = None, None
    if not spec or not marker_dir:
        if spec:
            print(f"BC_KILL_AT={spec!r} ignored: BC_KILL_MARKER_DIR is not set", file=sys.stderr)
        return
    armed: dict[str, int] = {}
    for word in spec.split(","):
        name, _, nth = word.strip().partition("@")
        if name:
            armed[name] = int(nth) if nth.isdigit() and int(nth) > 0 else 1
    _ARMED, _MARKERS = armed or None, Path(marker_dir)


def armed() -> dict[str, int]:
    """The armed points and their hit numbers (empty when none)."""
    return dict(_ARMED or {})


def marker_name(name: str, nth: int = 1) -> str:
    """The marker file of a point (``engine.before-settle@2.fired``)."""
    return f"{name}@{nth}.fired"


def kill_point(name: str) -> None:
    """SIGKILL this process here if ``BC_KILL_AT`` names this point (once, ever)."""
    if _ARMED is None:
        return
    nth = _ARMED.get(name)
    if nth is None:
        return
    hits = _HITS[name] = _HITS.get(name, 0) + 1
    if hits != nth:
        return
    assert _MARKERS is not None
    try:
        _MARKERS.mkdir(parents=True, exist_ok=True)
        fd = os.open(_MARKERS / marker_name(name, nth), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return  # fired already (in an earlier life of this process, or in another one)
    os.write(fd, f"{os.getpid()}\n".encode())
    os.fsync(fd)
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


configure(os.environ.get("BC_KILL_AT"), os.environ.get("BC_KILL_MARKER_DIR"))
