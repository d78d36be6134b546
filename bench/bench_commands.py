"""Command-queue benchmark: commands through enqueue -> agent -> result, with 1 and 10 sites.

    uv run python bench/bench_commands.py --commands 2000 --sites 1
    uv run python bench/bench_commands.py --commands 2000 --sites 10 --queues 2

Runs the embedded nats-server and PostgreSQL (fsync on, as in production) under a temporary
folder, bc-pki and bc-command-queue as their own processes, and one site agent per site (built on
the agent SDK, each with its own journal, synced to disk) in one more process. The driver enqueues
``power.setPower`` commands spread over the sites and watches ``bc.events.command.*``.

Closed loop: ``--concurrency`` commands are in flight at any time; each is enqueued, run by its
site's agent, and counted when its ``succeeded`` event arrives. Prints commands per second and
the p50/p99 latency from the enqueue request to that event; the CPU each kind of process used per
command (the command queue, bc-pki, the agents' process, nats-server, PostgreSQL and the driver
itself) and PostgreSQL's commits and WAL bytes per command. ``--statements N``: then N more
commands with PostgreSQL's statement log on, and the statements per command, most frequent first.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
from bench_workflows import pg_counters, set_log_statement, statements_per_step

from better_compute.agent import Agent, enroll
from better_compute.agent.sim import join_agent, sim_handlers
from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.pki import PkiClient
from better_compute.core.errors import BcError
from better_compute.core.ids import new_id
from better_compute.crypto import sign_event
from better_compute.logging import configure_logging
from better_compute.runtime.embedded import EmbeddedNats, EmbeddedPostgres
from better_compute.service.client import ApiClient, connect, discover
from better_compute.wire import Subjects
from better_compute.wire.agent import Heartbeat, Hello
from better_compute.wire.cmdq import CommandEvent, EnqueueCommand


def cpu_s(pid: int) -> float:
    """CPU seconds ``pid`` used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(root: int) -> float:
    """CPU seconds of ``root`` and its live children (PostgreSQL's backends)."""
    total = cpu_s(root)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == root:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


async def idle_agents(api: ApiClient, sites: list[str], n: int, stats: Path) -> None:
    """``n`` node agents (``bcd``'s role) that only say hello and heartbeat, as a fleet's idle
    machines do: every ``cmdq.idle_heartbeat`` (the hello reply's ``idleHeartbeatMs``), each
    heartbeat announcing that gap (``next_heartbeat_ms``) as the agent runtime's idle machines
    do. The presence load on the command queue, beside the benchmark's commands."""
    nc = api.nc
    subjects = api.subjects
    idents: list[Any] = []
    for start in range(0, n, 20):
        idents += await asyncio.gather(
            *(join_agent(api, site_id=sites[i % len(sites)], role="node", node_id=new_id("node"))
              for i in range(start, min(n, start + 20)))
        )  # fmt: skip
    answered: list[float] = []
    missed = 0
    gaps: set[int] = set()

    def base(e: Any) -> dict[str, Any]:
        return {"site": e.site_id, "agent": e.agent_id, "signer_id": e.cert_id,
                "signed_at_ms": time.time_ns() // 1_000_000}  # fmt: skip

    async def one(e: Any) -> None:
        nonlocal missed
        identity = e.identity
        journal = secrets.token_hex(16)
        hello = Hello(**base(e), kinds=[], journal_id=journal)
        subject = subjects.agent_event(e.site_id, e.agent_id, "hello")
        while True:
            try:
                msg = await nc.request(subject, sign_event(identity, "hello", hello), timeout=10)
                said = msgspec.json.decode(msg.data)["result"]
                heartbeat_ms = said["heartbeatMs"]
                gap_ms = max(said.get("idleHeartbeatMs") or 0, heartbeat_ms)
                gaps.add(gap_ms)
                break
            except Exception:
                await asyncio.sleep(1)
                hello = Hello(**base(e), kinds=[], journal_id=journal)
        subject = subjects.agent_event(e.site_id, e.agent_id, "heartbeat")
        # the first within the gap the hello announced, the second early by chance (a gap is a
        # most), so the fleet's heartbeats spread over the idle gap as if it joined over time
        waits_ms = itertools.chain(
            (random.random() * heartbeat_ms, random.random() * gap_ms), itertools.repeat(gap_ms)
        )
        for wait_ms in waits_ms:
            await asyncio.sleep(wait_ms / 1000)
            t = time.perf_counter()
            try:
                beat = Heartbeat(**base(e), journal_id=journal, next_heartbeat_ms=gap_ms)
                await nc.request(subject, sign_event(identity, "heartbeat", beat), timeout=5)
                answered.append((time.perf_counter() - t) * 1000)
            except Exception:
                missed += 1

    async def report() -> None:
        while True:
            await asyncio.sleep(2)
            recent = answered[-2000:]
            doc = {
                "gap_ms": sorted(gaps),
                "answered": len(answered),
                "missed": missed,
                "p50_ms": pct(recent, 50),
                "p99_ms": pct(recent, 99),
            }
            stats.write_text(json.dumps(doc))  # noqa: ASYNC240 - a few bytes every 2 s

    await asyncio.gather(report(), *(one(e) for e in idents))


async def run_agents(nats_url: str, tokens: list[str], state: Path, idle: int) -> None:
    """The agents process: enroll every token, run one agent per site until killed."""
    nc = await connect(nats_url, name="bench-agents")
    api = ApiClient(nc, Subjects())
    pki = PkiClient(api)
    if idle:
        sites = [f"site-{i}" for i in range(len(tokens))]
        asyncio.get_running_loop().create_task(idle_agents(api, sites, idle, state / "idle.json"))
    agents = []
    for i, token in enumerate(tokens):
        enrollment = await enroll(pki, token=token)
        agent = Agent(
            enrollment=enrollment,
            handlers=sim_handlers(["power.setPower"]),
            journal=state / f"journal-{i}.db",
            nc=nc,
            subjects=api.subjects,
            max_concurrency=64,
        )
        await agent.start()
        agents.append(agent)
    await asyncio.gather(*(a.run() for a in agents))


async def connected(cq: CommandQueueClient) -> int:
    """The agents the command queue shows connected."""
    count, cursor = 0, None
    while True:
        try:
            page = await cq.agents_page(connected=True, limit=1000, cursor=cursor)
        except BcError as err:  # main under a flood of hellos: the queue does not answer
            print(f"agents.list: {err.code.value}", file=sys.stderr)
            count, cursor = 0, None
            continue
        count += len(page.agents)
        cursor = page.next
        if cursor is None:
            return count


async def all_connected(cq: CommandQueueClient, n: int) -> None:
    while True:
        if await connected(cq) >= n:
            return
        await asyncio.sleep(0.5)


async def start(argv: list[str], env: dict[str, str], log: Path) -> asyncio.subprocess.Process:
    handle = open(log, "wb")  # noqa: SIM115, ASYNC230 - the child keeps it for its lifetime
    return await asyncio.create_subprocess_exec(*argv, env=env, stdout=handle, stderr=handle)


async def bench(args: argparse.Namespace, state: Path) -> dict[str, Any]:
    nats = EmbeddedNats(state)
    pg = EmbeddedPostgres(state)
    nats_url = nats.start()
    db_url = pg.start()
    env = {**os.environ, "BC_NATS_URL": nats_url, "BC_DATABASE_URL": db_url, "BC_LOG_LEVEL": "warning"}
    procs: list[asyncio.subprocess.Process] = []
    nc = await connect(nats_url, name="bench")
    try:
        procs.append(await start([sys.executable, "-m", "bc_pki"], env, state / "pki.log"))
        for i in range(args.queues):
            procs.append(
                await start(
                    [sys.executable, "-m", "bc_command_queue", "--instance", f"cmdq-{i}"],
                    env,
                    state / f"cmdq-{i}.log",
                )
            )
        while len(await discover(nc, root="bc", wait=0.2)) < 1 + args.queues:
            pass
        api = ApiClient(nc, Subjects())
        pki = PkiClient(api)
        cq = CommandQueueClient(api, timeout=30.0)
        sites = [f"site-{i}" for i in range(args.sites)]
        tokens = [
            (await pki.issue_join_token(tenant_id="root", role="site", site_id=site, ttl_seconds=600)).token
            for site in sites
        ]
        tokens_file = state / "tokens.json"
        tokens_file.write_text(json.dumps(tokens))
        procs.append(
            await start(
                [
                    sys.executable,
                    __file__,
                    "--agents",
                    str(tokens_file),
                    "--nats-url",
                    nats_url,
                    "--state",
                    str(state),
                    "--idle-agents",
                    str(args.idle_agents),
                ],
                env,
                state / "agents.log",
            )
        )
        await all_connected(cq, len(sites) + args.idle_agents)

        waiters: dict[str, asyncio.Future[float]] = {}
        early: dict[str, float] = {}  # settled before its enqueue reply arrived

        async def on_event(msg: Any) -> None:
            event = msgspec.json.decode(msg.data, type=CommandEvent)
            if event.state in ("succeeded", "failed", "rejected", "expired", "cancelled"):
                now = time.perf_counter()
                fut = waiters.get(event.id)
                if fut is None:
                    early.setdefault(event.id, now)
                elif not fut.done():
                    fut.set_result(now)

        await nc.subscribe("bc.events.command.*", cb=on_event)

        enqueue_ms: list[float] = []

        async def one(site: str, key: str) -> float:
            """Enqueue one command and wait for its result; returns the latency in ms."""
            t = time.perf_counter()
            view = await cq.enqueue(
                EnqueueCommand(node_id=new_id("node"), site_id=site, kind="power.setPower",
                               payload={"action": "cycle"}, key=key)
            )  # fmt: skip
            enqueue_ms.append((time.perf_counter() - t) * 1000)
            fut = waiters.setdefault(view.id, asyncio.get_running_loop().create_future())
            if view.id in early:
                fut.set_result(early.pop(view.id))
            return (await asyncio.wait_for(fut, timeout=120) - t) * 1000

        for site in sites:  # warm up: one command per site
            await one(site, "warm-up")

        async def closed_loop(n: int, prefix: str) -> list[float]:
            """--concurrency commands in flight, each enqueue -> agent -> result; latencies."""
            latencies: list[float] = []
            counter = iter(range(n))

            async def worker() -> None:
                for i in counter:
                    latencies.append(await one(sites[i % len(sites)], f"{prefix}-{i}"))

            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            return latencies

        queues = procs[1 : 1 + args.queues]
        kinds: dict[str, list[int]] = {
            "command-queue": [p.pid for p in queues], "pki": [procs[0].pid], "agents": [procs[-1].pid],
        }  # fmt: skip
        trees = {"nats-server": nats.running_pid(), "postgresql": pg.running_pid()}

        def cpu_by_kind() -> dict[str, float]:
            got = {k: sum(cpu_s(pid) for pid in pids) for k, pids in kinds.items()}
            got.update({k: tree_cpu_s(pid) for k, pid in trees.items() if pid is not None})
            got["driver"] = cpu_s(os.getpid())
            return got

        pg_conn = await asyncpg.connect(db_url)
        await asyncio.sleep(1.1)  # PostgreSQL's counters lag up to a second behind its backends
        pg0 = await pg_counters(pg_conn)
        cpu0 = cpu_by_kind()
        t0 = time.perf_counter()
        latencies = await closed_loop(args.commands, "bench")
        elapsed = time.perf_counter() - t0
        cpu1 = cpu_by_kind()
        await asyncio.sleep(1.1)
        pg1 = await pg_counters(pg_conn)
        await pg_conn.close()
        cpu_ms = {k: round((cpu1[k] - cpu0[k]) * 1000 / args.commands, 3) for k in cpu1}
        cpu_ms["total"] = round(sum(cpu_ms.values()), 3)
        queue_cpu = cpu1["command-queue"] - cpu0["command-queue"]
        statements: list[tuple[float, str]] = []
        if args.statements:
            log = pg.dir / "postgres.log"
            seen = log.stat().st_size
            await set_log_statement(db_url, "all")
            try:
                await closed_loop(args.statements, "statements")
            finally:
                await set_log_statement(db_url, "none")
            with log.open("rb") as f:
                f.seek(seen)
                text = f.read().decode(errors="replace")
            statements = statements_per_step(text, args.statements)
        at_rest: dict[str, float] = {}
        if args.rest:
            # the product at rest with the idle agents heartbeating: CPU per heartbeat
            parts = {"command-queue": [p.pid for p in queues], "pki": [procs[0].pid]}
            roots = {"nats-server": nats.running_pid(), "postgresql": pg.running_pid()}

            def rest_cpu() -> dict[str, float]:
                got = {k: sum(cpu_s(pid) for pid in pids) for k, pids in parts.items()}
                got.update({k: tree_cpu_s(pid) for k, pid in roots.items() if pid is not None})
                return got

            def heard() -> int:  # the idle agents' heartbeats answered so far (counted every 2 s)
                stats = state / "idle.json"
                return int(json.loads(stats.read_text())["answered"]) if args.idle_agents else 0

            before, beats = rest_cpu(), heard()
            await asyncio.sleep(args.rest)
            after, beats = rest_cpu(), heard() - beats
            at_rest = {k: round(after[k] - before[k], 2) for k in after}
            at_rest["product_ms_per_heartbeat"] = round(sum(at_rest.values()) / max(beats, 1) * 1000, 3)
            at_rest["heartbeats"] = beats
        states: dict[str, int] = {}
        page = await cq.list_commands(limit=1000)
        for view in page.commands:
            states[view.state] = states.get(view.state, 0) + 1
        return {
            "sites": args.sites,
            "queues": args.queues,
            "commands": args.commands,
            "concurrency": args.concurrency,
            "commands_per_s": round(args.commands / elapsed, 1),
            "latency_ms_p50": round(pct(latencies, 50), 1),
            "latency_ms_p99": round(pct(latencies, 99), 1),
            "enqueue_reply_ms_p50_p99_max": [
                round(pct(enqueue_ms, 50), 1),
                round(pct(enqueue_ms, 99), 1),
                round(max(enqueue_ms), 1),
            ],
            "command_queue_cpu_s": round(queue_cpu, 2),
            "cpu_ms_per_command": cpu_ms,
            "pg_commits_per_command": round((pg1[0] - pg0[0]) / args.commands, 2),
            "pg_wal_bytes_per_command": round((pg1[1] - pg0[1]) / args.commands),
            "statements_per_command": [f"{per:.3f}  {text}" for per, text in statements] or None,
            "load_average": [round(x, 1) for x in os.getloadavg()],
            "idle_agents": args.idle_agents,
            "agents_connected_at_end": await connected(cq),  # the sites' and the idle ones
            "at_rest_cpu_s": at_rest or None,
            "idle_heartbeats": json.loads((state / "idle.json").read_text()) if args.idle_agents else None,
            "last_1000_states": states,
        }
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
        await nc.close()
        nats.stop()
        pg.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--commands", type=int, default=2000)
    parser.add_argument("--sites", type=int, default=1)
    parser.add_argument("--queues", type=int, default=1, help="bc-command-queue instances")
    parser.add_argument("--concurrency", type=int, default=32, help="commands in flight")
    parser.add_argument(
        "--idle-agents", type=int, default=0, help="node agents that only heartbeat (a fleet at rest)"
    )
    parser.add_argument("--rest", type=float, default=0.0, help="then seconds at rest: the product's CPU")
    parser.add_argument(
        "--statements",
        type=int,
        default=0,
        help="then N commands with the statement log on: statements per command",
    )
    parser.add_argument("--agents", help=argparse.SUPPRESS)
    parser.add_argument("--nats-url", help=argparse.SUPPRESS)
    parser.add_argument("--state", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agents:
        configure_logging(level="warning")
        tokens = json.loads(Path(args.agents).read_text())
        asyncio.run(run_agents(args.nats_url, tokens, Path(args.state), args.idle_agents))
        return
    with tempfile.TemporaryDirectory(prefix="bc-bench-cmdq-") as tmp:
        result = asyncio.run(bench(args, Path(tmp)))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
