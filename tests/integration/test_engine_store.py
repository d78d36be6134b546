"""The engine's statements on real PostgreSQL: what each engine process reads is its own."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from bc_engine.core import queue
from bc_engine.service import waiting_commands
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
