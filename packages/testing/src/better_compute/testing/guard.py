"""The guard: what a test started stops when pytest ends, however it ends (SIGKILL included).

``scripts/test.sh`` runs the suite under ``better_compute.testing.reaper``, the subreaper of
everything the run starts. A plain ``pytest`` has none, so the test kit starts a guard the first
time a test starts something (``watch``: the embedded servers, service processes). The guard is a
process of its own session reading a pipe whose write end only pytest holds (PEP 446: the
processes it starts do not inherit it). When pytest ends the kernel closes that end; the guard
then stops every process still watched (its whole process group when it leads one of its own:
PostgreSQL and its backends, nats-server), SIGTERM then SIGKILL after a grace, and exits. A
process the test stopped itself is ``unwatch``ed; a watched pid is signalled only while it is
the process that was watched (same start time), never a later one given the same pid.

This file runs as a script (``python …/guard.py``), not with ``-m``: it needs only the standard
library, and starts without the test kit's imports.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import IO

__all__ = ["unwatch", "watch"]

GRACE = 5.0
"""Seconds between SIGTERM and SIGKILL."""


def _stat(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` from its state field on (the command name may hold anything)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def _start_time(pid: int) -> str | None:
    fields = _stat(pid)
    return fields[19] if fields is not None and fields[0] != "Z" else None


class _Pipe:
    """This process's guard (started on first use, and again in a forked child) and its pipe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner = 0
        self._pipe: IO[str] | None = None

    def send(self, line: str) -> None:
        with self._lock:
            if self._owner != os.getpid() or self._pipe is None:
                self._pipe, self._owner = _start_guard(), os.getpid()
            try:
                self._pipe.write(line)
                self._pipe.flush()
            except OSError:  # the guard was killed by hand: a new one next time
                self._pipe = None


def _start_guard() -> IO[str]:
    read, write = os.pipe()
    try:
        # posix_spawn, not Popen: nothing waits on the guard, it outlives us by design
        os.posix_spawn(
            sys.executable,
            [sys.executable, "-I", str(Path(__file__).resolve())],
            dict(os.environ),
            setsid=True,
            # stdin the pipe; no output: it must not hold pytest's stdout open after pytest
            file_actions=[
                (os.POSIX_SPAWN_DUP2, read, 0),
                (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                (os.POSIX_SPAWN_DUP2, 1, 2),
            ],
        )
    finally:
        os.close(read)
    return os.fdopen(write, "w")


_PIPE = _Pipe()


def _forked() -> None:
    """A forked child does not keep its parent's end of the pipe open (that would keep the guard
    waiting after the parent ended); it starts a guard of its own if it watches something."""
    pipe, _PIPE._pipe = _PIPE._pipe, None
    if pipe is not None:  # its descriptor now points at /dev/null; the file object closes that
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, pipe.fileno())
        os.close(null)
        _FORKED_AWAY.append(pipe)


_FORKED_AWAY: list[IO[str]] = []


os.register_at_fork(after_in_child=_forked)


def watch(pid: int) -> None:
    """Stop ``pid`` (with its process group when it leads one of its own) when this process ends,
    unless ``unwatch``ed before."""
    start = _start_time(pid)
    if start is None:
        return
    try:
        group = os.getpgid(pid)
    except ProcessLookupError:
        return
    _PIPE.send(f"+ {pid} {start} {group if group != os.getpgid(0) else 0}\n")


def unwatch(pid: int) -> None:
    """``pid`` was stopped by the test: the guard forgets it."""
    _PIPE.send(f"- {pid}\n")


def _serve(lines: IO[str], grace: float = GRACE) -> None:
    """Read ``+ pid start group`` and ``- pid`` until the end of input, then stop what is left."""
    watched: dict[int, tuple[str, int]] = {}
    for line in lines:
        match line.split():
            case ["+", p, started, pgid]:
                watched[int(p)] = (started, int(pgid))
            case ["-", p]:
                watched.pop(int(p), None)
    left = {pid: group for pid, (start, group) in watched.items() if _start_time(pid) == start}
    deadline = time.monotonic() + grace
    while left:
        sig = signal.SIGKILL if time.monotonic() > deadline else signal.SIGTERM
        for pid, group in left.items():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if group:
                    os.killpg(group, sig)
                else:
                    os.kill(pid, sig)
        time.sleep(0.1)
        left = {pid: group for pid, group in left.items() if _start_time(pid) is not None}


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is pytest's to handle
    _serve(sys.stdin)
