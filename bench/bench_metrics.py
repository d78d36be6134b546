"""What a Prometheus scrape costs the store: the grouped counts behind the store-read gauges.

Fills the command queue's and the engine's schemas (embedded PostgreSQL, fsync on, in a temporary
folder) with ``--commands`` commands and ``--workflows`` workflows spread over kinds, sites and
profiles, 2% of the commands and 1% of the workflows live (history: the rest finished). Then times,
``--rounds`` times each: ``collect`` of each service's metrics (what ``/metrics`` runs before it
renders: live rows only), grouped counts over every row (what gauges of finished commands and
workflows would cost, why those are counters), and the rendering itself; prints the figures.

    uv run python bench/bench_metrics.py --commands 1000000 --workflows 200000
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bc_command_queue import metrics as cmdq_metrics
from bc_engine import metrics as engine_metrics
from better_compute.logging import configure_logging
from better_compute.runtime.embedded import EmbeddedPostgres
from better_compute.service.db import Database, load_migrations
from better_compute.service.metrics import render

FILL_COMMANDS = """
INSERT INTO commands (id, node_id, site_id, tenant_id, key, kind, destructive, target, payload, digest,
                      state, not_after)
SELECT 'cmd_' || i, 'node_' || (i % 5000), 'site' || (i % $2), 'root', 'k' || i,
       (ARRAY['power.setPower', 'management.setBootDevice', 'media.insert', 'media.eject',
              'management.inventory', 'driver.invoke'])[1 + i % 6],
       false, 'site', '{}', '\\x00',
       CASE i % 100 WHEN 0 THEN 'running' WHEN 1 THEN 'pending' WHEN 2 THEN 'failed'
                    WHEN 3 THEN 'cancelled' ELSE 'succeeded' END,
       now() + interval '1 day'
FROM generate_series(1, $1) AS i
"""
FILL_AGENTS = """
INSERT INTO agents (id, site_id, tenant_id, role, cert_id)
SELECT 'agent_' || i, 'site' || (i % $2), 'root', 'site', 'cert_' || i FROM generate_series(1, $1) AS i
"""
FILL_WORKFLOWS = """
INSERT INTO workflows (id, tenant_id, rkey, shard, profile_tenant, profile_id, profile_version, state)
SELECT 'wf_' || i, 'root', 'wf_' || i, i % 64, 'root', 'profile-' || (i % $2), 1,
       CASE i % 100 WHEN 0 THEN 'running' WHEN 1 THEN 'failed' WHEN 2 THEN 'aborted' ELSE 'succeeded' END
FROM generate_series(1, $1) AS i
"""
FULL_COMMANDS = "SELECT kind, state, site_id, count(*) FROM commands GROUP BY 1, 2, 3"
FULL_WORKFLOWS = "SELECT state, profile_id, count(*) FROM workflows GROUP BY 1, 2"


async def _timed(rounds: int, fn: Any) -> list[float]:
    took = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        await fn()
        took.append((time.perf_counter() - t0) * 1000)
    return took


def _line(name: str, took: list[float]) -> str:
    return f"{name:<34} p50 {statistics.median(took):8.1f} ms   max {max(took):8.1f} ms"


async def bench(args: argparse.Namespace, state: Path) -> None:
    pg = EmbeddedPostgres(state)
    url = pg.start()
    cmdq = Database(url, "cmdq")
    engine = Database(url, "engine")
    try:
        await cmdq.open()
        await engine.open()
        await cmdq.migrate(load_migrations("bc_command_queue.migrations"))
        await engine.migrate(load_migrations("bc_engine.migrations"))
        t0 = time.perf_counter()
        await cmdq.execute(FILL_COMMANDS, args.commands, args.sites)
        await cmdq.execute(FILL_AGENTS, args.sites, args.sites)
        await engine.execute(FILL_WORKFLOWS, args.workflows, args.profiles)
        await cmdq.execute("ANALYZE commands")
        await engine.execute("ANALYZE workflows")
        print(
            f"filled {args.commands} commands over {args.sites} sites and {args.workflows} workflows"
            f" over {args.profiles} profiles in {time.perf_counter() - t0:.1f} s"
        )
        cq = await _timed(args.rounds, lambda: cmdq_metrics.collect(cmdq, silent_after_ms=15_000))
        en = await _timed(args.rounds, lambda: engine_metrics.collect(engine))
        # what gauges over every row (finished ones too) would cost: why those are counters
        full_cq = await _timed(args.rounds, lambda: cmdq.fetch(FULL_COMMANDS))
        full_en = await _timed(args.rounds, lambda: engine.fetch(FULL_WORKFLOWS))

        async def rendering() -> None:
            render()

        out = await _timed(args.rounds, rendering)
        print(_line("command-queue collect (3 queries)", cq))
        print(_line("engine collect (1 query)", en))
        print(_line("all commands by kind/state/site", full_cq))
        print(_line("all workflows by state/profile", full_en))
        print(_line("render (text exposition)", out))
        print(f"exposition size: {len(render())} bytes")
    finally:
        await cmdq.close()
        await engine.close()
        pg.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--commands", type=int, default=200_000)
    parser.add_argument("--workflows", type=int, default=50_000)
    parser.add_argument("--sites", type=int, default=20)
    parser.add_argument("--profiles", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    configure_logging(level="warning")
    with tempfile.TemporaryDirectory(prefix="bc-bench-metrics-") as tmp:
        asyncio.run(bench(args, Path(tmp)))


if __name__ == "__main__":
    main()
