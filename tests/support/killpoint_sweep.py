"""The kill-point sweep (issue 14 item 5, docs/chaos.md): a deploy-like workflow on a simulated
machine with one process SIGKILLed at a named point, restarted by ``Supervisor``, and what the
hardware saw counted in the machine's ledger.

The workflow: insert a virtual medium (its boot command line carries a join token bound to the
node), boot from CD once, power on, wait for the ramdisk's bcd to join, wipe the disk, eject,
power off: every BMC change through the engine, the command queue and the real site agent's
Redfish driver to the simulator's sushy-emulator, the wipe through bcd on the simulated disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from better_compute.clients import CommandQueueClient, EngineClient, PkiClient, SecretsClient
from better_compute.config import Settings
from better_compute.core.errors import BcError
from better_compute.core.ids import new_id
from better_compute.service import ApiClient, connect
from better_compute.service.killpoints import REGISTRY, KillPoint
from better_compute.testing import ServiceProcess, ServiceProcesses, until
from better_compute.testing.metal_sim import MetalSim, SimMachine
from better_compute.testing.site_agent import SiteAgentProcess
from better_compute.testing.workflows import FINISHED
from better_compute.wire import Subjects
from better_compute.wire.engine import WorkflowView
from better_compute.wire.metal import NodeBmc
from chaos_stack import PrivateServers

__all__ = ["Case", "Outcome", "SweepStack", "all_points", "table"]

SITE = "chaos1"
ENV = {
    "BC_CMDQ_HEARTBEAT": "200ms",
    "BC_CMDQ_SILENT_AFTER": "3s",
    "BC_CMDQ_SWEEP": "100ms",
    "BC_CMDQ_REDELIVER_AFTER": "1s",
    "BC_CMDQ_ACK_WAIT": "2s",
}
SERVICES = {"engine": "bc-engine", "command-queue": "bc-command-queue"}
# What the hardware may see at most once per workflow (the ledger's ``counts()`` keys).
ONCE = ("power.requested:On", "power.requested:Off", "media.insert:Cd", "disk.write:vda:node.wipe")


def all_points() -> list[KillPoint]:
    """Every declared kill point (importing the modules that declare them)."""
    import bc_command_queue.claims
    import bc_command_queue.delivery
    import bc_command_queue.runs
    import bc_engine.engine
    import bcd.disks

    import better_compute.agent.runner  # noqa: F401 - they declare their points on import

    return sorted((p for p in REGISTRY.values() if p.process != "unit"), key=lambda p: p.name)


@dataclass(frozen=True)
class Case:
    point: str
    """``BC_KILL_AT``: a point's name, ``@N`` for its N-th hit in the process."""
    target: str
    """The process killed: ``engine``, ``command-queue``, ``site-agent`` or ``bcd``."""


@dataclass
class Outcome:
    case: Case
    fired: bool = False
    state: str = "?"
    reason: str = ""
    effects: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    restarts: int = 0
    problems: list[str] = field(default_factory=list)


def table(outcomes: list[Outcome]) -> str:
    """The per-point outcome table the sweep prints."""
    rows = [("point", "process", "killed", "outcome", "at the hardware", "s")]
    for o in outcomes:
        effects = " ".join(f"{k.split(':', 1)[1] if ':' in k else k}={o.effects.get(k, 0)}" for k in ONCE)
        outcome = o.state + (f" ({o.reason})" if o.reason else "")
        rows.append((o.case.point, o.case.target, "yes" if o.fired else "NO", outcome[:60], effects,
                     f"{o.seconds:.1f}"))  # fmt: skip
        rows.extend(("", "", "", f"PROBLEM: {p}", "", "") for p in o.problems)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


class _Served:
    """One file over HTTP (the virtual medium whose first bytes are its boot command line)."""

    def __init__(self, body: bytes) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/ramdisk.iso"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class SweepStack:
    """Private nats-server and PostgreSQL, the four services as processes, the simulator with
    one machine per case, and the real site agent; ``Supervisor`` restarts what dies."""

    def __init__(self, tmp: Path, settings: Settings, procs: ServiceProcesses, machines: int) -> None:
        self.tmp = tmp
        self.servers = PrivateServers(tmp / "servers")
        self.settings = msgspec.structs.replace(
            settings, nats_url=self.servers.nats_url, database_url=self.servers.database_url
        )
        self.procs = procs
        procs.settings = self.settings
        procs.extra_env.update(ENV)
        self.base_env = dict(procs.extra_env)
        self.env: dict[str, dict[str, str]] = {}
        self.current: dict[str, ServiceProcess] = {}
        self.restarts: dict[str, int] = {}
        self.sim = MetalSim(
            tmp / "sim", settings=self.settings, machines=machines, site_id=SITE, seed=14,
            power_delay=(0.1, 0.4), supervise_bcd=True,
        )  # fmt: skip
        self.agent = SiteAgentProcess(
            folder=tmp / "site-agent", nats_url=self.servers.nats_url,
            subject_root=self.settings.subject_root, site_id=SITE,
        )  # fmt: skip
        self.sim.boot_url = self.agent.url
        self.api: ApiClient | None = None
        self._nc: Any = None
        self._supervisor: asyncio.Task[None] | None = None
        self._next = 0

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        for service in ("bc-pki", "bc-secrets"):
            self.procs.start(service)
        for name in SERVICES:
            self._start(name)
        await asyncio.gather(self.procs.wait_ready(), asyncio.to_thread(self.sim.start))
        self._nc = await connect(self.servers.nats_url, name="bc-test")
        self.api = ApiClient(self._nc, Subjects(root=self.settings.subject_root))
        token = await PkiClient(self.api).issue_join_token(
            tenant_id="root", role="site", site_id=SITE, ttl_seconds=600
        )
        self.agent.write_config(token.token)
        self.agent.start()
        await self.site_agent_connected()
        self._supervisor = asyncio.create_task(self._supervise())

    async def close(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        self.agent.close()
        await asyncio.to_thread(self.sim.close)
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()
        self.procs.close()
        self.servers.close()

    def _start(self, name: str) -> ServiceProcess:
        """Start (or restart, as its supervisor) one of the killable services with its env."""
        self.procs.extra_env = {**self.base_env, **self.env.get(name, {})}
        old = self.current.get(name)
        try:
            sp = self.procs.restart(old) if old is not None else self.procs.start(SERVICES[name])
        finally:
            self.procs.extra_env = dict(self.base_env)
        self.current[name] = sp
        return sp

    async def _supervise(self) -> None:
        """Restart a killed engine, command queue or site agent (systemd's ``Restart=always``);
        a machine's bcd is restarted by the simulator (``supervise_bcd``)."""
        while True:
            for name, sp in list(self.current.items()):
                if not sp.alive() and not sp.killed:
                    sp.killed = True  # seen: wait_ready does not count it as failed
                    self.restarts[name] = self.restarts.get(name, 0) + 1
                    self._start(name)
            if self.agent.proc is not None and self.agent.proc.poll() is not None:
                if self.agent.proc.returncode == -signal.SIGKILL:
                    self.restarts["site-agent"] = self.restarts.get("site-agent", 0) + 1
                self.agent.start()
            await asyncio.sleep(0.1)

    async def arm(self, target: str, env: dict[str, str]) -> None:
        """Run ``target`` with ``env`` from now on (empty: disarmed), restarting it cleanly."""
        if target in SERVICES:
            self.env[target] = env
            old = self.current[target]
            old.killed = True  # a deliberate stop, not a crash the supervisor restarts
            old.signal(signal.SIGTERM)
            if await old.wait_exit(15) is None:
                old.kill()
            self._start(target)
            await self.procs.wait_ready()
        elif target == "site-agent":
            proc = self.agent.proc
            self.agent.env = env
            if proc is not None:
                proc.terminate()  # the supervisor starts it again, with the new env
                await asyncio.to_thread(proc.wait, 15)
            await until(lambda: self.agent.proc is not proc and self.agent.proc is not None)
            await self.site_agent_connected()
        elif target == "bcd":
            self.sim.bcd_env = env  # for the bcds machines boot from now on
        else:
            raise ValueError(target)

    async def site_agent_connected(self) -> None:
        cq = CommandQueueClient(self.need_api(), timeout=3.0)

        async def connected() -> bool:
            try:
                return any(a.role == "site" for a in await cq.agents(site_id=SITE, connected=True))
            except BcError:
                return False

        await until(connected, timeout=60, what="the site agent connected")

    def need_api(self) -> ApiClient:
        assert self.api is not None
        return self.api

    # -- one deploy-like workflow ------------------------------------------------------

    async def deploy(self) -> tuple[SimMachine, str, _Served]:
        """Enroll the next machine as a node and start the workflow; (machine, workflow, medium)."""
        api = self.need_api()
        m = self.sim.machine(self._next)
        self._next += 1
        node = new_id("node")
        creds = json.dumps(self.sim.emulator.credentials).encode()
        ref = await SecretsClient(api).put_for_node(creds, tenant_id="root", node_id=node, label="bmc")
        engine = EngineClient(api, timeout=10.0)
        bmc = NodeBmc(driver="redfish", address=m.bmc_url, credentials_ref=ref.ref, system_id=m.uuid)
        await engine.enroll_node(site_id=SITE, id=node, macs=list(m.macs), bmc=bmc)
        token = await PkiClient(api).issue_join_token(
            tenant_id="root", role="provisioned", site_id=SITE, ttl_seconds=900, node_id=node,
            expect={"productUuid": m.uuid},
        )  # fmt: skip
        medium = _Served(f"bcd.token={token.token} bcd.control_plane=nats://gw.invalid:4222".encode())
        pid = f"chaos-deploy-{m.index}"
        steps: list[dict[str, Any]] = [
            {"use": "media.insert", "on": "site", "with": {"url": medium.url, "device": "cd"}},
            {"use": "management.setBootDevice", "on": "site", "with": {"device": "cd"}},
            {"use": "power.setPower", "on": "site", "with": {"action": "on"}},
            {"use": "wait.agentJoined"},
            {"use": "disk.wipe", "with": {"mode": "quick"}},
            {"use": "media.eject", "on": "site", "with": {"device": "cd"}},
            {"use": "power.setPower", "on": "site", "with": {"action": "off"}},
        ]
        doc = {"id": pid, "version": 1, "target": "metal", "role": "host", "steps": steps}
        await engine.create_profile(document=doc)
        wf = await engine.start_workflow(profile_id=pid, node_id=node)
        return m, wf.id, medium

    async def finished(self, ids: list[str], timeout: float = 120.0) -> list[WorkflowView]:
        """Every workflow once all are finished; asks again while a service is still away."""

        async def views() -> list[WorkflowView] | None:
            try:
                got = [await EngineClient(self.need_api(), timeout=2.0).get_workflow(id=i) for i in ids]
            except BcError:
                return None
            return got if all(v.state in FINISHED for v in got) else None

        result: list[WorkflowView] = await until(views, timeout=timeout, what="the workflows finished")
        return result

    async def run(self, case: Case) -> Outcome:
        """One case: arm the point, deploy a machine, wait for the end, count at the hardware."""
        marker_dir = self.tmp / "kill" / f"{self._next:02d}"
        out = Outcome(case)
        before = dict(self.restarts)
        await self.arm(case.target, {"BC_KILL_AT": case.point, "BC_KILL_MARKER_DIR": str(marker_dir)})
        t0 = time.monotonic()
        m, wf_id, medium = await self.deploy()
        try:
            [view] = await self.finished([wf_id])
        except AssertionError as exc:
            out.state, out.problems = "stalled", [str(exc).splitlines()[0]]
            view = None
        finally:
            medium.close()
        out.seconds = time.monotonic() - t0
        await self.arm(case.target, {})
        out.fired = any(marker_dir.glob("*.fired"))
        out.restarts = sum(self.restarts.values()) - sum(before.values())
        out.effects = m.ledger.counts()
        if view is not None:
            out.state = view.state
            failed = next((s for s in view.steps or [] if s.state == "failed"), None)
            if view.state == "failed":
                error = (failed.error if failed is not None else None) or view.error or {}
                out.reason = f"{failed.action if failed else '?'}: {error.get('message', '')}"
                if not error:
                    out.problems.append("failed without a reason")
        judge(out, m)
        return out


def judge(out: Outcome, m: SimMachine) -> None:
    """What a user would notice: a point that never fired, a destructive change twice."""
    if not out.fired:
        out.problems.append("the kill point was never hit")
    for key in ONCE:
        if out.effects.get(key, 0) > 1:
            out.problems.append(f"{key} happened {out.effects[key]} times at the hardware")
    repeated = m.ledger.repeated_writes()
    if repeated:
        out.problems.append(f"disk writes repeated by one command: {repeated}")
    if out.state == "succeeded" and out.effects.get("disk.write:vda:node.wipe", 0) != 1:
        out.problems.append("succeeded but the disk was not wiped once")
