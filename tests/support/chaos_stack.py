"""Chaos-test helpers: a private nats-server and PostgreSQL that tests stop, kill and restart,
and the services as processes on them (tests/chaos/conftest.py has the fixtures)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import asyncpg

from better_compute.clients import EngineClient
from better_compute.core.errors import BcError
from better_compute.runtime.embedded import EmbeddedNats, EmbeddedPostgres, pid_alive
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, until
from better_compute.testing.workflows import FINISHED
from better_compute.wire.engine import WorkflowView
from engine_stack import FAST, AgentStack

__all__ = ["FAST", "PrivateServers", "Stack"]


# agents answer fast and are judged silent soon, so the tests see recoveries quickly
class PrivateServers:
    """One nats-server and one PostgreSQL under ``state``, restarted on the same ports and data."""

    def __init__(self, state: Path) -> None:
        self.nats = EmbeddedNats(state)
        self.pg = EmbeddedPostgres(state)  # durable: a SIGKILL must not lose a commit
        self.nats_url = self.nats.start()
        self.database_url = self.pg.start()

    def stop_nats(self) -> None:
        self.nats.stop()

    def start_nats(self) -> None:
        url = self.nats.start()
        assert url == self.nats_url, f"nats-server came back on {url}, not {self.nats_url}"

    def stop_pg(self) -> None:
        self.pg.stop()

    def start_pg(self) -> None:
        url = self.pg.start()
        assert url == self.database_url, f"PostgreSQL came back on {url}, not {self.database_url}"

    def kill_nats(self) -> None:
        pid = self.nats.running_pid()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        _reap(pid)

    def kill_pg(self) -> None:
        """SIGKILL the postmaster and every backend (its process group): a crash, no shutdown."""
        pid = self.pg.running_pid()
        assert pid is not None
        os.killpg(os.getpgid(pid), signal.SIGKILL)
        _reap(pid)

    def close(self) -> None:
        self.nats.stop()
        self.pg.stop()


def _reap(pid: int) -> None:
    """Wait until the killed process is gone (reaped, when it is our child)."""
    deadline = time.monotonic() + 10
    while pid_alive(pid):
        assert time.monotonic() < deadline, f"pid {pid} still alive after SIGKILL"
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.01)


class Stack(AgentStack):
    """The services as processes on the private servers, an API client and simulated agents."""

    def __init__(self, servers: PrivateServers, procs: ServiceProcesses, api: ApiClient, tmp: Path) -> None:
        super().__init__(api, procs.settings, tmp)
        self.servers = servers
        self.procs = procs

    async def db(self) -> asyncpg.Connection:
        return await asyncpg.connect(self.settings.database_url)

    async def finished(self, ids: list[str]) -> list[WorkflowView]:
        """Every workflow once all are finished; asks again while a service is still coming back."""

        async def views() -> list[WorkflowView] | None:
            try:
                got = [await EngineClient(self.api, timeout=2.0).get_workflow(id=i) for i in ids]
            except BcError:
                return None  # UNAVAILABLE or TIMEOUT: a server or service is still away
            return got if all(v.state in FINISHED for v in got) else None

        result: list[WorkflowView] = await until(views)
        return result

    def pids(self) -> dict[str, int]:
        return {p.instance: p.pid for p in self.procs.procs if p.alive()}
