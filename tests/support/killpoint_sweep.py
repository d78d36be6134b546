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
import importlib
import json
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec

from better_compute.clients import CommandQueueClient, EngineClient, PkiClient, SecretsClient
from better_compute.config import Settings
from better_compute.core.errors import BcError
from better_compute.core.ids import new_id
from better_compute.service import ApiClient, connect
from better_compute.service.killpoints import REGISTRY, KillPoint, marker_name
from better_compute.testing import ServiceProcess, ServiceProcesses, until
from better_compute.testing.metal_sim import MetalSim, SimMachine
from better_compute.testing.metal_sim.stack import MediaServer
from better_compute.testing.site_agent import SiteAgentProcess
from better_compute.testing.workflows import FINISHED
from better_compute.wire import Subjects
from better_compute.wire.engine import WorkflowView
from better_compute.wire.metal import NodeBmc
from chaos_stack import PrivateServers

__all__ = ["Case", "Outcome", "Round", "SweepStack", "all_points", "table"]

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


DECLARING = (
    "bc_engine.core.engine",
    "bc_command_queue.delivery",
    "bc_command_queue.claims",
    "bc_command_queue.runs",
    "better_compute.agent.runner",
    "bcd.disks",
    "bc_pki.joins",
)
"""The modules that declare kill points (each on import)."""


def all_points() -> list[KillPoint]:
    """Every declared kill point (importing the modules that declare them)."""
    for module in DECLARING:
        importlib.import_module(module)

    return sorted((p for p in REGISTRY.values() if p.process != "unit"), key=lambda p: p.name)


@dataclass(frozen=True)
class Case:
    point: str
    """``BC_KILL_AT``: a point's name, ``@N`` for its N-th hit in the process."""
    target: str
    """The process killed: ``engine``, ``command-queue``, ``site-agent`` or ``bcd``."""


@dataclass
class Outcome:
    """One workflow of a round: how it ended and what its machine's hardware saw."""

    machine: str
    state: str = "?"
    reason: str = ""
    effects: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)


@dataclass
class Round:
    """Points armed together, the workflows run meanwhile, and which points fired."""

    cases: list[Case]
    fired: dict[str, bool] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0

    def problems(self) -> list[str]:
        found = [f"{c.point} ({c.target}): never hit" for c in self.cases if not self.fired.get(c.point)]
        where = ", ".join(c.point for c in self.cases) or "no kill point"
        return found + [f"{where}: {o.machine}: {p}" for o in self.outcomes for p in o.problems]


def table(rounds: list[Round]) -> str:
    """The per-point outcome table the sweep prints: the points of each round (killed or not,
    restarts), then each workflow of the round (outcome, counts at the hardware, seconds)."""
    rows = [("point", "process", "killed", "outcome", "at the hardware (" + " ".join(ONCE) + ")", "s")]
    for r in rounds:
        for i, c in enumerate(r.cases):
            killed = "yes" if r.fired.get(c.point) else "NO"
            restarts = f"restarts {r.restarts}" if i == 0 and r.restarts else ""
            rows.append((c.point, c.target, killed, restarts, "", f"{r.seconds:.1f}" if i == 0 else ""))
        for o in r.outcomes:
            effects = " ".join(str(o.effects.get(k, 0)) for k in ONCE)
            outcome = o.state + (f" ({o.reason})" if o.reason else "")
            rows.append(("", o.machine, "", outcome[:70], effects, f"{o.seconds:.1f}"))
            rows.extend(("", "", "", f"PROBLEM: {p}", "", "") for p in o.problems)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


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
        self.hold_agent: Callable[[], bool] = lambda: False
        """While true, a dead site agent stays dead (a slow restart, made deterministic)."""

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        # the emulator first: under load, its start competing with four services' took >30 s
        await asyncio.to_thread(self.sim.start)
        for service in ("bc-pki", "bc-secrets"):
            self.procs.start(service)
        for name in SERVICES:
            self._start(name)
        await self.procs.wait_ready(timeout=90)
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
            code = self.agent.proc.poll() if self.agent.proc is not None else None
            killed = code == -signal.SIGKILL
            if code is not None and not (killed and self.hold_agent()):
                if killed:
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
            await self.procs.wait_ready(timeout=90)
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

        await until(connected, timeout=180, what="the site agent connected")

    def need_api(self) -> ApiClient:
        assert self.api is not None
        return self.api

    # -- one deploy-like workflow ------------------------------------------------------

    async def deploy(self) -> tuple[SimMachine, str, MediaServer]:
        """Enroll the next machine as a node and start the workflow; (machine, workflow, medium)."""
        api = self.need_api()
        m = self.sim.machine(self._next)
        self._next += 1
        node = new_id("node")
        creds = json.dumps(self.sim.emulator.credentials).encode()
        ref = await SecretsClient(api).put_for_node(creds, tenant_id="root", node_id=node, label="bmc")
        engine = EngineClient(api, timeout=30.0)  # an engine just restarted answers late under load
        bmc = NodeBmc(driver="redfish", address=m.bmc_url, credentials_ref=ref.ref, system_id=m.uuid)
        await engine.enroll_node(site_id=SITE, id=node, macs=list(m.macs), bmc=bmc)
        token = await PkiClient(api).issue_join_token(
            tenant_id="root", role="provisioned", site_id=SITE, ttl_seconds=900, node_id=node,
            expect={"productUuid": m.uuid},
        )  # fmt: skip
        medium = MediaServer()
        medium_url = medium.add(
            "ramdisk.iso", f"bcd.token={token.token} bcd.control_plane=nats://gw.invalid:4222".encode()
        )
        pid = f"chaos-deploy-{m.index}"
        steps: list[dict[str, Any]] = [
            {"use": "media.insert", "on": "site", "with": {"url": medium_url, "device": "cd"}},
            {"use": "management.setBootDevice", "on": "site", "with": {"device": "cd"}},
            {"use": "power.setPower", "on": "site", "with": {"action": "on"}},
            {"use": "wait.agentJoined"},
            {"use": "disk.wipe", "with": {"mode": "quick"}},
            {"use": "media.eject", "on": "site", "with": {"device": "cd"}},
            {"use": "power.setPower", "on": "site", "with": {"action": "off"}},
        ]
        # the medium boots the ramdisk that wipes: it writes a disk
        doc = {"id": pid, "version": 1, "target": "metal", "role": "host", "writesDisk": True, "steps": steps}
        await engine.create_profile(document=doc)
        wf = await engine.start_workflow(profile_id=pid, node_id=node)
        return m, wf.id, medium

    async def finished(self, ids: list[str], timeout: float = 300.0) -> list[WorkflowView]:
        """Every workflow once all are finished; asks again while a service is still away."""

        async def views() -> list[WorkflowView] | None:
            try:
                got = [await EngineClient(self.need_api(), timeout=2.0).get_workflow(id=i) for i in ids]
            except BcError:
                return None
            return got if all(v.state in FINISHED for v in got) else None

        result: list[WorkflowView] = await until(views, timeout=timeout, what="the workflows finished")
        return result

    async def run(self, cases: list[Case], machines: int = 1) -> Round:
        """Arm ``cases`` (each in its process), deploy ``machines`` machines at once, wait for
        every workflow's end, and count at the hardware. A point that fired stays armed (its
        marker keeps it from firing again); one that did not is disarmed."""
        marker_dir = self.tmp / "kill" / f"{self._next:03d}"
        rnd = Round(cases)
        before = dict(self.restarts)
        env = {"BC_KILL_MARKER_DIR": str(marker_dir)}
        await asyncio.gather(*(self.arm(c.target, {**env, "BC_KILL_AT": c.point}) for c in cases))
        t0 = time.monotonic()
        deployed = await asyncio.gather(*(self.deploy() for _ in range(machines)))
        await self._judge(rnd, deployed, t0, self.finished([wf for _, wf, _ in deployed]))
        rnd.fired = {c.point: (marker_dir / _marker(c.point)).exists() for c in cases}
        rnd.restarts = {k: n - before.get(k, 0) for k, n in self.restarts.items() if n > before.get(k, 0)}
        bcds = sum(m.ledger.count("bcd.restarted") for m, _, _ in deployed)
        if bcds:
            rnd.restarts["bcd"] = bcds  # the simulator restarts them (supervise_bcd)
        await asyncio.gather(*(self.arm(c.target, {}) for c in cases if not rnd.fired[c.point]))
        return rnd

    async def run_with_server_restarts(self, machines: int = 3) -> Round:
        """Deploy ``machines`` at once; SIGKILL nats-server and start it again once each has
        begun, then PostgreSQL (postmaster and backends) once one waits for its join or later."""
        rnd = Round(
            [
                Case("nats-server SIGKILL + start", "nats-server"),
                Case("PostgreSQL SIGKILL + start", "postgres"),
            ]
        )
        t0 = time.monotonic()
        deployed = await asyncio.gather(*(self.deploy() for _ in range(machines)))
        ids = [wf for _, wf, _ in deployed]

        async def reached(idx: int) -> bool:
            try:
                views = [await EngineClient(self.need_api(), timeout=2.0).get_workflow(id=i) for i in ids]
            except BcError:
                return False
            return any(isinstance(v.steps, list) and v.steps[idx].state != "pending" for v in views)

        async def restart_servers_then_finish() -> list[WorkflowView]:
            await until(lambda: reached(1), timeout=60, what="a workflow past its first step")
            await asyncio.to_thread(self.servers.kill_nats)
            await asyncio.to_thread(self.servers.start_nats)
            rnd.fired[rnd.cases[0].point] = True
            await until(lambda: reached(3), timeout=90, what="a workflow waiting for its join")
            await asyncio.to_thread(self.servers.kill_pg)
            await asyncio.to_thread(self.servers.start_pg)
            rnd.fired[rnd.cases[1].point] = True
            return await self.finished(ids, timeout=180)

        await self._judge(rnd, deployed, t0, restart_servers_then_finish())
        return rnd

    async def _judge(
        self,
        rnd: Round,
        deployed: list[tuple[SimMachine, str, MediaServer]],
        t0: float,
        finish: Awaitable[list[WorkflowView]],
    ) -> None:
        """Await ``finish`` (the round's workflows at their end; a stall is its AssertionError),
        close the media, and add each machine's outcome and the round's time to ``rnd``."""
        try:
            views: list[WorkflowView | None] = list(await finish)
            stalled = ""
        except AssertionError as exc:
            views, stalled = [None] * len(deployed), (str(exc).splitlines() or [repr(exc)])[0]
        finally:
            for _, _, medium in deployed:
                medium.close()
        rnd.seconds = time.monotonic() - t0
        for (m, _, _), view in zip(deployed, views, strict=True):
            rnd.outcomes.append(self._outcome(m, view, stalled))

    def _outcome(self, m: SimMachine, view: WorkflowView | None, stalled: str) -> Outcome:
        out = Outcome(m.name, effects=m.ledger.counts())
        if view is None:
            out.state, out.problems = "stalled", [stalled]
        else:
            out.state, out.reason = view.state, _reason(view)
            out.seconds = _seconds(view)
            if view.state == "failed" and not out.reason:
                out.problems.append("failed without a reason")
        judge(out, m)
        return out


def _marker(point: str) -> str:
    name, _, nth = point.partition("@")
    return marker_name(name, int(nth or 1))


def _reason(view: WorkflowView) -> str:
    steps = view.steps if isinstance(view.steps, list) else []
    failed = next((s for s in steps if s.state == "failed"), None)
    if view.state != "failed":
        return ""
    error = (failed.error if failed is not None else None) or view.error or {}
    return f"{failed.action if failed else 'workflow'}: {error.get('message', '')}" if error else ""


def _seconds(view: WorkflowView) -> float:
    if not view.created_at or not view.finished_at:
        return 0.0
    return (
        datetime.fromisoformat(view.finished_at) - datetime.fromisoformat(view.created_at)
    ).total_seconds()


def judge(out: Outcome, m: SimMachine) -> None:
    """What a user would notice: a destructive change twice, a success that did not wipe."""
    for key in ONCE:
        if out.effects.get(key, 0) > 1:
            out.problems.append(f"{key} happened {out.effects[key]} times at the hardware")
    repeated = m.ledger.repeated_writes()
    if repeated:
        out.problems.append(f"disk writes repeated by one command: {repeated}")
    if out.state == "succeeded" and out.effects.get("disk.write:vda:node.wipe", 0) != 1:
        out.problems.append("succeeded but the disk was not wiped once")
