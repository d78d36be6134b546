"""What `bcx sim down`, `bcx dev down` and the tests go by to say a process is gone (`pid_alive`),
and the embedded PostgreSQL's system user, made once however many processes start a cluster."""

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


def test_the_postgres_user_is_made_once_when_processes_start_clusters_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fresh machine's test workers each found no user and each ran useradd; the second one's
    uid replaced the first's under a cluster made as the first (CI: 274 errors, initdb could not
    look up effective user ID 999)."""
    import threading
    import time

    users: dict[str, object] = {}
    made: list[str] = []

    def getpwnam(name: str) -> object:
        if name not in users:
            raise KeyError(name)
        return users[name]

    def useradd(argv: list[str], **_kw: object) -> None:
        time.sleep(0.05)  # a look of another process fits in here
        made.append(argv[-1])
        users[argv[-1]] = f"uid {990 + len(made)}"

    monkeypatch.setattr("pwd.getpwnam", getpwnam)
    monkeypatch.setattr(embedded, "_run", useradd)
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(embedded._system_user())) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert made == [embedded.PG_SYSTEM_USER]
    assert got == ["uid 991"] * 5
