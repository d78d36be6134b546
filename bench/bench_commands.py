"""Command-queue benchmark: commands through enqueue -> agent -> result, with 1 and 10 sites.

    uv run python bench/bench_commands.py --commands 2000 --sites 1
    uv run python bench/bench_commands.py --commands 2000 --sites 10 --queues 2

Runs the embedded nats-server and PostgreSQL (fsync on, as in production) under a temporary
folder, bc-pki and bc-command-queue as their own processes, and one site agent per site (built on
the agent SDK, each with its own journal, synced to disk) in one more process. The driver enqueues
``power.setPower`` commands spread over the sites and watches ``bc.events.command.*``.

Closed loop: ``--concurrency`` commands are in flight at any time; each is enqueued, run by its
site's agent, and counted when its ``succeeded`` event arrives. Prints commands per second and
the p50/p99 latency from the enqueue request to that event.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from better_compute.agent import Agent, enroll
from better_compute.agent.sim import sim_handlers
from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.pki import PkiClient
from better_compute.core.ids import new_id
from better_compute.logging import configure_logging
from better_compute.runtime.embedded import EmbeddedNats, EmbeddedPostgres
from better_compute.service.client import ApiClient, connect, discover
from better_compute.wire import Subjects
from better_compute.wire.cmdq import CommandEvent, EnqueueCommand


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


async def run_agents(nats_url: str, tokens: list[str], state: Path) -> None:
    """The agents process: enroll every token, run one agent per site until killed."""
    nc = await connect(nats_url, name="bench-agents")
    api = ApiClient(nc, Subjects())
    pki = PkiClient(api)
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


async def all_connected(cq: CommandQueueClient, n: int) -> None:
    while True:
        if len(await cq.agents(connected=True)) >= n:
            return
        await asyncio.sleep(0.1)


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
                ],
                env,
                state / "agents.log",
            )
        )
        await all_connected(cq, len(sites))

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

        async def one(site: str, key: str) -> float:
            """Enqueue one command and wait for its result; returns the latency in ms."""
            t = time.perf_counter()
            view = await cq.enqueue(
                EnqueueCommand(node_id=new_id("node"), site_id=site, kind="power.setPower",
                               payload={"action": "cycle"}, key=key)
            )  # fmt: skip
            fut = waiters.setdefault(view.id, asyncio.get_running_loop().create_future())
            if view.id in early:
                fut.set_result(early.pop(view.id))
            return (await asyncio.wait_for(fut, timeout=120) - t) * 1000

        for site in sites:  # warm up: one command per site
            await one(site, "warm-up")

        # closed loop: --concurrency commands in flight, each enqueue -> agent -> result
        latencies: list[float] = []
        counter = iter(range(args.commands))

        async def worker() -> None:
            for i in counter:
                latencies.append(await one(sites[i % len(sites)], f"bench-{i}"))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - t0
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
    parser.add_argument("--agents", help=argparse.SUPPRESS)
    parser.add_argument("--nats-url", help=argparse.SUPPRESS)
    parser.add_argument("--state", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agents:
        configure_logging(level="warning")
        asyncio.run(run_agents(args.nats_url, json.loads(Path(args.agents).read_text()), Path(args.state)))
        return
    with tempfile.TemporaryDirectory(prefix="bc-bench-cmdq-") as tmp:
        result = asyncio.run(bench(args, Path(tmp)))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
