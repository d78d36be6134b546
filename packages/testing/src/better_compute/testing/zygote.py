"""The client's side of a fork server: a process that imported a program once and forks a
child per request, each its own OS process (own pid, environment, log file, exit code, killable
with SIGKILL) without Python's start-up.

Protocol on the server's stdin/stdout, one JSON document a line:
``{"id": n, "argv": [...], "env": {...}, "log": path}`` → ``{"id": n, "pid": pid}``, and
``{"exit": pid, "code": code}`` when a child ends (a negative code: killed by that signal). When
its stdin closes the server kills its children and exits. Servers: ``bcd.forkserver`` (the metal
simulator's bcds, ``metal_sim.zygote``) and ``better_compute.testing.service_forkserver`` (the
services ``ServiceProcesses`` starts).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

__all__ = ["Zygote", "ZygoteProc"]


class ZygoteProc:
    """A forked process, as much of ``subprocess.Popen`` as the test kit uses."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote = zygote
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()

    def _end(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            self.zygote.signal(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """The client's side: starts the server (``COMMAND``), forks processes through it.

    Each waiter waits on its own event (a spawn for its pid, a ``wait`` for its process's end):
    the metal simulator's lean host has thousands of machines' joins waiting at once, and one
    condition shared by all of them woke every waiter at every line the server wrote."""

    COMMAND: tuple[str, ...] = ()
    NAME = "fork server"

    def __init__(self, log: str) -> None:
        self._log = open(log, "ab")  # noqa: SIM115 -- closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, *self.COMMAND],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
        )  # fmt: skip
        self._lock = threading.Lock()
        self._asked: dict[int, threading.Event] = {}
        """Request id -> set once its pid came (or the server is gone)."""
        self._pids: dict[int, int] = {}
        self._procs: dict[int, ZygoteProc] = {}
        """The processes that have not ended, by pid."""
        self._exits: dict[int, int] = {}
        self._gone = False
        self._n = 0
        self._write_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name=self.NAME, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                if "pid" in doc:
                    self._pids[int(doc["id"])] = int(doc["pid"])
                    asked = self._asked.pop(int(doc["id"]), None)
                    if asked is not None:
                        asked.set()
                elif "exit" in doc:
                    found = self._procs.pop(int(doc["exit"]), None)
                    if found is not None:
                        found._end(int(doc["code"]))
                    else:  # ended before spawn() took its pid
                        self._exits[int(doc["exit"])] = int(doc["code"])
        with self._lock:  # the server is gone: so are its children (they share its session)
            self._gone = True
            for p in self._procs.values():
                p._end(-signal.SIGKILL)
            self._procs.clear()
            for asked in self._asked.values():
                asked.set()

    def _send(self, doc: dict[str, object]) -> None:
        assert self.proc.stdin is not None
        with self._write_lock:
            self.proc.stdin.write((json.dumps(doc) + "\n").encode())
            self.proc.stdin.flush()

    def signal(self, pid: int, sig: int) -> None:
        """Send ``sig`` to a process this server started."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    def spawn(
        self, argv: list[str], *, env: dict[str, str], log: str, timeout: float = 30.0, cwd: str | None = None
    ) -> ZygoteProc:
        """Fork a process with ``argv`` (what the server's program takes after its name)."""
        asked = threading.Event()
        with self._write_lock:
            self._n += 1
            n = self._n
        with self._lock:
            self._asked[n] = asked
            if self._gone:
                asked.set()
        self._send({"id": n, "argv": argv, "env": env, "log": log, **({"cwd": cwd} if cwd else {})})
        end = time.monotonic() + timeout
        while not asked.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > end:
                break
        with self._lock:
            self._asked.pop(n, None)
            pid = self._pids.pop(n, None)
            if pid is None:
                raise RuntimeError(f"the {self.NAME} did not answer")
            proc = ZygoteProc(self, pid)
            code = self._exits.pop(pid, None)
            if code is not None:
                proc._end(code)
            elif self._gone:
                proc._end(-signal.SIGKILL)
            else:
                self._procs[pid] = proc
            return proc

    def run(self, argv: list[str], *, env: dict[str, str], log: str, timeout: float = 60.0) -> int:
        """``spawn`` and wait for its exit code."""
        proc = self.spawn(argv, env=env, log=log)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(10)

    def close(self) -> None:
        with self._lock:
            live = list(self._procs.values())
        for p in live:
            p.kill()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._reader.join(10)  # it ends at the pipe's end
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        self._log.close()
