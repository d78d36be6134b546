"""Workflows benchmark: N workflows of S no-op control-plane steps through engine processes,
against the same chain of jobs on pgqueuer (each job enqueues the next) on the same database.

    uv run --group bench python bench/bench_workflows.py --workflows 1000 --steps 6

Prints steps per second and the p50/p99 delay between one step settling and the next
starting, for both, and their ratio; and the CPU each side used per step (the engine
processes or the pgqueuer worker, and PostgreSQL's processes), which the load of a shared
machine moves far less than the wall-clock figures. Runs on the embedded nats-server and PostgreSQL
(fsync on, as in production) under a temporary folder.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import psutil

from better_compute.clients import EngineClient
from better_compute.runtime.embedded import EmbeddedNats, EmbeddedPostgres
from better_compute.service.client import ApiClient, connect, discover
from better_compute.wire import Subjects

HERE = Path(__file__).parent


async def pg_counters(conn: Any) -> tuple[int, int]:
    """Transactions committed in the database and WAL bytes written so far."""
    row = await conn.fetchrow(
        "SELECT (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()) AS x,"
        " pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint AS wal"
    )
    return int(row["x"]), int(row["wal"])


class CpuMeter:
    """CPU seconds (user + system) that some processes and their children used between
    ``start`` and ``stop``; a process that appears in between counts from zero."""

    def __init__(self, *pids: int | None) -> None:
        self._roots = [psutil.Process(p) for p in pids if p is not None]
        self._seen: dict[int, float] = {}

    def _now(self) -> dict[int, float]:
        now: dict[int, float] = {}
        for root in self._roots:
            with contextlib.suppress(psutil.Error):
                for proc in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        t = proc.cpu_times()
                        now[proc.pid] = t.user + t.system
        return now

    def start(self) -> None:
        self._seen = self._now()

    def stop(self) -> float:
        now = self._now()
        return sum(v - self._seen.get(pid, 0.0) for pid, v in now.items())


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


async def set_log_statement(db_url: str, value: str) -> None:
    """Turn PostgreSQL's statement log on ('all') or off ('none') for the whole cluster."""
    conn = await asyncpg.connect(db_url)
    try:
        await conn.execute(f"ALTER SYSTEM SET log_statement = '{value}'")
        await conn.execute("SELECT pg_reload_conf()")
    finally:
        await conn.close()


def statements_per_step(log_text: str, steps: int, top: int = 15) -> list[tuple[float, str]]:
    """The statements PostgreSQL logged (``log_statement = 'all'``) per step, most frequent first:
    each statement's text, whitespace folded and cut to 90 characters."""
    counts: dict[str, int] = {}
    logged = r"LOG:  (?:statement|execute [^:]*): (.*?)(?=\n\d{4}-\d\d-\d\d |\Z)"
    for m in re.finditer(logged, log_text, re.S):
        text = " ".join(m.group(1).split())
        if "log_statement" in text or "pg_reload_conf" in text:
            continue
        counts[text[:90]] = counts.get(text[:90], 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    return [(c / steps, t) for t, c in ranked[:top]] + [(sum(counts.values()) / steps, "(all statements)")]


async def bench_engine(
    nats_url: str,
    db_url: str,
    n: int,
    s: int,
    engines: int,
    version: int,
    pg_pid: int | None,
    nodes: list[str] | None,
    warmup: bool = True,
) -> dict[str, Any]:
    """``nodes``: run each workflow on its own node (created on first use, ``--on-nodes``)."""
    env = {
        **os.environ,
        "BC_NATS_URL": nats_url,
        "BC_DATABASE_URL": db_url,
        "BC_APP": "bench_app:app",
        "BC_LOG_LEVEL": "warning",
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    # BC_BENCH_PROFILE=<folder>: each engine runs under cProfile and leaves
    # <folder>/engine-<i>-round<r>.prof when it stops (python -m pstats to read it)
    profile_dir = os.environ.get("BC_BENCH_PROFILE")

    def engine_argv(i: int) -> list[str]:
        if not profile_dir:
            return [sys.executable, "-m", "bc_engine"]
        out = Path(profile_dir) / f"engine-{i}-round{version}.prof"
        return [sys.executable, "-m", "cProfile", "-o", str(out), "-m", "bc_engine"]

    procs = [
        await asyncio.create_subprocess_exec(
            *engine_argv(i), "--instance", f"bench-engine-{i}",
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
        if nodes is not None and not nodes:
            for _ in range(n):
                node = await engine.create_node(site_id="bench-site")
                nodes.append(node.id)
        sem = asyncio.Semaphore(64)

        async def start(i: int) -> str:
            async with sem:
                wf = await engine.start_workflow(
                    profile_id="bench-chain", profile_version=version, node_id=nodes[i] if nodes else None
                )
                return str(wf.id)

        async def all_done(conn: Any, ids: list[str]) -> None:
            while True:
                left = await conn.fetchval(
                    "SELECT count(*) FROM engine.workflows WHERE state = 'running' AND id = ANY($1::text[])",
                    ids,
                )
                if left == 0:
                    return
                await asyncio.sleep(0.05)

        conn = await asyncpg.connect(db_url)
        if warmup:
            # the same batch once, unmeasured: the engine's pool opens its connections (each a new
            # PostgreSQL backend that loads its catalogs, types and plans) as a long-running engine
            # already has, as pgqueuer's one connection is open before its meter starts
            await all_done(conn, list(await asyncio.gather(*(start(i) for i in range(n)))))
        own, pg = CpuMeter(*(p.pid for p in procs)), CpuMeter(pg_pid)
        own.start(), pg.start()
        pg0 = await pg_counters(conn)
        t0 = time.perf_counter()
        ids = await asyncio.gather(*(start(i) for i in range(n)))
        t_started = time.perf_counter()
        try:
            await all_done(conn, ids)
            elapsed = time.perf_counter() - t0
            own_cpu, pg_cpu = own.stop(), pg.stop()
            pg1 = await pg_counters(conn)
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
            "name": f"bc-engine x{engines}" + (" nodes" if nodes else ""),
            "steps": n * s,
            "elapsed": elapsed,
            "start_phase": t_started - t0,
            "rate": n * s / elapsed,
            "p50": pct(gaps, 50),
            "p99": pct(gaps, 99),
            "cpu": own_cpu * 1000 / (n * s),
            "pg_cpu": pg_cpu * 1000 / (n * s),
            "xacts": (pg1[0] - pg0[0]) / (n * s),
            "wal": (pg1[1] - pg0[1]) / (n * s),
            "failed": failed,
        }
    finally:
        await nc.close()
        for p in procs:
            p.terminate()
        for p in procs:
            await p.wait()


async def bench_pgqueuer(db_url: str, n: int, s: int, pg_pid: int | None) -> dict[str, Any]:
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

    own, pg = CpuMeter(os.getpid()), CpuMeter(pg_pid)
    own.start(), pg.start()
    pg0 = await pg_counters(conn)
    t0 = time.perf_counter()
    await qm.queries.enqueue(["step"] * n, [f"{w}:0".encode() for w in range(n)], [0] * n)
    await qm.run(batch_size=20, dequeue_timeout=timedelta(seconds=1), mode=QueueExecutionMode.continuous)
    elapsed = time.perf_counter() - t0
    own_cpu, pg_cpu = own.stop(), pg.stop()
    pg1 = await pg_counters(conn)
    await conn.close()
    return {
        "name": "pgqueuer",
        "steps": n * s,
        "elapsed": elapsed,
        "start_phase": 0.0,
        "rate": n * s / elapsed,
        "p50": pct(gaps, 50),
        "p99": pct(gaps, 99),
        "cpu": own_cpu * 1000 / (n * s),
        "pg_cpu": pg_cpu * 1000 / (n * s),
        "xacts": (pg1[0] - pg0[0]) / (n * s),
        "wal": (pg1[1] - pg0[1]) / (n * s),
        "failed": n - done,
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workflows", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--engines", type=int, default=1, help="engine processes")
    ap.add_argument("--rounds", type=int, default=3, help="alternate engine and pgqueuer runs")
    ap.add_argument("--skip-pgqueuer", action="store_true")
    ap.add_argument(
        "--cold",
        action="store_true",
        help="measure each engine round from its first workflow (no unmeasured warm-up batch): the"
        " pool's new connections, their type look-ups and first plans count in the figures",
    )
    ap.add_argument(
        "--statements",
        action="store_true",
        help="after the rounds, one more engine round (no warm-up) with PostgreSQL's statement log"
        " on: print the statements per step, most frequent first",
    )
    ap.add_argument(
        "--on-nodes",
        action="store_true",
        help="each workflow on a node of its own (the node is read per pass)",
    )
    args = ap.parse_args()
    state = Path(tempfile.mkdtemp(prefix="bc-bench-"))
    nats, pg = EmbeddedNats(state), EmbeddedPostgres(state, durable=True)
    try:
        nats_url, db_url = nats.start(), pg.start()
        print(f"embedded servers under {state}; {args.workflows} workflows x {args.steps} steps", flush=True)
        nodes: list[str] | None = [] if args.on_nodes else None
        engine_runs: list[dict[str, Any]] = []
        pgq_runs: list[dict[str, Any]] = []
        header = (
            f"{'runner':<22}{'round':>6}{'steps':>8}{'seconds':>9}{'steps/s':>10}"
            f"{'p50 ms':>9}{'p99 ms':>9}{'cpu ms':>8}{'pg ms':>7}{'xacts':>7}{'wal B':>7}{'failed':>8}"
        )
        print("\n" + header, flush=True)
        for rnd in range(1, args.rounds + 1):
            runs = [
                await bench_engine(
                    nats_url,
                    db_url,
                    args.workflows,
                    args.steps,
                    args.engines,
                    rnd,
                    pg.running_pid(),
                    nodes,
                    warmup=not args.cold,
                )
            ]
            engine_runs.append(runs[0])
            if not args.skip_pgqueuer:
                runs.append(await bench_pgqueuer(db_url, args.workflows, args.steps, pg.running_pid()))
                pgq_runs.append(runs[1])
            for r in runs:
                print(
                    f"{r['name']:<22}{rnd:>6}{r['steps']:>8}{r['elapsed']:>9.2f}{r['rate']:>10.1f}"
                    f"{r['p50']:>9.2f}{r['p99']:>9.2f}{r['cpu']:>8.2f}{r['pg_cpu']:>7.2f}"
                    f"{r['xacts']:>7.2f}{r['wal']:>7.0f}{r['failed']:>8}",
                    flush=True,
                )
        best_e = max(engine_runs, key=lambda r: r["rate"])
        print(f"\nbest engine: {best_e['rate']:.1f} steps/s, p99 step-to-step {best_e['p99']:.2f} ms")
        cpu = sorted(r["cpu"] for r in engine_runs)
        pg_cpu = sorted(r["pg_cpu"] for r in engine_runs)
        print(
            f"engine CPU per step (median of rounds): {cpu[len(cpu) // 2]:.2f} ms,"
            f" PostgreSQL's {pg_cpu[len(pg_cpu) // 2]:.2f} ms"
        )
        if pgq_runs:
            best_p = max(pgq_runs, key=lambda r: r["rate"])
            med = sorted(e["rate"] / p["rate"] for e, p in zip(engine_runs, pgq_runs, strict=True))
            print(f"best pgqueuer: {best_p['rate']:.1f} steps/s, p99 job-to-job {best_p['p99']:.2f} ms")
            print(
                f"engine / pgqueuer throughput: best {best_e['rate'] / best_p['rate']:.2f}x,"
                f" median of rounds {med[len(med) // 2]:.2f}x"
            )
            # CPU per step, each side's own process(es): what load on a shared machine moves least
            cpu_ratio = sorted(e["cpu"] / p["cpu"] for e, p in zip(engine_runs, pgq_runs, strict=True))
            print(f"engine / pgqueuer CPU per step: median of rounds {cpu_ratio[len(cpu_ratio) // 2]:.2f}x")
        if args.statements:
            log = pg.dir / "postgres.log"
            seen = log.stat().st_size
            await set_log_statement(db_url, "all")
            try:
                await bench_engine(
                    nats_url, db_url, args.workflows, args.steps, args.engines, args.rounds + 1,
                    pg.running_pid(), nodes, warmup=False,
                )  # fmt: skip
            finally:
                await set_log_statement(db_url, "none")
            with log.open("rb") as f:
                f.seek(seen)
                text = f.read().decode(errors="replace")
            print("\nstatements per step (one engine round, no warm-up, log_statement = 'all'):")
            for per, stmt in statements_per_step(text, args.workflows * args.steps):
                print(f"{per:8.3f}  {stmt}")
    finally:
        pg.stop()
        nats.stop()


if __name__ == "__main__":
    asyncio.run(main())
