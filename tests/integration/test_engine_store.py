"""The engine's statements on real PostgreSQL: what each engine process reads is its own."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest_asyncio

from bc_engine.core import queue
from bc_engine.core.reconciler_store import PgReconcilerStore
from bc_engine.service import waiting_commands
from better_compute.core.ids import new_id
from better_compute.service import Database


@pytest_asyncio.fixture(loop_scope="session")
async def db(bc_database_url: str) -> AsyncIterator[Database]:
    database = Database(bc_database_url, "engine")
    await database.open()
    yield database
    await database.close()


async def waiting_workflow(db: Database, n: int) -> tuple[str, int, str]:
    """A running workflow whose step waits on a command: (its key, its shard, the command)."""
    wf_id, command_id = f"wf_watch{n}", f"cmd_watch{n}"
    shard = queue.shard_of(wf_id)
    await db.execute(
        "INSERT INTO workflows (id, tenant_id, rkey, shard, profile_tenant, profile_id, profile_version,"
        " state) VALUES ($1, 'root', $1, $2, 'builtin', 'p', 1, 'running')",
        wf_id,
        shard,
    )
    await db.execute(
        "INSERT INTO workflow_steps (workflow_id, idx, action, runs_on, mode, command, timeout_ms, state,"
        " attempt, command_id) VALUES ($1, 0, 'a', 'node', 'agent', 'k', 1000, 'running', 1, $2)",
        wf_id,
        command_id,
    )
    return wf_id, shard, command_id


async def test_the_command_watch_reads_only_the_waiting_steps_of_its_own_shards(db: Database) -> None:
    waiting = [await waiting_workflow(db, n) for n in range(40)]
    mine = sorted({shard for _key, shard, _cmd in waiting})[:3]
    expected = {cmd: key for key, shard, cmd in waiting if shard in mine}
    assert 0 < len(expected) < len(waiting)
    assert await waiting_commands(db, mine) == expected


async def _json_codecs(conn: Any) -> None:
    for typ in ("json", "jsonb"):
        await conn.set_type_codec(typ, encoder=lambda v: v, decoder=json.loads, schema="pg_catalog")


async def _workflow_with_steps(db: Database, wf_id: str, states: list[tuple[str, int]]) -> None:
    await db.execute(
        "INSERT INTO workflows (id, tenant_id, rkey, shard, profile_tenant, profile_id, profile_version,"
        " state) VALUES ($1, 'root', $1, $2, 'builtin', 'p', 1, 'running')",
        wf_id,
        queue.shard_of(wf_id),
    )
    for idx, (state, attempt) in enumerate(states):
        await db.execute(
            "INSERT INTO workflow_steps (workflow_id, idx, action, runs_on, mode, timeout_ms, state, attempt)"
            " VALUES ($1, $2, 'a', 'control-plane', 'control-plane', 60000, $3, $4)",
            wf_id,
            idx,
            state,
            attempt,
        )


async def test_settles_at_the_same_moment_share_one_commit_and_each_keeps_its_own_terms(
    bc_database_url: str,
) -> None:
    """The passes' successes go to PostgreSQL together (one statement, one transaction), and each
    still settles only under its own attempt and fence: one starts its next step, one finishes
    its workflow and queues its owner, one fenced off and one superseded settle nothing."""
    db = Database(bc_database_url, "engine", init=_json_codecs)
    await db.open()
    try:
        # a shard nobody holds, under a life of our own (the fence is checked, not the key's shard)
        lease = await db.fetchrow(
            "UPDATE shard_leases SET owner = 'settle-test#1', epoch = epoch + 1,"
            " expires_at = now() + interval '1 minute' WHERE shard = (SELECT shard FROM shard_leases"
            " WHERE owner IS NULL OR expires_at <= now() ORDER BY shard DESC LIMIT 1)"
            " RETURNING shard, owner, epoch"
        )
        fence = (lease["shard"], lease["owner"], lease["epoch"])
        stale = (lease["shard"], lease["owner"], lease["epoch"] - 1)
        ids = {name: new_id("wf") for name in ("next", "last", "fenced", "superseded")}
        await _workflow_with_steps(db, ids["next"], [("running", 1), ("pending", 0)])
        await _workflow_with_steps(db, ids["last"], [("succeeded", 1), ("running", 1)])
        await _workflow_with_steps(db, ids["fenced"], [("running", 1)])
        await _workflow_with_steps(db, ids["superseded"], [("running", 2)])
        owner_key = queue.owner_key("o", ids["last"])
        store = PgReconcilerStore(db)
        nxt, last, fenced, superseded = await asyncio.gather(
            store.settle_ok(ids["next"], 0, 1, '{"n": 1}', fence, None),
            store.settle_ok(ids["last"], 1, 1, '{"n": 2}', fence, owner_key),
            store.settle_ok(ids["fenced"], 0, 1, '{"n": 3}', stale, None),
            store.settle_ok(ids["superseded"], 0, 1, '{"n": 4}', fence, None),
        )
        assert (nxt.settled, nxt.finished) == (True, False)
        assert nxt.next is not None
        assert (nxt.next.workflow_id, nxt.next.idx, nxt.next.state, nxt.next.attempt) == (
            ids["next"], 1, "running", 1,
        )  # fmt: skip
        assert (last.settled, last.finished, last.next) == (True, True, None)
        assert (fenced.settled, superseded.settled) == (False, False)
        rows = await db.fetch(
            "SELECT workflow_id, idx, state, result, xmin::text AS tx FROM workflow_steps"
            " WHERE workflow_id = ANY($1::text[]) ORDER BY workflow_id, idx",
            list(ids.values()),
        )
        got = {(r["workflow_id"], r["idx"]): (r["state"], r["result"]) for r in rows}
        assert got[(ids["next"], 0)] == ("succeeded", {"n": 1})
        assert got[(ids["last"], 1)] == ("succeeded", {"n": 2})
        assert got[(ids["fenced"], 0)] == ("running", None)
        assert got[(ids["superseded"], 0)] == ("running", None)
        # one transaction wrote the settles, the next step and the end of the workflow
        settled = {(ids["next"], 0), (ids["next"], 1), (ids["last"], 1)}
        written = {r["tx"] for r in rows if (r["workflow_id"], r["idx"]) in settled}
        assert len(written) == 1
        assert await db.fetchval("SELECT state FROM workflows WHERE id = $1", ids["last"]) == "succeeded"
        assert await db.fetchval("SELECT count(*) FROM work_queue WHERE rkey = $1", owner_key) == 1
        await db.execute("DELETE FROM work_queue WHERE rkey = $1", owner_key)
        await db.execute(
            "UPDATE shard_leases SET owner = NULL, expires_at = now() WHERE owner = 'settle-test#1'"
        )
    finally:
        await db.close()
