"""The test run's reaper: a process the run started, however detached, dies with the run, even
when the run itself was SIGKILLed; the run's exit code comes through."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from better_compute.runtime.embedded import pid_alive

pytestmark = pytest.mark.integration

# A "test run" that starts a detached grandchild (its own session, its parent gone at once, as
# pg_ctl leaves PostgreSQL), writes its pid, then ends as told.
RUN = """
import os, subprocess, sys, time
pid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                       start_new_session=True).pid
open(sys.argv[1], "w").write(str(pid))
if sys.argv[2] == "kill":
    os.kill(os.getpid(), 9)
sys.exit(int(sys.argv[2]))
"""


def _reaper(tmp_path: Path, how: str) -> tuple[int, int, str]:
    pidfile = tmp_path / "pid"
    done = subprocess.run(
        [sys.executable, "-m", "better_compute.testing.reaper", "--grace", "2", "--",
         sys.executable, "-c", RUN, str(pidfile), how],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return done.returncode, int(pidfile.read_text()), done.stderr


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize(("how", "code"), [("0", 0), ("3", 3), ("kill", 128 + signal.SIGKILL)])
def test_a_detached_process_dies_with_the_run_and_the_runs_code_comes_through(
    tmp_path: Path, how: str, code: int
) -> None:
    rc, pid, err = _reaper(tmp_path, how)
    try:
        assert rc == code
        assert _gone(pid), f"pid {pid} outlived the run"
        assert f"(pid {pid}) outlived the test run" in err
    finally:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


# A "pytest" that starts two processes, has the guard watch both, says it stopped the second
# (unwatch), writes their pids, then ends as told: normally, or SIGKILLed.
GUARDED = """
import os, subprocess, sys
from better_compute.testing.guard import unwatch, watch
kept, gone = (subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"]).pid for _ in "ab")
watch(kept)
watch(gone)
unwatch(gone)
open(sys.argv[1], "w").write(f"{kept} {gone}")
if sys.argv[2] == "kill":
    os.kill(os.getpid(), 9)
"""


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_the_guard_stops_what_is_watched_when_its_process_ends_and_leaves_the_rest(
    tmp_path: Path, how: str
) -> None:
    pidfile = tmp_path / "pids"
    subprocess.run([sys.executable, "-c", GUARDED, str(pidfile), how], timeout=60, check=how == "exit")
    watched, unwatched = (int(p) for p in pidfile.read_text().split())
    try:
        assert _gone(watched), f"pid {watched} outlived the process that watched it"
        assert pid_alive(unwatched), "an unwatched process was stopped"
    finally:
        for pid in (watched, unwatched):
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
