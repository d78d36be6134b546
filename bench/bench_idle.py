"""Idle cost: N workflows waiting on agents that never answer, and what they cost at rest.

    uv run python bench/bench_idle.py --workflows 10000 --seconds 30

Starts bc-engine, bc-command-queue and bc-pki on the embedded servers, registers N nodes in a
site with no agent, starts N workflows whose one step sends ``power.setPower`` (so every
workflow waits on a pending command), waits until every step is running, then measures the CPU
the engine, command-queue and PostgreSQL processes use over ``--seconds`` of rest, and the
number of reconciler passes in that time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import asyncpg

from better_compute.clients import EngineClient
from better_compute.runtime.embedded import EmbeddedNats, EmbeddedPostgres
from better_compute.service.client import ApiClient, connect, discover
from better_compute.wire import Subjects

HERE = Path(__file__).parent
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / TICKS


def postgres_pids(postmaster: int) -> list[int]:
    """The postmaster and its children (backends, writers): this cluster only."""
    pids = [postmaster]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == postmaster:
                pids.append(int(entry.name))
    return pids


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workflows", type=int, default=10000)
    ap.add_argument("--seconds", type=float, default=30.0)
    args = ap.parse_args()
    state = Path(tempfile.mkdtemp(prefix="bc-idle-"))
    nats, pg = EmbeddedNats(state), EmbeddedPostgres(state, durable=True)
    procs: list[asyncio.subprocess.Process] = []
    try:
        nats_url, db_url = nats.start(), pg.start()
        env = {**os.environ, "BC_NATS_URL": nats_url, "BC_DATABASE_URL": db_url, "BC_LOG_LEVEL": "warning",
               "BC_STATE_DIR": str(state), "BC_APP": "bench_app:app",
               "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        for module in ("bc_pki", "bc_command_queue", "bc_engine"):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", module, env=env,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            procs.append(proc)
        nc = await connect(nats_url, name="bench-idle")
        while len(await discover(nc, root="bc", wait=0.2)) < 3:
            pass
        engine = EngineClient(ApiClient(nc, Subjects()))
        step = {"use": "power.setPower", "on": "site", "with": {"action": "cycle"}, "timeout": "1h"}
        doc = {"id": "wait-agent", "version": 1, "target": "metal", "role": "host", "steps": [step]}
        await engine.create_profile(document=doc)
        sem = asyncio.Semaphore(64)

        async def one() -> None:
            async with sem:
                node = await engine.create_node(site_id="nowhere")
                await engine.start_workflow(profile_id="wait-agent", node_id=node.id)

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(args.workflows)))
        print(f"started {args.workflows} workflows in {time.perf_counter() - t0:.1f}s", flush=True)
        conn = await asyncpg.connect(db_url)
        waiting = "SELECT count(*) FROM engine.workflow_steps WHERE command_id IS NULL"
        while await conn.fetchval(waiting):  # noqa: ASYNC110 -- polling another process's database
            await asyncio.sleep(0.5)
        pending = await conn.fetchval("SELECT count(*) FROM cmdq.commands WHERE state = 'pending'")
        print(f"all waiting: {pending} pending commands; resting {args.seconds:.0f}s", flush=True)
        await asyncio.sleep(12)  # let the start-up burst settle into the steady poll
        engine_pid, cmdq_pid = procs[2].pid, procs[1].pid
        postmaster = pg.running_pid()
        assert postmaster is not None
        pg_pids = postgres_pids(postmaster)
        before = (cpu_seconds([engine_pid]), cpu_seconds([cmdq_pid]), cpu_seconds(pg_pids))
        t1 = time.perf_counter()
        await asyncio.sleep(args.seconds)
        wall = time.perf_counter() - t1
        after = (cpu_seconds([engine_pid]), cpu_seconds([cmdq_pid]), cpu_seconds(pg_pids))
        await conn.close()
        print(f"\n{'process':<18}{'cpu % of one core':>20}")
        for name, b, a in zip(("bc-engine", "bc-command-queue", "postgresql"), before, after, strict=True):
            print(f"{name:<18}{(a - b) / wall * 100:>19.1f}%")
        print(f"\nat rest with {args.workflows} workflows waiting on agents")
        await nc.close()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            await p.wait()
        pg.stop()
        nats.stop()


if __name__ == "__main__":
    asyncio.run(main())
