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

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        with self.zygote.cond:
            while self.returncode is None:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
                self.zygote.cond.wait(left if left is not None else 1.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            self.zygote.signal(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """The client's side: starts the server (``COMMAND``), forks processes through it."""

    COMMAND: tuple[str, ...] = ()
    NAME = "fork server"

    def __init__(self, log: str) -> None:
        self._log = open(log, "ab")  # noqa: SIM115 -- closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, *self.COMMAND],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
        )  # fmt: skip
        self.cond = threading.Condition()
        self._pids: dict[int, int] = {}
        self._procs: dict[int, ZygoteProc] = {}
        self._exits: dict[int, int] = {}
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
            with self.cond:
                if "pid" in doc:
                    self._pids[int(doc["id"])] = int(doc["pid"])
                elif "exit" in doc:
                    found = self._procs.get(int(doc["exit"]))
                    if found is not None:
                        found.returncode = int(doc["code"])
                    else:  # ended before spawn() took its pid
                        self._exits[int(doc["exit"])] = int(doc["code"])
                self.cond.notify_all()
        with self.cond:  # the server is gone: so are its children (they share its session)
            for p in self._procs.values():
                if p.returncode is None:
                    p.returncode = -signal.SIGKILL
            self.cond.notify_all()

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
        with self._write_lock:
            self._n += 1
            n = self._n
        self._send({"id": n, "argv": argv, "env": env, "log": log, **({"cwd": cwd} if cwd else {})})
        end = time.monotonic() + timeout
        with self.cond:
            while n not in self._pids:
                if self.proc.poll() is not None or time.monotonic() > end:
                    raise RuntimeError(f"the {self.NAME} did not answer")
                self.cond.wait(0.5)
            proc = ZygoteProc(self, self._pids.pop(n))
            proc.returncode = self._exits.pop(proc.pid, None)
            self._procs[proc.pid] = proc
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
        with self.cond:
            live = [p for p in self._procs.values() if p.returncode is None]
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
