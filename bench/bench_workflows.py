"""Workflows benchmark: N workflows of S no-op control-plane steps through engine processes,
against the same chain of jobs on pgqueuer (each job enqueues the next) on the same database.

    uv run --group bench python bench/bench_workflows.py --workflows 1000 --steps 6

Prints steps per second and the p50/p99 delay between one step settling and the next
starting, for both, and their ratio. Runs on the embedded nats-server and PostgreSQL
(fsync on, as in production) under a temporary folder.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg

from better_compute.clients import EngineClient
from better_compute.runtime.embedded import EmbeddedNats, EmbeddedPostgres
from better_compute.service.client import ApiClient, connect, discover
from better_compute.wire import Subjects

HERE = Path(__file__).parent


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


async def bench_engine(
    nats_url: str, db_url: str, n: int, s: int, engines: int, logs: Path, version: int
) -> dict[str, Any]:
    env = {
        **os.environ,
        "BC_NATS_URL": nats_url,
        "BC_DATABASE_URL": db_url,
        "BC_APP": "bench_app:app",
        "BC_LOG_LEVEL": "warning",
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bc_engine", "--instance", f"bench-engine-{i}",
            env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )
        for i in range(engines)
    ]  # fmt: skip
    nc = await connect(nats_url, name="bench")
    try:
        while len(await discover(nc, root="bc", wait=0.2)) < engines:
            pass
        await asyncio.sleep(2.0)  # let the engines split the shards
        engine = EngineClient(ApiClient(nc, Subjects()))
        doc = {"id": "bench-chain", "version": version, "target": "metal", "role": "host",
               "steps": [{"use": "bench.noop"}] * s}  # fmt: skip
        await engine.create_profile(document=doc)
        t0 = time.perf_counter()
        sem = asyncio.Semaphore(64)

        async def start() -> str:
            async with sem:
                wf = await engine.start_workflow(profile_id="bench-chain", profile_version=version)
                return str(wf.id)

        ids = await asyncio.gather(*(start() for _ in range(n)))
        t_started = time.perf_counter()
        conn = await asyncpg.connect(db_url)
        try:
            while True:
                left = await conn.fetchval(
                    "SELECT count(*) FROM engine.workflows WHERE state = 'running' AND id = ANY($1::text[])",
                    ids,
                )
                if left == 0:
                    break
                await asyncio.sleep(0.05)
            elapsed = time.perf_counter() - t0
            failed = await conn.fetchval(
                "SELECT count(*) FROM engine.workflows WHERE state <> 'succeeded' AND id = ANY($1::text[])",
                ids,
            )
            # settle of step i (its commit time in the database) to the moment step i+1 really
            # ran (the clock the step itself read): what a user waits between two steps
            rows = await conn.fetch(
                "SELECT ((b.result->>'ranAt')::float8 - extract(epoch FROM a.finished_at)) * 1000 AS gap_ms"
                " FROM engine.workflow_steps a JOIN engine.workflow_steps b"
                "   ON b.workflow_id = a.workflow_id AND b.idx = a.idx + 1"
                " WHERE a.workflow_id = ANY($1::text[])",
                ids,
            )
        finally:
            await conn.close()
        gaps = [float(r["gap_ms"]) for r in rows]
        return {
            "name": f"bc-engine x{engines}",
            "steps": n * s,
            "elapsed": elapsed,
            "start_phase": t_started - t0,
            "rate": n * s / elapsed,
            "p50": pct(gaps, 50),
            "p99": pct(gaps, 99),
            "failed": failed,
        }
    finally:
        await nc.close()
        for p in procs:
            p.terminate()
        for p in procs:
            await p.wait()


async def bench_pgqueuer(db_url: str, n: int, s: int) -> dict[str, Any]:
    from pgqueuer import Job, Queries, QueueManager
    from pgqueuer.types import QueueExecutionMode

    conn = await asyncpg.connect(db_url)
    qm = QueueManager(Queries.from_asyncpg_connection(conn))
    with contextlib.suppress(asyncpg.DuplicateObjectError):
        await qm.queries.install()
    finished: dict[tuple[int, int], float] = {}
    gaps: list[float] = []
    done = 0
    all_done = asyncio.Event()

    @qm.entrypoint("step")
    async def step(job: Job) -> None:
        nonlocal done
        start = time.time()
        wf, i = map(int, (job.payload or b"0:0").decode().split(":"))
        if i > 0:
            gaps.append((start - finished[(wf, i - 1)]) * 1000)
        # the chain: this job settles by enqueueing the next one, as a workflow step would
        if i + 1 < s:
            finished[(wf, i)] = time.time()
            await qm.queries.enqueue("step", f"{wf}:{i + 1}".encode())
        else:
            done += 1
            if done == n:
                all_done.set()
                qm.shutdown.set()

    t0 = time.perf_counter()
    await qm.queries.enqueue(["step"] * n, [f"{w}:0".encode() for w in range(n)], [0] * n)
    await qm.run(batch_size=20, dequeue_timeout=timedelta(seconds=1), mode=QueueExecutionMode.continuous)
    elapsed = time.perf_counter() - t0
    await conn.close()
    return {
        "name": "pgqueuer",
        "steps": n * s,
        "elapsed": elapsed,
        "start_phase": 0.0,
        "rate": n * s / elapsed,
        "p50": pct(gaps, 50),
        "p99": pct(gaps, 99),
        "failed": n - done,
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workflows", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--engines", type=int, default=1, help="engine processes")
    ap.add_argument("--rounds", type=int, default=3, help="alternate engine and pgqueuer runs")
    ap.add_argument("--skip-pgqueuer", action="store_true")
    args = ap.parse_args()
    state = Path(tempfile.mkdtemp(prefix="bc-bench-"))
    nats, pg = EmbeddedNats(state), EmbeddedPostgres(state, durable=True)
    try:
        nats_url, db_url = nats.start(), pg.start()
        print(f"embedded servers under {state}; {args.workflows} workflows x {args.steps} steps", flush=True)
        engine_runs: list[dict[str, Any]] = []
        pgq_runs: list[dict[str, Any]] = []
        header = (
            f"{'runner':<16}{'round':>6}{'steps':>8}{'seconds':>9}{'steps/s':>10}"
            f"{'p50 ms':>9}{'p99 ms':>9}{'failed':>8}"
        )
        print("\n" + header, flush=True)
        for rnd in range(1, args.rounds + 1):
            runs = [
                await bench_engine(nats_url, db_url, args.workflows, args.steps, args.engines, state, rnd)
            ]
            engine_runs.append(runs[0])
            if not args.skip_pgqueuer:
                runs.append(await bench_pgqueuer(db_url, args.workflows, args.steps))
                pgq_runs.append(runs[1])
            for r in runs:
                print(
                    f"{r['name']:<16}{rnd:>6}{r['steps']:>8}{r['elapsed']:>9.2f}{r['rate']:>10.1f}"
                    f"{r['p50']:>9.2f}{r['p99']:>9.2f}{r['failed']:>8}",
                    flush=True,
                )
        best_e = max(engine_runs, key=lambda r: r["rate"])
        print(f"\nbest engine: {best_e['rate']:.1f} steps/s, p99 step-to-step {best_e['p99']:.2f} ms")
        if pgq_runs:
            best_p = max(pgq_runs, key=lambda r: r["rate"])
            med = sorted(e["rate"] / p["rate"] for e, p in zip(engine_runs, pgq_runs, strict=True))
            print(f"best pgqueuer: {best_p['rate']:.1f} steps/s, p99 job-to-job {best_p['p99']:.2f} ms")
            print(
                f"engine / pgqueuer throughput: best {best_e['rate'] / best_p['rate']:.2f}x,"
                f" median of rounds {med[len(med) // 2]:.2f}x"
            )
    finally:
        pg.stop()
        nats.stop()


if __name__ == "__main__":
    asyncio.run(main())
