"""``pid_alive``: what ``bcx sim down``, ``bcx dev down`` and the tests go by to say a process is gone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from better_compute.runtime import embedded
from better_compute.runtime.embedded import pid_alive


def test_a_running_process_is_alive_a_zombie_and_a_reaped_one_are_not() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert pid_alive(proc.pid)
    finally:
        proc.kill()
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped: a zombie
    assert not pid_alive(proc.pid)
    proc.wait()
    assert not pid_alive(proc.pid)


def test_a_zombie_reaped_between_the_signal_and_the_stat_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    """kill(pid, 0) answered for the zombie, then its parent reaped it before /proc was read. CI
    saw it: the test that had just watched `bcx sim down` stop a site agent found it alive."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: its /proc entry is gone
    monkeypatch.setattr(embedded.os, "kill", lambda _pid, _sig: None)  # as if kill came first
    assert not pid_alive(proc.pid)
