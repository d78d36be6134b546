"""Fleet benchmark: N simulated machines over S sites deployed by one bulk verb.

    uv run --group bench python bench/bench_fleet.py --machines 1000 --sites 10
    uv run --group bench python bench/bench_fleet.py --machines 100 --sites 2 --power-delay 1-11
    uv run --group bench python bench/bench_fleet.py --machines 1000 --sites 10 --lean
    uv run --group bench python bench/bench_fleet.py --machines 100 --sites 2 --lean \
        --engines 3 --queues 2 --pkis 2 --secrets 2 --kill-mid-deploy

Everything as it runs in production, on this machine: the embedded nats-server and PostgreSQL
(fsync on), bc-engine, bc-command-queue, bc-pki and bc-secrets as their own processes, one real
bc-site-agent per site driving that site's simulator (one sushy-emulator per site) through its
Redfish driver, and the ``bcd --simulate`` processes the simulators boot (the ramdisk's, then
the installed OS's). The app is the metal simulator's (``metal_sim.app``): the page's
``ubuntu-24.04-autoinstall`` profile.

The machines are enrolled, inspected and commissioned first (bulk verbs, timed as the prelude);
then one ``metal.bulk deploy`` over every node. Prints the time from that verb to the last
machine ``deployed``, machines per second, commands per second in that window, the p50/p99 of
each machine's deploy workflow (created to finished), and the CPU seconds each kind of process
used during the deploy (where the time goes). ``--power-delay 0`` (the default) is a BMC that
answers at once; ``1-11`` is sushy-tools' own fake driver (a power change lands 1-11 s late).

The CPU is split into the product (``PRODUCT_KINDS``: every process we ship to the operator's
servers, nats-server and PostgreSQL included) and the simulation (the machines' bcds, the
emulators, and this process, which runs the simulators' threads); the headline is the product's
CPU seconds per deployed machine. Next to it, the product's CPU over the machines' own (their
bcds and BMC emulators, ``over_yardstick``): these VMs run 10-40% faster or slower from one
quarter-hour to the next, and that ratio, both sides measured in the same run, moves with
what the product does. ``--lean`` (``BC_SIM_LEAN=1``) runs each site's bcds as tasks
of one process (``bcd.lean``) instead of a process each, so a thousand machines cost the
simulation a few processes, not a thousand.

``--window W`` keeps at most W machines in each phase at once (the next ones, spread over the
sites, start as others end; 0, the default, is all at once). Before the engine admitted a site's
workflows in turn (``[engine] site_admission``, docs/engine.md), one bulk verb over 10,000 machines
timed out about half (a step's deadline counted its time queued behind its site's other
commands; bench/README.md, "10,000 machines"); the window was the workaround.

``--engines/--queues/--pkis/--secrets N`` run N instances of that service. ``--kill-mid-deploy``
SIGKILLs one instance of each service run with two or more, once half the machines' deploys are
past their first BMC command (counted at the simulated BMCs), and nothing restarts them; the
benchmark then checks, at the simulated hardware and in the engine: every machine deployed and
installed once, no disk write twice, the same power changes at every machine's BMC, every deploy
workflow ``succeeded``, no workflow still running and no command still live. The memory (PSS) of
every service instance is printed at the end. Any finding exits 1.

``--agent-events`` also counts the agents' signed events (hello, heartbeat, ack, check, progress,
result: each one an Ed25519 check and mostly a statement at the command queue) per machine in each
phase. ``--db-socket`` gives the services PostgreSQL's Unix socket instead of TCP 127.0.0.1
(``bench_db_socket.py`` measures a statement over each).

``--statements`` has PostgreSQL log every statement (``log_statement = all``, which costs
PostgreSQL CPU: the run's CPU figures are not the product's then) and prints, per phase, the
statements per machine by their first words, the largest first: where the round trips go.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
from bench_workflows import set_log_statement, statements_per_step

from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.engine import EngineClient
from better_compute.clients.pki import PkiClient
from better_compute.clients.secrets import SecretsClient
from better_compute.config import Settings
from better_compute.core.ids import new_id
from better_compute.logging import configure_logging
from better_compute.runtime.embedded import EmbeddedNats, EmbeddedPostgres
from better_compute.service.client import ApiClient, connect
from better_compute.testing import ServiceProcesses, until
from better_compute.testing.images import register_sim_image
from better_compute.testing.metal_sim import MetalSim
from better_compute.testing.metal_sim.stack import APP, SERVICES, MediaServer
from better_compute.testing.site_agent import SiteAgentProcess
from better_compute.wire import Subjects
from better_compute.wire.cmdq import LIVE_STATES
from better_compute.wire.engine import decode_node_event
from better_compute.wire.metal import NodeBmc, VerbName

PROFILE = "ubuntu-24.04-autoinstall"
# the requests whose count per machine each phase prints (name, subject under <root>.api.)
WATCHED_REQUESTS = (
    ("enqueue", "command-queue.commands.enqueue"),
    ("tokens.issue", "pki.tokens.issue"),
    ("secrets.put", "secrets.secrets.put"),
    ("commands.states", "command-queue.commands.states"),
)
IMAGE = "ubuntu@24.04"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


def cpu_of(pid: int) -> float:
    """CPU seconds of ``pid`` and its reaped children (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return (utime + stime + cutime + cstime) / CLK_TCK


def pss_of(pid: int) -> float:
    """Proportional set size of ``pid`` in MiB (shared pages split among their sharers: a
    thousand forked bcds are not counted a thousand times), 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return 0.0


def process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process."""
    out: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out[int(entry.name)] = (ppid, cmd)
    return out


PRODUCT_KINDS = (
    "bc-engine", "bc-command-queue", "bc-pki", "bc-secrets", "site agents", "nats-server", "PostgreSQL",
)  # fmt: skip
"""What we ship to the operator's servers (bcd runs on the machines: with the simulation here)."""
SIMULATION_KINDS = ("bcd (simulated)", "sushy emulators", "simulator (this process)")
YARDSTICK_KINDS = ("bcd (simulated)", "sushy emulators")
"""The machines' own work (their bcds, their BMCs), the same in every run of one profile: the
product's CPU over it moves with what the product does, not with how fast the VM is that hour
(one code's inspect measured 0.161-0.230 CPU s a machine in four runs within 15 minutes, its
product over this 2.79-3.05). Not a yardstick across a change of what reaches the BMCs."""


def over_yardstick(cpu: dict[str, float]) -> float | None:
    """The product's CPU over the machines' own (``YARDSTICK_KINDS``) in one phase."""
    machines = sum(cpu.get(k, 0.0) for k in YARDSTICK_KINDS)
    return round(sum(cpu.get(k, 0.0) for k in PRODUCT_KINDS) / machines, 2) if machines > 0 else None


def rss_of(pid: int) -> float:
    """Resident set size of ``pid`` in MiB, 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return 0.0


def classify(cmd: str) -> str:
    """The kind of a process the benchmark did not start itself, by its command line: the servers
    (nats-server, PostgreSQL) and the simulation's (emulators, bcds or their lean hosts)."""
    for needle, name in (
        ("sushy", "sushy emulators"), ("emulator_main", "sushy emulators"), ("zygote", "bcd (simulated)"),
        ("bcd", "bcd (simulated)"), ("nats-server", "nats-server"), ("postgres", "PostgreSQL"),
    ):  # fmt: skip
        if needle in cmd:
            return name
    return "other"


class CpuMeter:
    """CPU seconds per kind of process, from a snapshot before to one after (children counted)."""

    def __init__(self, started: dict[int, str], *roots: int) -> None:
        self.started = started
        """The kinds of the processes the benchmark started (services, site agents) by pid; any
        other process is told by its command line (``classify``)."""
        self.roots = roots

    def _descendants(self) -> dict[int, str]:
        table = process_table()
        kids: dict[int, list[int]] = {}
        for pid, (ppid, _) in table.items():
            kids.setdefault(ppid, []).append(pid)
        out: dict[int, str] = {}
        todo = [root for root in self.roots if root in table]
        while todo:
            pid = todo.pop()
            kind = self.started.get(pid) or classify(table[pid][1])
            out[pid] = "simulator (this process)" if pid == os.getpid() else kind
            todo.extend(kids.get(pid, []))
        return out

    def snapshot(self) -> dict[int, tuple[str, float]]:
        return {pid: (kind, cpu_of(pid)) for pid, kind in self._descendants().items()}

    def memory(self) -> dict[str, float]:
        """MiB (PSS) per kind of process now."""
        out: dict[str, float] = {}
        for pid, kind in self._descendants().items():
            out[kind] = out.get(kind, 0.0) + pss_of(pid)
        return out

    def resident(self) -> dict[str, tuple[int, float]]:
        """(processes, MiB RSS summed) per kind of process now."""
        out: dict[str, tuple[int, float]] = {}
        for pid, kind in self._descendants().items():
            n, mib = out.get(kind, (0, 0.0))
            out[kind] = (n + 1, mib + rss_of(pid))
        return out

    @staticmethod
    def delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
        out: dict[str, float] = {}
        for pid, (kind, cpu) in after.items():
            out[kind] = out.get(kind, 0.0) + cpu - (before[pid][1] if pid in before else 0.0)
        return out


async def until_states(
    counts: Callable[[], dict[str, int]],
    want: str,
    n: int,
    *,
    timeout: float,
    what: str,
    failed_ok: bool = False,
    reread: Callable[[str], Awaitable[int]] | None = None,
    on_stall: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Until ``n`` nodes are ``want`` (``failed_ok``: or ``failed``; else a failed node raises).

    The counts come from the engine's node events, which are wake-ups, not the truth (core NATS:
    one can be lost, and two engines' events of one node can arrive in either order); when they
    stand still for ``STALLED_REREAD`` seconds, ``reread(want)`` reads the nodes behind from the
    engine, as ``bcx nodes watch`` does every few seconds; ``on_stall()`` then prints what the
    stack is doing (``db_activity``)."""
    t0 = time.monotonic()
    last = -100.0
    moved, before = time.monotonic(), None
    while True:
        got = counts()
        if got != before:
            moved, before = time.monotonic(), got
        elif reread is not None and time.monotonic() - moved > STALLED_REREAD:
            if on_stall is not None:
                with contextlib.suppress(Exception):  # a diagnosis, never a reason to stop
                    await on_stall()
            corrected = await reread(want)
            if corrected:
                print(f"  {what}: {corrected} node(s) read from the engine were further than their"
                      " events said", flush=True)  # fmt: skip
            moved = time.monotonic()
            got = counts()
        if got.get(want, 0) + (got.get("failed", 0) if failed_ok else 0) >= n:
            return
        if got.get("failed", 0) and not failed_ok:
            raise RuntimeError(f"{what}: {got.get('failed')} node(s) failed: {got}")
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{what}: {got} after {timeout:.0f} s")
        if time.monotonic() - last > 5:
            print(f"  {what}: {dict(sorted(got.items()))}", flush=True)
            last = time.monotonic()
        await asyncio.sleep(0.2)


async def db_activity(db_url: str) -> str:
    """PostgreSQL's sessions now, one line: how many by state and wait, and the oldest
    transaction's age and statement (a stall with the store idle, or waiting on a lock)."""
    conn = await asyncpg.connect(db_url)
    try:
        rows = await conn.fetch(
            "SELECT state, coalesce(wait_event_type, '-') AS wait, count(*) AS n FROM pg_stat_activity"
            " WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() GROUP BY 1, 2 ORDER BY 3 DESC"
        )
        old = await conn.fetchrow(
            "SELECT extract(epoch FROM now() - xact_start) AS age, state, left(query, 90) AS query"
            " FROM pg_stat_activity WHERE xact_start IS NOT NULL AND pid <> pg_backend_pid()"
            " ORDER BY xact_start LIMIT 1"
        )
    finally:
        await conn.close()
    parts = [f"{r['state']}/{r['wait']} {r['n']}" for r in rows]
    if old is not None:
        parts.append(f"oldest transaction {float(old['age']):.1f} s {old['state']}: {old['query']!r}")
    return "; ".join(parts)


STALLED_REREAD = 20.0
"""Seconds the node events may stand still before the nodes behind are read from the engine."""
REREAD_AT_MOST = 500
"""More nodes behind than this: the phase is still moving, nothing is read."""
BMC_EVENTS = ("media.insert", "media.eject", "boot.device", "power.requested")
"""What a BMC command leaves at the simulated hardware."""
BMC_KEYS = ("power", *BMC_EVENTS)


def past_first_bmc_command(
    sims: list[MetalSim], since: float, seen: set[str], sizes: dict[str, int] | None = None
) -> int:
    """How many machines' BMCs took a command since ``since`` (``seen`` keeps those already
    counted, so each ledger is read until it shows one; ``sizes`` each ledger's size at its last
    read, so a look reads only the ledgers that grew: 10,000 machines a second otherwise)."""
    sizes = {} if sizes is None else sizes
    for sim in sims:
        for m in sim.machines:
            key = f"{sim.site_id}/{m.name}"
            if key in seen:
                continue
            try:
                size = m.ledger.path.stat().st_size
            except OSError:
                continue
            if sizes.get(key) == size:
                continue
            sizes[key] = size
            if any(e["event"] in BMC_EVENTS and e["t"] >= since for e in m.ledger.events()):
                seen.add(key)
    return len(seen)


async def lean_memory_reports(sims: list[MetalSim], folder: Path) -> dict[str, str]:
    """Each lean host's memory report (``bcd.lean``'s SIGUSR1, ``BC_SIM_LEAN_MEMORY``): site ->
    its first line (machines, tasks, threads, RSS and traced KiB per machine); the whole report,
    the top Python allocations by file and line, is left in ``folder``."""
    out: dict[str, str] = {}
    for sim in sims:
        if sim.zygote is None or not sim.lean:
            continue
        pid = sim.zygote.proc.pid
        done = folder / f"lean-{pid}-1.txt"
        os.kill(pid, signal.SIGUSR1)
        for _ in range(600):  # a snapshot of a thousand machines' allocations takes a while
            if done.exists():
                break
            await asyncio.sleep(0.1)
        text = done.read_text() if done.exists() else "no report"
        out[sim.site_id] = text.splitlines()[0]
        print(f"  {sim.site_id} lean host memory: {done}", flush=True)
        print("    " + "\n    ".join(text.splitlines()[:16]), flush=True)
    return out


def kill_one_of_each(processes: ServiceProcesses) -> dict[str, str]:
    """SIGKILL the first live instance of each service that runs two or more: instance -> pid."""
    killed: dict[str, str] = {}
    for service in SERVICES:
        live = processes.live(service)
        if len(live) >= 2:
            live[0].kill()
            killed[live[0].instance] = str(live[0].pid)
    return killed


def instance_memory(processes: ServiceProcesses) -> dict[str, float]:
    """MiB (PSS) of every live service instance, by instance name."""
    return {p.instance: round(pss_of(p.pid), 1) for p in processes.procs if p.alive()}


def print_statements(phase: str, log: Path, offset: int, machines: int) -> int:
    """The statements PostgreSQL logged after ``offset`` of its log (``--statements``), per
    machine, the largest first (``bench_workflows.statements_per_step``); the log's end."""
    with log.open("rb") as f:
        f.seek(offset)
        data = f.read()
    *largest, (total, _) = statements_per_step(data.decode(errors="replace"), machines, top=30)
    print(f"{phase}: {total:.1f} statements per machine; the largest:", flush=True)
    for per, text in largest:
        print(f"  {per:6.2f}  {text}", flush=True)
    return offset + len(data)


async def bench(args: argparse.Namespace, state: Path) -> dict[str, Any]:
    nats, pg = EmbeddedNats(state / "servers"), EmbeddedPostgres(state / "servers")
    nats_url, db_url = nats.start(), pg.start()
    pg_log = pg.dir / "postgres.log"
    if args.statements:
        await set_log_statement(db_url, "all")
    if args.db_socket:
        db_url = pg.socket_url() or db_url
    lo, _, hi = args.power_delay.partition("-")
    delay = (float(lo), float(hi or lo))
    settings = Settings(
        nats_url=nats_url, database_url=db_url, state_dir=str(state / "state"), log_level="warning", app=APP
    )
    logs = state / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    media = MediaServer(state / "media")
    processes = ServiceProcesses(settings, logs)
    # The deployment's own timings (heartbeat 5 s, …), not the tests' FAST_ENV: a 200 ms heartbeat
    # from a thousand agents is 5,000 requests a second to the command queue, which is the
    # benchmark of something no deployment does.
    processes.extra_env.update({"BC_SIM_MEDIA_DIR": str(media.folder), "BC_SIM_MEDIA_URL": media.url})
    nc = await connect(nats_url, name="bench-fleet")
    api = ApiClient(nc, Subjects(settings.subject_root))
    engine, cq = EngineClient(api, timeout=60.0), CommandQueueClient(api, timeout=30.0)
    pki, secrets = PkiClient(api), SecretsClient(api)
    per_site = [
        args.machines // args.sites + (1 if i < args.machines % args.sites else 0) for i in range(args.sites)
    ]
    sims: list[MetalSim] = []
    agents: list[SiteAgentProcess] = []
    states: dict[str, str] = {}
    node_site: dict[str, tuple[MetalSim, int]] = {}
    try:
        t = time.monotonic()
        instances = {
            "bc-engine": args.engines, "bc-command-queue": args.queues, "bc-pki": args.pkis,
            "bc-secrets": args.secrets,
        }  # fmt: skip
        for service in SERVICES:
            for i in range(instances[service]):
                processes.start(service, instance=f"{service}-{i + 1}")
        for s, n in enumerate(per_site):
            site = f"site{s:02d}"
            sim = MetalSim(state / f"sim-{site}", settings=settings, machines=n, site_id=site, seed=s,
                           power_delay=delay, lean=args.lean)  # fmt: skip
            agent = SiteAgentProcess(folder=state / f"agent-{site}", nats_url=nats_url,
                                     subject_root=settings.subject_root, site_id=site, log_level="info",
                                     extra_config=_agent_config(args),
                                     quiet_seconds=args.quiet_seconds)  # fmt: skip
            sim.boot_url = agent.url
            sims.append(sim)
            agents.append(agent)
        await asyncio.gather(
            processes.wait_ready(timeout=120), *(asyncio.to_thread(sim.start) for sim in sims)
        )
        for sim, agent in zip(sims, agents, strict=True):
            token = await pki.issue_join_token(
                tenant_id="root", role="site", site_id=sim.site_id, ttl_seconds=900
            )
            agent.write_config(token.token)
            agent.start()
        for _ in range(3000):  # the agents connect: up to 10 minutes
            if len({a.site_id for a in await cq.agents(connected=True) if a.role == "site"}) == args.sites:
                break
            await asyncio.sleep(0.2)
        print(
            f"{args.machines} machines on {args.sites} sites, stack up in {time.monotonic() - t:.1f} s",
            flush=True,
        )

        async def on_node(msg: Any) -> None:
            event = decode_node_event(msg.data)
            if event is not None and hasattr(event, "state"):
                states[event.node_id] = event.state

        await nc.subscribe(f"{settings.subject_root}.events.node.>", cb=on_node)
        # every request on the bus, by subject (a plain subscriber sees each request besides the
        # instance that answers it): what each phase asked of each service
        requests: Counter[str] = Counter()
        api_prefix = f"{settings.subject_root}.api."

        enqueued_keys: set[str] = set()

        async def on_request(msg: Any) -> None:
            subject = msg.subject.removeprefix(api_prefix)
            requests[subject] += 1
            if args.agent_events and subject == "command-queue.commands.enqueue":
                with contextlib.suppress(ValueError, AttributeError):  # what each enqueue asked
                    body = json.loads(msg.data)
                    again = body.get("key") in enqueued_keys
                    enqueued_keys.add(body.get("key"))
                    requests[f"enqueue.{body.get('kind')}{' again' if again else ''}"] += 1

        await nc.subscribe(f"{api_prefix}>", cb=on_request)
        if args.agent_events:

            async def on_agent_event(msg: Any) -> None:
                requests["agent." + msg.subject.rsplit(".", 1)[-1]] += 1

            await nc.subscribe(Subjects(settings.subject_root).agent_events_all(), cb=on_agent_event)
        phase_requests: dict[str, dict[str, int]] = {}

        def requests_since(before: Counter[str]) -> dict[str, int]:
            return {k: n for k, n in sorted((requests - before).items(), key=lambda kv: -kv[1])}

        def per_machine(asked: dict[str, int]) -> dict[str, float]:
            return {
                name: round(asked.get(subject, 0) / args.machines, 2) for name, subject in WATCHED_REQUESTS
            }

        def said(asked: dict[str, int]) -> str:
            text = ", ".join(f"{name} {n:.2f}" for name, n in per_machine(asked).items())
            # --agent-events: the signed events by kind; each enqueue by kind ("again": its key
            # was enqueued before)
            for prefix, label in (("agent.", "agent events"), ("enqueue.", "enqueued")):
                counted = [(k.removeprefix(prefix), n) for k, n in asked.items() if k.startswith(prefix)]
                if counted:
                    counted.sort(key=lambda kv: -kv[1])
                    text += f"; {label}: " + ", ".join(f"{k} {n / args.machines:.2f}" for k, n in counted)
            return text

        def counts() -> dict[str, int]:
            return dict(Counter(states.values()))

        corrected_events: Counter[str] = Counter()

        async def reread(want: str) -> int:
            """The nodes not yet ``want`` (nor failed), read from the engine: how many of them are
            in another state than their last event said (counted per phase, printed at the end)."""
            behind = [node for node, st in states.items() if st not in (want, "failed")]
            if len(behind) > REREAD_AT_MOST:
                return 0  # the bulk of a phase still moving: the events carry it
            fixed = 0
            for node_id in behind:
                node = await engine.get_node(id=node_id)
                if node.state != states.get(node_id):
                    states[node_id] = node.state
                    fixed += 1
            corrected_events[want] += fixed
            return fixed

        async def on_stall() -> None:
            print(f"  standing still: PostgreSQL {await db_activity(db_url)}", flush=True)

        async def rolling(verb: VerbName, ids: list[str], want: str, **kw: Any) -> tuple[float, list[Any]]:
            """``verb`` over ``ids`` by bulk verbs: all at once (``--window 0``), or at most
            ``--window`` machines in flight, the next ones (spread over the sites) as others end,
            as an operator runs waves. Returns how long the first bulk verb took to answer, and
            the workflows the verbs started."""
            order = sorted(ids, key=lambda n: (node_site[n][1], node_site[n][0].site_id))
            window = args.window or len(order)
            chunk = max(1, window // 10)
            submitted, first_s, started = 0, 0.0, []
            while submitted < len(order):
                ended = sum(1 for n in order[:submitted] if states.get(n) in (want, "failed"))
                room = window - (submitted - ended)
                if submitted and room < chunk:
                    await asyncio.sleep(0.5)
                    continue
                take = order[submitted : submitted + room]
                t = time.monotonic()
                run = await engine.bulk(verb, node_ids=take, **kw)
                first_s = first_s or time.monotonic() - t
                if run.refused:
                    raise RuntimeError(f"bulk {verb} refused {len(run.refused)}: {run.refused[:3]}")
                submitted += len(take)
                started.extend(run.started)
            return first_s, started

        gate = asyncio.Semaphore(32)

        async def enroll(sim: MetalSim, index: int) -> None:
            async with gate:
                m = sim.machine(index)
                node_id = new_id("node")
                credential = json.dumps(sim.emulator.credentials).encode()
                info = await secrets.put_for_node(credential, tenant_id="root", node_id=node_id, label="bmc")
                bmc = NodeBmc(driver="redfish", address=m.bmc_url, credentials_ref=info.ref, system_id=m.uuid)
                await engine.enroll_node(site_id=sim.site_id, id=node_id, macs=list(m.macs), bmc=bmc)
                node_site[node_id] = (sim, index)
                states.setdefault(node_id, "enrolled")

        await register_sim_image(engine, IMAGE)  # a deploy verifies its image in the catalog first
        t = time.monotonic()
        await asyncio.gather(*(enroll(sim, i) for sim in sims for i in range(len(sim.machines))))
        prelude = {"enroll": time.monotonic() - t}
        print(f"enrolled in {prelude['enroll']:.1f} s", flush=True)
        # the servers run detached (their own sessions): count them from their own pids
        meter = CpuMeter(
            {
                **{p.pid: p.service for p in processes.procs},
                **{a.proc.pid: "site agents" for a in agents if a.proc is not None},
            },
            os.getpid(),
            *(p for p in (nats.running_pid(), pg.running_pid()) if p),
        )
        prelude_cpu: dict[str, dict[str, float]] = {}
        prelude_again: dict[str, int] = {}
        phases: list[tuple[VerbName, str]] = [("inspect", "inspected"), ("commission", "ready")]
        logged_at = pg_log.stat().st_size if args.statements else 0
        for verb, want in phases:
            phase_before = meter.snapshot()
            asked_before = requests.copy()
            t = time.monotonic()
            await rolling(verb, list(node_site), want)
            await until_states(
                counts, want, args.machines, timeout=args.timeout, what=verb, failed_ok=True, reread=reread,
                on_stall=on_stall,
            )  # fmt: skip
            failed = [node for node, st in states.items() if st == "failed"]
            if failed:  # what an operator does: run it again on those, once (counted, printed)
                # of the first few; a name of its own (``said`` prints the phase's figures)
                first = [await engine.get_node(id=node) for node in failed[:20]]
                reasons = {(node.state_reason or {}).get("message") for node in first}
                print(f"  {verb}: {len(failed)} failed ({'; '.join(sorted(str(m) for m in reasons))[:300]}):"
                      " run again", flush=True)  # fmt: skip
                prelude_again[verb] = len(failed)
                for node in failed:
                    states[node] = "again"
                await rolling(verb, failed, want)
                await until_states(
                    counts, want, args.machines, timeout=args.timeout, what=verb, reread=reread
                )
            prelude[verb] = time.monotonic() - t
            prelude_cpu[verb] = CpuMeter.delta(phase_before, meter.snapshot())
            phase_requests[verb] = requests_since(asked_before)
            product = sum(v for k, v in prelude_cpu[verb].items() if k in PRODUCT_KINDS)
            print(f"{verb}: {args.machines} machines {want} in {prelude[verb]:.1f} s,"
                  f" product {product / args.machines:.3f} CPU s/machine"
                  f" ({over_yardstick(prelude_cpu[verb])} x the machines' own);"
                  f" per machine: {said(phase_requests[verb])}", flush=True)  # fmt: skip
            if args.statements:
                logged_at = print_statements(verb, pg_log, logged_at, args.machines)

        cpu_before = meter.snapshot()
        asked_before = requests.copy()
        since = time.time()
        t0 = time.monotonic()
        verb_s, started = await rolling("deploy", list(node_site), "deployed", image=IMAGE, profile=PROFILE)
        killed: dict[str, str] = {}
        killed_at: dict[str, float] = {}

        async def kill_mid_deploy() -> None:
            seen: set[str] = set()
            sizes: dict[str, int] = {}
            half: float = args.machines / 2

            async def halfway() -> bool:
                n: int = await asyncio.to_thread(past_first_bmc_command, sims, since, seen, sizes)
                return n >= half

            _: bool = await until(
                halfway, interval=1.0, what="half the machines past their first BMC command"
            )
            killed_at.update(at_s=time.monotonic() - t0, deployed=counts().get("deployed", 0))
            killed.update(kill_one_of_each(processes))
            print(f"  killed {sorted(killed)} (SIGKILL) {killed_at['at_s']:.1f} s into the deploy,"
                  f" {len(seen)} machines past their first BMC command", flush=True)  # fmt: skip

        killer = asyncio.create_task(kill_mid_deploy()) if args.kill_mid_deploy else None
        try:
            await until_states(
                counts, "deployed", args.machines, timeout=args.timeout, what="deploy", failed_ok=True,
                reread=reread, on_stall=on_stall,
            )  # fmt: skip
        finally:
            if killer is not None and not killer.done():
                killer.cancel()
        elapsed = time.monotonic() - t0
        cpu = CpuMeter.delta(cpu_before, meter.snapshot())
        phase_requests["deploy"] = requests_since(asked_before)
        print(f"deploy: per machine: {said(phase_requests['deploy'])}", flush=True)
        if args.statements:
            logged_at = print_statements("deploy", pg_log, logged_at, args.machines)
        memory = meter.memory()  # every machine deployed: each runs its installed OS's bcd
        reports = await lean_memory_reports(sims, state / "lean-memory") if args.memory_report else {}
        per_instance = instance_memory(processes)
        load = os.getloadavg()
        resident = meter.resident()
        product_cpu = sum(v for k, v in cpu.items() if k in PRODUCT_KINDS)
        if cpu.get("other", 0.0) > 1.0:  # a process no kind names would fall out of the split
            print(f"warning: {cpu['other']:.1f} CPU s in processes not told apart ('other')", flush=True)
        rest: dict[str, float] = {}
        if args.idle > 0:  # every machine deployed, nothing asked: what the fleet costs at rest
            rest_before = meter.snapshot()
            await asyncio.sleep(args.idle)
            rest = CpuMeter.delta(rest_before, meter.snapshot())
            per_min = sum(v for k, v in rest.items() if k in PRODUCT_KINDS) / args.machines / (args.idle / 60)
            print(f"at rest {args.idle:.0f} s: product {per_min:.4f} CPU s/machine/minute", flush=True)

        # each machine's deploy workflow: created -> finished, from the engine
        asking = asyncio.Semaphore(32)

        async def workflow(workflow_id: str) -> Any:
            async with asking:
                return await engine.get_workflow(id=workflow_id)

        deploy_workflows = await asyncio.gather(*(workflow(s.workflow_id) for s in started))
        durations: list[float] = []
        for wf in deploy_workflows:
            if wf.finished_at and wf.created_at:
                took = datetime.fromisoformat(wf.finished_at) - datetime.fromisoformat(wf.created_at)
                durations.append(took.total_seconds())
        commands = 0
        before = None
        while True:
            page = await cq.list_commands(limit=1000, before=before)
            commands += sum(1 for c in page.commands if c.created_at >= since)
            before = page.next
            if not before or (page.commands and page.commands[-1].created_at < since):
                break
        twice = {
            f"{sim.site_id}/{m.name}": m.ledger.repeated_writes()
            for sim in sims for m in sim.machines if m.ledger.repeated_writes()
        }  # fmt: skip
        installs = sum(m.ledger.count("install") for sim in sims for m in sim.machines)
        # at the BMCs: each machine's deploy as the profile asks it, the same at every machine
        at_bmc = {
            f"{sim.site_id}/{m.name}": json.dumps(
                {k: n for k, n in m.ledger.counts(since=since).items() if k.split(":")[0] in BMC_KEYS},
                sort_keys=True,
            )
            for sim in sims for m in sim.machines
        }  # fmt: skip
        usual = Counter(at_bmc.values()).most_common(1)[0][0] if at_bmc else "{}"
        odd_bmc = {name: json.loads(got) for name, got in at_bmc.items() if got != usual}
        not_once = {
            f"{sim.site_id}/{m.name}": m.ledger.count("install")
            for sim in sims for m in sim.machines if m.ledger.count("install") != 1
        }  # fmt: skip
        # in the engine and the queue: every deploy succeeded, nothing left running or live
        deploy_states = Counter(wf.state for wf in deploy_workflows)
        still_running = len((await engine.list_workflows(state="running", limit=1000)).workflows)
        live_commands = 0
        for live_state in sorted(LIVE_STATES):
            live_commands += len((await cq.list_commands(state=live_state, limit=1000)).commands)  # type: ignore[arg-type]
        findings = {
            "installs_not_once": not_once, "bmc_not_as_usual": odd_bmc, "repeated_writes": twice,
            "deploy_workflows_not_succeeded": {k: v for k, v in deploy_states.items() if k != "succeeded"},
            "deploy_failed": {
                node: (await engine.get_node(id=node)).state_reason
                for node, st in states.items()
                if st == "failed"
            },
            "workflows_running": still_running, "commands_live": live_commands,
        }  # fmt: skip
        return {
            "machines": args.machines, "sites": args.sites, "window": args.window,
            "simulation": "lean: bcds as tasks" if args.lean else "a bcd process per machine",
            "product_cpu_s_per_machine": round(product_cpu / args.machines, 4),
            "product_cpu_s": round(product_cpu, 1),
            "simulation_cpu_s": round(sum(v for k, v in cpu.items() if k not in PRODUCT_KINDS), 1),
            "bmc": "answers at once" if delay == (0.0, 0.0) else f"power lands {args.power_delay} s late",
            "prelude_s": {k: round(v, 1) for k, v in prelude.items()},
            "prelude_run_again": prelude_again,
            "node_events_corrected_by_reads": dict(corrected_events),
            "bulk_deploy_request_s": round(verb_s, 2),
            "deploy_s": round(elapsed, 1), "machines_per_s": round(args.machines / elapsed, 1),
            "commands": commands, "commands_per_s": round(commands / elapsed, 1),
            "workflow_p50_s": round(pct(durations, 50), 1), "workflow_p99_s": round(pct(durations, 99), 1),
            "installs_at_the_hardware": installs, "repeated_writes": twice,
            "instances": instances, "killed": killed,
            "killed_at": {k: round(v, 1) for k, v in killed_at.items()},
            "bmc_usual": json.loads(usual), "findings": {k: v for k, v in findings.items() if v},
            "memory_pss_mib_per_instance": per_instance, "loadavg": load,
            "cpu_s": {k: round(v, 1) for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])},
            "cpu_total_s": round(sum(cpu.values()), 1),
            "memory_mib": {k: round(v) for k, v in sorted(memory.items(), key=lambda kv: -kv[1])},
            "memory_total_mib": round(sum(memory.values())),
            "memory_kib_per_machine": {
                k: round(v * 1024 / args.machines) for k, v in sorted(memory.items(), key=lambda kv: -kv[1])
            },
            "lean_memory_reports": reports,
            "rss_mib": {k: {"processes": n, "mib": round(mib)} for k, (n, mib) in
                        sorted(resident.items(), key=lambda kv: -kv[1][1])},
            "product_rss_mib": round(sum(mib for k, (_, mib) in resident.items() if k in PRODUCT_KINDS)),
            "product_over_machines": {
                **{verb: over_yardstick(c) for verb, c in prelude_cpu.items()}, "deploy": over_yardstick(cpu),
            },
            "prelude_product_cpu_s_per_machine": {
                verb: round(sum(v for k, v in c.items() if k in PRODUCT_KINDS) / args.machines, 4)
                for verb, c in prelude_cpu.items()
            },
            "rest_s": args.idle,
            "rest_cpu_s": {k: round(v, 2) for k, v in sorted(rest.items(), key=lambda kv: -kv[1])},
            "rest_product_cpu_s_per_machine_minute": round(
                sum(v for k, v in rest.items() if k in PRODUCT_KINDS) / args.machines / (args.idle / 60), 5
            ) if args.idle > 0 else None,
            "requests_per_machine": {verb: per_machine(asked) for verb, asked in phase_requests.items()},
            "requests": phase_requests,
            "prelude_cpu_s": {verb: {k: round(v, 1) for k, v in sorted(c.items(), key=lambda kv: -kv[1])}
                              for verb, c in prelude_cpu.items()},
        }  # fmt: skip
    finally:
        for agent in agents:
            agent.close()
        await asyncio.gather(*(asyncio.to_thread(sim.close) for sim in sims))
        media.close()
        processes.close()
        with contextlib.suppress(Exception):
            await nc.close()
        pg.stop()
        nats.stop()


OPEN_FILES = 65_536
"""Open files this process and what it starts (nats-server, PostgreSQL, the lean hosts) may have:
at 10,000 machines nats-server holds a connection each and a lean host of 1,000 machines 7,000
files (each machine's socket and its journal's two SQLite connections, three files each)."""


def raise_open_files() -> None:
    """Lift the open-files limit to ``OPEN_FILES`` (the hard limit too, when allowed: as root),
    else as far as the hard limit goes."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(soft, OPEN_FILES)
    try:
        keep = hard == resource.RLIM_INFINITY or hard >= want
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard if keep else want))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _agent_config(args: argparse.Namespace) -> str:
    """The site agents' config beyond the test kit's: ``--credentials-keep``, when given."""
    if args.credentials_keep is None:
        return ""
    return f"[bmc]\ncredentials_keep_seconds = {args.credentials_keep}\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--machines", type=int, default=100)
    p.add_argument("--sites", type=int, default=2)
    p.add_argument("--power-delay", default="0", help="seconds a power change lands late: 0, or 1-11")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds each phase may take")
    p.add_argument("--keep", action="store_true", help="keep the state folder (logs) afterwards")
    p.add_argument("--idle", type=float, default=0.0, help="then seconds at rest, every machine deployed")
    p.add_argument(
        "--window", type=int, default=0,
        help="at most this many machines in each phase at once, the next as others end (0: all at once)",
    )  # fmt: skip
    p.add_argument(
        "--quiet-seconds", type=float, default=0.5,
        help="the site agents' netboot.quiet_seconds (production's default is 120; the test kit's 0.5)",
    )  # fmt: skip
    p.add_argument(
        "--credentials-keep", type=float, default=None,
        help="the site agents' bmc.credentials_keep_seconds (0: a fetch for each BMC command)",
    )  # fmt: skip
    for flag, what in (("engines", "bc-engine"), ("queues", "bc-command-queue"), ("pkis", "bc-pki"),
                       ("secrets", "bc-secrets")):  # fmt: skip
        p.add_argument(f"--{flag}", type=int, default=1, help=f"{what} instances")
    p.add_argument(
        "--lean", action="store_true", default=os.environ.get("BC_SIM_LEAN") == "1",
        help="each site's bcds as tasks of one process (BC_SIM_LEAN=1), not a process per machine",
    )  # fmt: skip
    for flag, what in (
        ("--kill-mid-deploy",
         "SIGKILL one instance of each service run twice or more, half the machines into the deploy"),
        ("--agent-events", "count the agents' signed events (bc.agent.*.*.<kind>) per machine in each phase"),
        ("--db-socket", "the services reach PostgreSQL on its Unix socket, not on TCP 127.0.0.1"),
        ("--statements",
         "PostgreSQL logs every statement; print each phase's per machine by kind (costs CPU)"),
        ("--memory-report",
         "lean: each host traces its Python allocations and reports them at the end (costs CPU)"),
    ):  # fmt: skip
        p.add_argument(flag, action="store_true", help=what)
    args = p.parse_args()
    raise_open_files()
    # each service and site agent its own `python -m ...`, as deployed, not forked from the test
    # kit's fork server: its memory (PSS) its own rather than shared with that server's pages, and
    # no fork server in the process tree (it would count as 'other')
    os.environ.setdefault("BC_SERVICE_FORKS", "0")
    configure_logging(level="warning", json=False)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop everything it started
    folder = Path(tempfile.mkdtemp(prefix="bc-fleet-"))
    print(f"state under {folder}", flush=True)
    if args.memory_report:
        os.environ["BC_SIM_LEAN_MEMORY"] = str(folder / "lean-memory")
    ok = False
    try:
        out = asyncio.run(bench(args, folder))
        ok = True
    finally:
        if not ok:
            print(f"failed: the state folder (logs, ledgers) is kept: {folder}", flush=True)
        elif not args.keep:
            import shutil

            shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(out, indent=2))
    print(
        f"\nproduct CPU per deployed machine: {out['product_cpu_s_per_machine']} s"
        f" ({out['product_cpu_s']} CPU s: engine, command-queue, pki, secrets, site agents, nats-server,"
        f" PostgreSQL; {out['product_over_machines']['deploy']} x the machines' own bcds and BMCs),"
        f" wall {out['deploy_s']} s, product RSS {out['product_rss_mib']} MiB;"
        f" simulation {out['simulation_cpu_s']} CPU s ({out['simulation']})"
    )
    print(
        f"{out['machines']} machines on {out['sites']} sites ({out['bmc']}):"
        f" deployed in {out['deploy_s']} s"
        f" ({out['machines_per_s']}/s), {out['commands_per_s']} commands/s,"
        f" per-machine workflow p50 {out['workflow_p50_s']} s p99 {out['workflow_p99_s']} s,"
        f" {out['cpu_total_s']} CPU s in all, {out['memory_total_mib']} MiB (PSS) at the end"
    )
    if out["killed"]:
        print(f"killed {', '.join(sorted(out['killed']))} {out['killed_at']['at_s']} s into the deploy"
              f" ({out['killed_at']['deployed']} machines deployed then)")  # fmt: skip
    print("memory (PSS) per instance, MiB:", json.dumps(out["memory_pss_mib_per_instance"]))
    if out["node_events_corrected_by_reads"]:
        print("node states read from the engine where the events stood still, by phase:",
              json.dumps(out["node_events_corrected_by_reads"]))  # fmt: skip
    print(
        f"load average {' '.join(f'{x:.2f}' for x in out['loadavg'])}; findings: {out['findings'] or 'none'}"
    )
    sys.exit(1 if out["findings"] else 0)


if __name__ == "__main__":
    main()
