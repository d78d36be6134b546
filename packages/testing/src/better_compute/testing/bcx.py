"""Running ``bcx`` as an operator would: its own process, against the test's deployment.

``bcx(settings, "nodes", "list", "--json")`` runs ``python -m better_compute.cli`` with the
deployment of ``settings`` (its NATS URL and subject root) in the environment, in a thread so
the test's event loop keeps serving; ``run_bcx`` is the same, blocking. The result unpacks as
``code, out, err`` and has ``returncode``, ``stdout`` and ``stderr``.

``BcxForks`` is the same for many runs at less cost: one process imports bcx once, and each run
is a process forked from it (its own process still, with its own working directory and
environment), so a run costs its requests, not Python's start and bcx's imports (about 0.6 s of
CPU and 1 s of wall on a loaded two-core machine). ``run_bcx`` and ``bcx`` use such forks
(``BcxForks`` servers shared by the process, one more started only while all are busy) unless
the run needs a fresh interpreter: ``input=`` for its stdin, or an environment whose
interpreter settings (``PYTHON*``, locale) differ from ours. ``BC_BCX_FORKS=0`` in the
environment turns the forks off: every run is ``python -m better_compute.cli``.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import subprocess
import sys
import threading
from collections.abc import Mapping
from types import TracebackType
from typing import IO, Any, NamedTuple

from ..config import Settings
from .guard import unwatch, watch

__all__ = ["BcxForks", "BcxRun", "bcx", "bcx_env", "run_bcx"]

_DEPLOYMENT_VARS = ("BC_NATS_URL", "BC_DATABASE_URL")


class BcxRun(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def bcx_env(
    settings: Settings | None = None, *, env: Mapping[str, str] | None = None, isolated: bool = False
) -> dict[str, str]:
    """This process's environment for a bcx run: with the deployment of ``settings``, without
    any ``BC_NATS_URL``/``BC_DATABASE_URL`` of ours when ``isolated``, then ``env`` on top.
    The bcx contexts file is empty (``BCX_CONFIG``) unless ``env`` names one: a test never
    talks to the deployment of the current context of whoever runs it."""
    out = {k: v for k, v in os.environ.items() if not (isolated and k in _DEPLOYMENT_VARS)}
    out["BCX_CONFIG"] = os.devnull
    if settings is not None:
        out["BC_NATS_URL"] = settings.nats_url or ""
        out["BC_SUBJECT_ROOT"] = settings.subject_root
    out.update(env or {})
    return out


def run_bcx(
    settings: Settings | None,
    *args: str,
    env: Mapping[str, str] | None = None,
    isolated: bool = False,
    timeout: float = 60.0,
    input: str | None = None,
) -> BcxRun:
    """Run ``bcx *args`` and wait for it (``subprocess.TimeoutExpired`` after ``timeout``)."""
    full_env = bcx_env(settings, env=env, isolated=isolated)
    if input is None and _POOL.serves(full_env):
        return _POOL.run(args, full_env, timeout)
    proc = subprocess.run(
        [sys.executable, "-m", "better_compute.cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        input=input,
        stdin=subprocess.DEVNULL if input is None else None,
    )
    return BcxRun(proc.returncode, proc.stdout, proc.stderr)


async def bcx(
    settings: Settings | None,
    *args: str,
    env: Mapping[str, str] | None = None,
    isolated: bool = False,
    timeout: float = 60.0,
    input: str | None = None,
) -> BcxRun:
    """``run_bcx`` in a thread: the test's services in this process keep answering meanwhile."""
    return await asyncio.to_thread(
        run_bcx, settings, *args, env=env, isolated=isolated, timeout=timeout, input=input
    )


# The fork server: imports bcx (and what its commands load) once, then for each job (a JSON
# line on stdin) forks a child that runs ``bcx`` with the job's argv, cwd and environment, its
# output in files; answers one JSON line per job: its exit code and output.
_SERVER = r"""
import atexit, faulthandler, json, os, pkgutil, sys, tempfile, time, importlib, traceback
import asyncio, nats, msgspec, signal
import better_compute.cli, better_compute.clients
from better_compute.cli import main as bcx_main
for mod in pkgutil.iter_modules(better_compute.cli.__path__):
    importlib.import_module(f"better_compute.cli.{mod.name}")
reply = os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
for line in sys.stdin:
    job = json.loads(line)
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            os.chdir(job["cwd"])
            os.environ.clear(); os.environ.update(job["env"])
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
            # as a bcx started at a terminal: Ctrl-C raises KeyboardInterrupt (asyncio.run's
            # handler then cancels the command), whatever this server inherited
            signal.signal(signal.SIGINT, signal.default_int_handler)
            faulthandler.register(signal.SIGUSR1, all_threads=True)  # where a run hangs, at its timeout
            bcx_main.main(job["argv"])
            code = 0
        except SystemExit as exit_:
            if isinstance(exit_.code, int) or exit_.code is None:
                code = exit_.code or 0
            else:  # as the interpreter does: the message on stderr, exit code 1
                print(exit_.code, file=sys.stderr); code = 1
        except BaseException:
            traceback.print_exc(); code = 1
        finally:
            try:
                atexit._run_exitfuncs()
                sys.stdout.flush(); sys.stderr.flush()
            finally:
                os._exit(code)
    deadline = time.monotonic() + job["timeout"]
    interrupt = job.get("interrupt")  # Ctrl-C once it printed something, or after that long
    interrupt_at = time.monotonic() + interrupt if interrupt is not None else None
    again_at = None  # a second Ctrl-C 5 s after the first, as an operator presses it again
    timed_out = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            break
        if interrupt_at is not None and (os.fstat(out.fileno()).st_size or time.monotonic() > interrupt_at):
            os.kill(pid, signal.SIGINT); interrupt_at = None; again_at = time.monotonic() + 5.0
        if again_at is not None and time.monotonic() > again_at:
            os.write(err.fileno(), b"bcx fork: still running 5 s after its Ctrl-C: a second one\n")
            os.kill(pid, signal.SIGINT); again_at = None
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGUSR1); time.sleep(0.3)  # its stacks into its stderr
            os.kill(pid, 9); os.waitpid(pid, 0); code = -9; timed_out = True
            break
        time.sleep(0.005)
    out.seek(0); err.seek(0)
    reply.write(json.dumps({"code": code, "out": out.read().decode("utf-8", "replace"),
                            "err": err.read().decode("utf-8", "replace"), "timed_out": timed_out}) + "\n")
    reply.flush()
"""


class BcxForks:
    """``bcx`` runs forked from one process that imported bcx once (see the module). Runs are
    one at a time (a lock); ``run`` blocks, ``bcx`` runs it in a thread. A run over its
    ``timeout`` is killed and answers exit code -9."""

    def __init__(self, settings: Settings | None, *, env: Mapping[str, str] | None = None) -> None:
        self.env = bcx_env(settings, env=env)
        self._lock = threading.Lock()
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=self.env,
        )  # fmt: skip

    def run(
        self,
        *args: str,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 60.0,
        interrupt: float | None = None,
    ) -> BcxRun:
        """``bcx *args``; with ``interrupt``, a command that follows until interrupted gets the
        reader's Ctrl-C (SIGINT) once it printed something, or after ``interrupt`` seconds."""
        got = self._job(list(args), cwd or os.getcwd(), {**self.env, **(env or {})}, timeout, interrupt)
        return BcxRun(got["code"], got["out"], got["err"])

    def _job(
        self,
        argv: list[str],
        cwd: str,
        env: Mapping[str, str],
        timeout: float,
        interrupt: float | None = None,
    ) -> dict[str, Any]:
        """One run: ``env`` is its whole environment. Answers the server's reply."""
        job = {"argv": argv, "cwd": cwd, "env": dict(env), "timeout": timeout, "interrupt": interrupt}
        with self._lock:
            stdin, stdout = self._streams()
            stdin.write(json.dumps(job) + "\n")
            stdin.flush()
            line = stdout.readline()
        if not line:
            raise RuntimeError("the bcx fork server ended")
        got: dict[str, Any] = json.loads(line)
        return got

    async def bcx(
        self,
        *args: str,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 60.0,
        interrupt: float | None = None,
    ) -> BcxRun:
        return await asyncio.to_thread(
            self.run, *args, cwd=cwd, env=env, timeout=timeout, interrupt=interrupt
        )

    def _streams(self) -> tuple[IO[str], IO[str]]:
        stdin, stdout = self._proc.stdin, self._proc.stdout
        assert stdin is not None
        assert stdout is not None
        return stdin, stdout

    def close(self) -> None:
        stdin, stdout = self._streams()
        stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        stdout.close()

    def __enter__(self) -> BcxForks:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


# What the interpreter reads when it starts (its path, flags, stdio encoding): a run whose
# environment differs here from the fork server's needs an interpreter of its own.
_STARTUP_VARS = ("LANG", "LC_ALL", "LC_CTYPE")


class _SharedForks:
    """The fork servers ``run_bcx`` shares in this process: started on first use, one more only
    while every one is busy (runs at once, e.g. a ``bcx … --follow`` beside others), each watched
    (stopped with the test run) and closed when the process exits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[BcxForks] = []
        self._all: list[BcxForks] = []
        self._owner = 0
        self._env: dict[str, str] = {}

    def serves(self, env: Mapping[str, str]) -> bool:
        if os.environ.get("BC_BCX_FORKS", "1") == "0":
            return False
        base = self._env if self._all and self._owner == os.getpid() else os.environ
        keys = {k for k in (*env, *base) if k.startswith("PYTHON") or k in _STARTUP_VARS}
        return all(env.get(k) == base.get(k) for k in keys)

    def run(self, argv: tuple[str, ...], env: Mapping[str, str], timeout: float) -> BcxRun:
        forks = self._take()
        try:
            got = forks._job(list(argv), os.getcwd(), env, timeout)
        except BaseException:
            forks.close()
            with self._lock:
                if forks in self._all:
                    self._all.remove(forks)
            raise
        with self._lock:
            self._idle.append(forks)
        if got.get("timed_out"):
            raise subprocess.TimeoutExpired(["bcx", *argv], timeout, got["out"], got["err"])
        # as ``subprocess.run(text=True)`` reads them: universal newlines
        out, err = (_newlines(got[k]) for k in ("out", "err"))
        return BcxRun(got["code"], out, err)

    def _take(self) -> BcxForks:
        with self._lock:
            if self._owner != os.getpid():  # a forked copy of this process: its own servers
                self._idle, self._all, self._owner = [], [], os.getpid()
                self._env = dict(os.environ)
            if self._idle:
                return self._idle.pop()
            forks = BcxForks(None, env=self._env)
            self._all.append(forks)
            if len(self._all) == 1:
                atexit.register(self.close)
        watch(forks._proc.pid)
        return forks

    def close(self) -> None:
        with self._lock:
            if self._owner != os.getpid():
                return
            every, self._all, self._idle = self._all, [], []
        for forks in every:
            pid = forks._proc.pid
            forks.close()
            unwatch(pid)


def _newlines(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


_POOL = _SharedForks()
