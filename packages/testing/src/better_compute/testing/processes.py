"""Service processes for end-to-end tests: each service its own OS process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from ..config import Settings
from ..runtime.dev import SERVICES
from ..runtime.embedded import pid_alive
from ..service.client import connect, discover
from .guard import unwatch, watch

__all__ = ["ServiceProcess", "ServiceProcesses"]


class ServiceProcess:
    """One running service process, its output captured to a file."""

    def __init__(
        self,
        service: str,
        proc: subprocess.Popen[bytes],
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
        proc = subprocess.Popen(
            [sys.executable, "-m", SERVICES[service], "--instance", instance, *args],
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
