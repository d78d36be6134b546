"""Simulated agents as OS processes (``python -m better_compute.agent.sim``), for tests.

Each keeps its enrollment, journal and execution log in its own state folder, so a test can
count how many times a command really ran, kill the agent and start it again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..clients.cmdq import CommandQueueClient
from ..clients.pki import PkiClient
from ..config import Settings
from .guard import watch
from .processes import spawn_forked
from .waiting import until
from .zygote import ZygoteProc

__all__ = ["SimAgent", "start_sim_agent", "until"]


@dataclass
class SimAgent:
    """One simulated agent process."""

    state: Path
    env: dict[str, str]
    args: list[str]
    proc: subprocess.Popen[bytes] | ZygoteProc | None = None
    logs: list[Path] = field(default_factory=list)

    def start(self, token: str | None = None) -> None:
        log = self.state / f"agent-{len(self.logs)}.log"
        self.logs.append(log)
        extra = ["--token", token] if token else []
        argv = ["better_compute.agent.sim", "--state-dir", str(self.state), *extra, *self.args]
        with open(log, "wb") as out:
            # forked from the test process's service fork server where it can be (processes.py)
            self.proc = spawn_forked(argv, env=self.env, log=log) or subprocess.Popen(
                [sys.executable, "-m", *argv],
                env=self.env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        watch(self.proc.pid)  # stopped with the test run, even a SIGKILLed one

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def wait_exit(self) -> int:
        assert self.proc is not None
        proc = self.proc
        await until(lambda: proc.poll() is not None)
        code = proc.poll()
        assert code is not None
        return code

    def executions(self) -> list[str]:
        """One line per command execution, in order."""
        log = self.state / "exec.log"
        return log.read_text().split("\n")[:-1] if log.exists() else []

    def output(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.logs)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)


async def start_sim_agent(
    settings: Settings,
    state: Path,
    *,
    site_id: str,
    pki: PkiClient,
    cq: CommandQueueClient,
    role: str = "site",
    node_id: str | None = None,
    args: list[str] | None = None,
) -> tuple[SimAgent, str]:
    """Enroll and start an agent of ``site_id``; returns it and its agent id once connected."""
    os.makedirs(state, exist_ok=True)
    env = {
        **os.environ,
        "BC_NATS_URL": settings.nats_url or "",
        "BC_SUBJECT_ROOT": settings.subject_root,
        "BC_APP": settings.app,
    }
    sim = SimAgent(state=state, env=env, args=args or [])
    # by certificate: a node's agent that joins again (a reboot) keeps its id, with a new one
    before = {(a.id, a.cert_id) for a in await cq.agents(site_id=site_id)}
    token = await pki.issue_join_token(
        tenant_id="root",
        role=role,  # type: ignore[arg-type]
        site_id=site_id,
        ttl_seconds=600,
        node_id=node_id,
    )
    sim.start(token.token)
    while True:
        connected = await cq.agents(site_id=site_id, connected=True)
        new = [a.id for a in connected if (a.id, a.cert_id) not in before]
        if new:
            return sim, new[0]
        assert sim.proc is not None
        assert sim.proc.poll() is None, sim.output()
        await asyncio.sleep(0.1)
