"""Service processes for end-to-end tests: each service its own OS process.

Each is forked from this process's service fork server (``service_forkserver``: the services
imported once, about 1 s of CPU saved per start) unless its environment changes what an
interpreter reads at start (``PYTHON*``, locale) or ``BC_SERVICE_FORKS=0`` is set: then it is
``python -m bc_<service>``. Either way it is its own process with its own pid, environment, log
file and exit code, and signals reach it alone.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

from ..config import Settings
from ..runtime.dev import SERVICES
from ..runtime.embedded import pid_alive
from ..service.client import connect, discover
from .guard import unwatch, watch
from .zygote import Zygote, ZygoteProc

__all__ = ["ServiceProcess", "ServiceProcesses", "spawn_forked"]


class ServiceProcess:
    """One running service process, its output captured to a file."""

    def __init__(
        self,
        service: str,
        proc: subprocess.Popen[bytes] | ZygoteProc,
        log: Path,
        handle: IO[bytes],
        *,
        instance: str = "",
        args: tuple[str, ...] = (),
    ) -> None:
        self.service = service
        self.instance = instance
        self.args = args
        self.proc = proc
        self.log = log
        self._handle = handle
        self.killed = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None and pid_alive(self.proc.pid)

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL: the crash an operator fears, no cleanup at all."""
        self.killed = True
        self.signal(signal.SIGKILL)
        self.proc.wait(10)

    async def wait_exit(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                return code
            await asyncio.sleep(0.02)
        return None

    def output(self) -> str:
        if not self._handle.closed:
            self._handle.flush()
        return self.log.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        unwatch(self.proc.pid)
        self._handle.close()


class ServiceProcesses:
    """Starts services with one ``Settings`` and stops them all at the end."""

    def __init__(self, settings: Settings, log_dir: Path, *, env: dict[str, str] | None = None) -> None:
        self.settings = settings
        self.log_dir = log_dir
        self.extra_env = env or {}
        self.procs: list[ServiceProcess] = []
        self._n = 0

    def start(self, service: str, *args: str, instance: str | None = None) -> ServiceProcess:
        """Start ``service`` as instance ``instance`` (default ``<service>-<n>``, a new name each time)."""
        self._n += 1
        instance = instance or f"{service}-{self._n}"
        env = dict(os.environ)
        env.update(
            BC_NATS_URL=self.settings.nats_url or "",
            BC_DATABASE_URL=self.settings.database_url or "",
            BC_SUBJECT_ROOT=self.settings.subject_root,
            BC_APP=self.settings.app,
            BC_STATE_DIR=self.settings.state_dir,
            BC_LOG_LEVEL=self.settings.log_level,
            **self.extra_env,
        )
        log = self.log_dir / f"{service}-{self._n}.log"
        handle = open(log, "wb")  # noqa: SIM115 -- closed by ServiceProcess.close
        argv = [SERVICES[service], "--instance", instance, *args]
        proc: subprocess.Popen[bytes] | ZygoteProc
        forked = spawn_forked(argv, env=env, log=log)
        if forked is not None:
            proc = forked
        else:
            proc = subprocess.Popen(
                [sys.executable, "-m", *argv],
                env=env,
                stdout=handle,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        watch(proc.pid)  # stopped with the test run even when pytest is killed (guard.watch)
        sp = ServiceProcess(service, proc, log, handle, instance=instance, args=args)
        self.procs.append(sp)
        return sp

    def live(self, service: str) -> list[ServiceProcess]:
        """The running instances of ``service``, oldest first."""
        return [p for p in self.procs if p.service == service and p.alive()]

    def restart(self, old: ServiceProcess) -> ServiceProcess:
        """Start ``old``'s service again under the same instance name, as a supervisor does."""
        return self.start(old.service, *old.args, instance=old.instance)

    async def wait_ready(self, *, timeout: float = 90.0) -> list[dict[str, Any]]:
        """Wait until every live process answers ``$SRV.STATS``; returns what answered."""
        assert self.settings.nats_url
        nc = await connect(self.settings.nats_url, name="bc-test", allow_reconnect=False)
        try:
            deadline = time.monotonic() + timeout
            while True:
                found = await discover(nc, root=self.settings.subject_root, wait=0.2)
                pids = {str((d.get("metadata") or {}).get("pid")) for d in found}
                waiting = [p for p in self.procs if p.alive() and str(p.pid) not in pids]
                dead = [
                    p
                    for p in self.procs
                    if not p.killed and not p.alive() and p.proc.returncode not in (0, None)
                ]
                if dead:
                    raise RuntimeError(f"{dead[0].service} exited early:\n{dead[0].output()[-4000:]}")
                if not waiting:
                    return found
                if time.monotonic() > deadline:
                    tail = waiting[0].output()[-4000:]
                    raise TimeoutError(f"{waiting[0].service} not ready after {timeout}s:\n{tail}")
        finally:
            await nc.close()

    def close(self) -> None:
        for p in self.procs:
            p.close()


# What the interpreter reads when it starts (its path, flags, stdio encoding): a service whose
# environment differs here from the fork server's needs an interpreter of its own.
_STARTUP_VARS = ("LANG", "LC_ALL", "LC_CTYPE")


class ServiceZygote(Zygote):
    COMMAND = ("-m", "better_compute.testing.service_forkserver")
    NAME = "service fork server"


class _SharedZygote:
    """This process's service fork server: started on first use, watched (stopped with the test
    run), closed when the process exits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._zygote: ServiceZygote | None = None
        self._owner = 0
        self._env: dict[str, str] = {}
        self._log = ""

    def get(self, env: dict[str, str]) -> ServiceZygote | None:
        if os.environ.get("BC_SERVICE_FORKS", "1") == "0":
            return None
        with self._lock:
            if self._owner != os.getpid():  # a forked copy of this process: a server of its own
                self._zygote, self._owner = None, os.getpid()
                atexit.register(self.close)
            if self._zygote is None or self._zygote.proc.poll() is not None:
                self._env = dict(os.environ)  # the server's: it inherits ours
            keys = {k for k in (*env, *self._env) if k.startswith("PYTHON") or k in _STARTUP_VARS}
            if any(env.get(k) != self._env.get(k) for k in keys):
                return None
            if self._zygote is None or self._zygote.proc.poll() is not None:
                fd, self._log = tempfile.mkstemp(prefix="bc-service-forks-", suffix=".log")
                os.close(fd)
                self._zygote = ServiceZygote(self._log)
                watch(self._zygote.proc.pid)
            return self._zygote

    def close(self) -> None:
        with self._lock:
            zygote, self._zygote = self._zygote, None
            if zygote is None or self._owner != os.getpid():
                return
        pid = zygote.proc.pid
        zygote.close()
        unwatch(pid)
        with contextlib.suppress(OSError):
            os.unlink(self._log)


_FORKS = _SharedZygote()


def spawn_forked(argv: list[str], *, env: dict[str, str], log: Path) -> ZygoteProc | None:
    """``python -m *argv`` (a service's, the site agent's, bcd's or a simulated agent's module)
    with ``env``, its output appended to ``log``, forked from this process's service fork
    server; ``None`` when that server cannot start it as the interpreter would
    (``_SharedZygote.get``)."""
    zygote = _FORKS.get(env)
    if zygote is None:
        return None
    # the first spawn waits for the server to import the services (long on a loaded machine)
    return zygote.spawn(argv, env=env, log=str(log), cwd=os.getcwd(), timeout=180)
