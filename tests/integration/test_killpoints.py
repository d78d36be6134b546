"""Named kill points: a process whose ``BC_KILL_AT`` names a point dies there by SIGKILL, once
ever (the marker survives its restart), and nothing happens when the variable is unset."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from killpoint_sweep import all_points

# A program that passes a point three times, saying so each time (stdout is unbuffered).
_PROGRAM = """
from better_compute.service.killpoints import declare, kill_point
P = declare("unit.point", "unit", "a test's point")
for i in (1, 2, 3):
    print("hit", i, flush=True)
    kill_point(P)
print("done", flush=True)
"""


def _run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("BC_KILL")} | env
    return subprocess.run(
        [sys.executable, "-c", _PROGRAM], env=full, capture_output=True, text=True, timeout=30, check=False
    )


def test_the_named_hit_kills_the_process_once_and_a_restart_runs_through(tmp_path: Path) -> None:
    env = {"BC_KILL_AT": "other.point,unit.point@2", "BC_KILL_MARKER_DIR": str(tmp_path / "markers")}
    first = _run(env)
    assert first.returncode == -signal.SIGKILL
    assert first.stdout.split("\n")[:2] == ["hit 1", "hit 2"]  # died at the second hit, not before
    assert "done" not in first.stdout
    assert sorted(p.name for p in (tmp_path / "markers").iterdir()) == ["unit.point@2.fired"]

    again = _run(env)  # the supervisor restarts it with the same environment
    assert (again.returncode, again.stdout.split()[-1]) == (0, "done")


def test_unset_or_without_a_marker_folder_nothing_is_armed(tmp_path: Path) -> None:
    assert _run({}).returncode == 0
    loose = _run({"BC_KILL_AT": "unit.point"})
    assert loose.returncode == 0
    assert "BC_KILL_MARKER_DIR is not set" in loose.stderr


def test_every_service_declares_its_points_in_one_registry() -> None:
    points = all_points()
    by_process: dict[str, list[str]] = {}
    for p in points:
        by_process.setdefault(p.process, []).append(p.name)
    assert sorted(by_process) == ["agent", "bcd", "command-queue", "engine", "pki"]
    assert len(by_process["engine"]) == 6
    assert len(by_process["command-queue"]) == 6
    assert len(by_process["agent"]) == 3
    assert len(by_process["bcd"]) == 2
    assert by_process["pki"] == ["pki.after-join"]  # armed by test_fleet_instance_kills, not the sweep
    assert all(p.name.startswith(p.process + ".") and p.what for p in points)
