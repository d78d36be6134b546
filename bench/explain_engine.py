"""The plans of the engine's hot statements on ~100k workflows (``bc_engine.store``).

    uv run python bench/explain_engine.py --workflows 100000

Fills the engine schema of an embedded PostgreSQL (under a temporary folder) with N workflows of
two steps each over 2000 nodes in 50 sites, then prints, for each statement, whether its plan
scans a whole table and how long it took (EXPLAIN ANALYZE, custom and generic plans: asyncpg
prepares every statement, and PostgreSQL may switch to a generic plan after five runs).

Then the admission statements (``ADMIT_PICK``, ``ADMIT_MARK``, ``QUEUED_AHEAD``; docs/engine.md
"Admission") with ``--waiting`` workflows waiting over the 50 sites: first right after they were
inserted, before PostgreSQL analysed them (as right after a bulk verb: the plan that once held the
admission lock for 10 minutes at 10,000 machines came from such rows), then after ``ANALYZE``.
A statement that writes (``ADMIT_MARK``) runs in a transaction that is rolled back.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import asyncpg

from bc_engine import store
from better_compute.runtime.embedded import EmbeddedPostgres
from better_compute.service import apply_migrations, load_migrations

FILL = """
INSERT INTO nodes (id, tenant_id, site_id)
SELECT 'node_' || lpad(i::text, 6, '0'), 't' || (i % 10), 'site' || (i % 50) FROM generate_series(1, 2000) i;
INSERT INTO workflows (id, tenant_id, node_id, rkey, shard, profile_tenant, profile_id, profile_version,
                       state, created_at, site_id)
SELECT 'wf_' || lpad(i::text, 8, '0'), 't' || (i % 10), 'node_' || lpad((i % 2000 + 1)::text, 6, '0'),
       'node_' || lpad((i % 2000 + 1)::text, 6, '0'), i % 64, 'builtin', 'p' || (i % 20), 1,
       CASE WHEN i > $1 - 2000 THEN 'running' WHEN i % 7 = 0 THEN 'failed' ELSE 'succeeded' END,
       now() - make_interval(secs => $1 - i), 'site' || ((i % 2000 + 1) % 50)
FROM generate_series(1, $1) i;
INSERT INTO workflow_steps (workflow_id, idx, action, runs_on, mode, command, timeout_ms, state, attempt,
                            command_id)
SELECT w.id, s, 'a', 'node', 'agent', 'k', 1000,
       CASE WHEN w.state = 'running' AND s = 1 THEN 'running' ELSE 'succeeded' END, 1,
       CASE WHEN w.state = 'running' AND s = 1 THEN 'cmd_' || w.id END
FROM workflows w, generate_series(0, 1) s;
"""

CASES: list[tuple[str, str, tuple[object, ...]]] = [
    ("workflows.list", store.LIST_WORKFLOWS, (None, None, None, None, None, 51)),
    ("workflows.list by node", store.LIST_WORKFLOWS, ("node_000042", None, None, None, None, 51)),
    ("workflows.list failed", store.LIST_WORKFLOWS, (None, "failed", None, None, None, 51)),
    ("workflows.list by profile", store.LIST_WORKFLOWS, (None, None, "p7", None, None, 51)),
    ("workflows.list by tenant", store.LIST_WORKFLOWS, (None, None, None, "t3", "wf_00050000", 51)),
    ("nodes.list by site", store.LIST_NODES, ("site7", None, None, 51, None, None, None)),
    ("command watch, 8 of 64 shards", store.WAITING_COMMANDS, (list(range(8)),)),
    ("a pass's workflows", store.PASS_WORKFLOWS, ("node_000042",)),
    ("node busy", store.NODE_BUSY, ("node_000042", None)),
    ("workflow's step sizes", store.STEP_SIZES, ("wf_00000042", -1)),
]


# workflows waiting for admission, as a bulk verb leaves them ($1 of them, after the N above)
WAITING = """
INSERT INTO nodes (id, tenant_id, site_id)
SELECT 'nq_' || lpad(i::text, 8, '0'), 't' || (i % 10), 'site' || (i % 50) FROM generate_series(1, $1) i;
INSERT INTO workflows (id, tenant_id, node_id, rkey, shard, profile_tenant, profile_id, profile_version,
                       state, created_at, site_id, admitted)
SELECT 'wq_' || lpad(i::text, 8, '0'), 't' || (i % 10), 'nq_' || lpad(i::text, 8, '0'),
       'nq_' || lpad(i::text, 8, '0'), i % 64, 'builtin', 'p' || (i % 20), 1, 'running',
       now() + make_interval(secs => i), 'site' || (i % 50), false
FROM generate_series(1, $1) i;
"""


def admission_cases(waiting: int, last_created: object) -> list[tuple[str, str, tuple[object, ...]]]:
    """The admission statements over ``waiting`` waiting workflows; ``why`` of the last of them."""
    last = f"wq_{waiting:08d}"
    marked = [f"wq_{i:08d}" for i in range(1, min(waiting, 5000) + 1)]
    site = f"site{waiting % 50}"
    return [
        ("admission pick, 100 a site", store.ADMIT_PICK, (100,)),
        (f"admission mark, {len(marked)} ids", store.ADMIT_MARK, (marked,)),
        ("why: queued ahead of the last", store.QUEUED_AHEAD, (site, last_created, last)),
    ]


async def explain(conn: asyncpg.Connection, sql: str, args: tuple[object, ...], mode: str) -> str:
    await conn.execute(f"SET plan_cache_mode = {mode}")
    await conn.execute("DEALLOCATE ALL")
    stmt = await conn.prepare(f"EXPLAIN (ANALYZE, FORMAT TEXT) {sql}")
    tr = conn.transaction()  # EXPLAIN ANALYZE runs the statement: whatever it writes is undone
    await tr.start()
    try:
        rows = await stmt.fetch(*args)
    finally:
        await tr.rollback()
    plan = [r[0] for r in rows]
    seq = sorted({line.split("Seq Scan on ")[1].split()[0] for line in plan if "Seq Scan on " in line})
    took = next((line.split(":")[1].strip() for line in plan if line.startswith("Execution Time")), "?")
    return f"{took:>12}  {'seq scan of ' + ', '.join(seq) if seq else 'no full scan'}"


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workflows", type=int, default=100_000)
    ap.add_argument("--plans", action="store_true", help="print the whole plans too")
    ap.add_argument("--waiting", type=int, default=10_000, help="workflows waiting for admission")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bc-explain-") as tmp:
        pg = EmbeddedPostgres(Path(tmp), durable=False)
        try:
            conn = await asyncpg.connect(pg.start())
            await apply_migrations(conn, "engine", load_migrations("bc_engine.migrations"))
            await conn.execute('SET search_path = "engine", public')
            await conn.execute(FILL.replace("$1", str(args.workflows)))
            await conn.execute("ANALYZE")
            print(f"{args.workflows} workflows, {2 * args.workflows} steps, 2000 nodes\n")
            print(f"{'statement':<34}{'custom plan':>40}   {'generic plan':>40}")
            await show(conn, CASES, plans=args.plans)
            await conn.execute(WAITING.replace("$1", str(args.waiting)))
            created = await conn.fetchval(
                "SELECT created_at FROM workflows WHERE id = $1", f"wq_{args.waiting:08d}"
            )
            cases = admission_cases(args.waiting, created)
            print(f"\n{args.waiting} waiting for admission, not analysed yet (as right after a bulk verb)")
            await show(conn, cases, plans=args.plans)
            await conn.execute("ANALYZE")
            print(f"\n{args.waiting} waiting for admission, analysed")
            await show(conn, cases, plans=args.plans)
            await conn.close()
        finally:
            pg.stop()


async def show(
    conn: asyncpg.Connection, cases: list[tuple[str, str, tuple[object, ...]]], *, plans: bool
) -> None:
    for name, sql, params in cases:
        custom = await explain(conn, sql, params, "force_custom_plan")
        generic = await explain(conn, sql, params, "force_generic_plan")
        print(f"{name:<34}{custom:>40}   {generic:>40}")
        if plans:
            stmt = await conn.prepare(f"EXPLAIN {sql}")
            print("\n".join("    " + r[0] for r in await stmt.fetch(*params)))


if __name__ == "__main__":
    asyncio.run(main())
