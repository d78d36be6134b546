"""The engine as OS processes, killed on purpose (SIGKILL: no cleanup at all)."""

from __future__ import annotations

import asyncpg

from better_compute.clients import EngineClient
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, until
from better_compute.testing.workflows import wait_workflow, wait_workflows


async def test_sigkill_between_mark_running_and_settle_reruns_with_the_same_key(
    procs: ServiceProcesses, bc_api: ApiClient, db: asyncpg.Connection
) -> None:
    engine_api = EngineClient(bc_api)
    first = procs.start("bc-engine")
    await procs.wait_ready()
    await engine_api.create_profile(document={"id": "effect", "version": 1, "target": "metal", "role": "host",
                      "steps": [{"use": "test.sideEffect", "with": {"holdMs": 60000}},
                                {"use": "test.noop"}]})  # fmt: skip
    wf = await engine_api.start_workflow(profile_id="effect")

    async def ran_once() -> bool:
        return bool(await db.fetchval("SELECT count(*) FROM public.plg_test_runs") == 1)

    await until(ran_once, timeout=20)
    view = await engine_api.get_workflow(id=wf.id)
    assert view.steps[0].state == "running"
    first.kill()  # the side effect is done, the step is not settled

    await db.execute("INSERT INTO public.plg_test_flags VALUES ('release')")
    procs.start("bc-engine")
    await procs.wait_ready()
    done = await wait_workflow(bc_api, wf.id, timeout=30)
    assert done.state == "succeeded"
    runs = await db.fetch("SELECT step_key FROM public.plg_test_runs")
    effects = await db.fetch("SELECT step_key, n FROM public.plg_test_effects")
    key = f"wf:{wf.id}:0#1"
    assert [r["step_key"] for r in runs] == [key, key]  # it ran twice, under one key
    assert [(e["step_key"], e["n"]) for e in effects] == [(key, 1)]  # the effect happened once
    assert done.steps[0].attempt == 1
    assert done.steps[0].result == {"effect": 1, "key": key}


async def test_two_engines_share_the_shards_and_survive_losing_one(
    procs: ServiceProcesses, bc_api: ApiClient, db: asyncpg.Connection
) -> None:
    engine_api = EngineClient(bc_api)
    a = procs.start("bc-engine")
    procs.start("bc-engine")
    await procs.wait_ready()

    async def split() -> bool:
        owners = await db.fetch(
            "SELECT owner, count(*) AS n FROM engine.shard_leases WHERE expires_at > now() GROUP BY owner"
        )
        return sorted(r["n"] for r in owners) == [32, 32]

    await until(split, timeout=20)
    await engine_api.create_profile(document={"id": "gate", "version": 1, "target": "metal", "role": "host",
                      "steps": [{"use": "test.noop"}, {"use": "test.waitFlag", "with": {"flag": "go"}},
                                {"use": "test.sideEffect"}]})  # fmt: skip
    ids = [(await engine_api.start_workflow(profile_id="gate")).id for _ in range(40)]

    async def all_waiting() -> bool:
        n = await db.fetchval(
            "SELECT count(*) FROM engine.workflow_steps WHERE idx = 1 AND state = 'running'"
        )
        return bool(n == 40)

    await until(all_waiting, timeout=20)
    a.kill()
    await db.execute("INSERT INTO public.plg_test_flags VALUES ('go')")
    done = await wait_workflows(bc_api, ids, timeout=60)
    assert [d.state for d in done] == ["succeeded"] * 40
    # every side effect happened exactly once
    assert await db.fetchval("SELECT count(*) FROM public.plg_test_effects") == 40

    async def one_owner() -> bool:
        owners = await db.fetch("SELECT DISTINCT owner FROM engine.shard_leases WHERE expires_at > now()")
        return len(owners) == 1

    await until(one_owner, timeout=20)
