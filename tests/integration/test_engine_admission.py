"""Per-site admission on real PostgreSQL and NATS: a site runs at most ``[engine] site_admission``
workflows at once; the others wait, oldest first, with no step started (docs/engine.md)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import msgspec
import pytest_asyncio

from bc_engine.service import EngineService
from better_compute.clients import EngineClient
from better_compute.config import EngineSettings, Settings
from better_compute.core.ids import new_id
from better_compute.service import ApiClient
from better_compute.testing import until
from better_compute.testing.workflows import wait_workflow

LIMIT = 2


@pytest_asyncio.fixture(loop_scope="session")
async def engine(bc_settings: Settings, db: asyncpg.Connection) -> AsyncIterator[EngineService]:
    settings = msgspec.structs.replace(
        bc_settings, app="engine_test_app:app", engine=EngineSettings(site_admission=LIMIT)
    )
    svc = EngineService(settings)
    async with svc:
        run = asyncio.create_task(svc.run())
        yield svc
        svc.request_stop()
        await asyncio.wait_for(run, 10)


async def flagged_profile(api: ApiClient, flag: str) -> str:
    """A profile of one step that waits until ``flag`` is set (test.waitFlag)."""
    pid = f"t-adm-{flag}"
    step = {"use": "test.waitFlag", "with": {"flag": flag, "pollMs": 50}, "timeout": "5m"}
    doc = {"id": pid, "version": 1, "target": "metal", "role": "host", "steps": [step]}
    await EngineClient(api).create_profile(document=doc)
    return pid


async def set_flag(db: asyncpg.Connection, name: str) -> None:
    await db.execute("INSERT INTO public.plg_test_flags VALUES ($1) ON CONFLICT DO NOTHING", name)


async def test_a_sites_workflows_past_its_admission_wait_unstarted_and_start_oldest_first(
    engine: EngineService, bc_api: ApiClient, db: asyncpg.Connection
) -> None:
    api = EngineClient(bc_api)
    tag = new_id("wf")[-8:].lower()
    site, elsewhere = f"adm-{tag}", f"adm-{tag}-b"
    flags = [f"{tag}-{i}" for i in range(5)]
    nodes = [await api.create_node(site_id=site) for _ in range(4)]
    other = await api.create_node(site_id=elsewhere)
    wfs = []
    for node, flag in zip(nodes, flags, strict=False):
        wfs.append(await api.start_workflow(profile_id=await flagged_profile(bc_api, flag), node_id=node.id))
    away = await api.start_workflow(profile_id=await flagged_profile(bc_api, flags[4]), node_id=other.id)
    assert [w.queued for w in wfs] == [False, False, True, True]
    assert away.queued is False  # another site's room

    async def step_state(wf_id: str) -> str:
        return str((await api.get_workflow(id=wf_id)).steps[0].state)

    for wf in (wfs[0], wfs[1], away):
        await until(lambda w=wf: _is(step_state(w.id), "running"), timeout=10, what=f"{wf.id} running")
    for wf in wfs[2:]:
        view = await api.get_workflow(id=wf.id)
        assert (view.state, view.queued) == ("running", True)
        assert view.steps[0].state == "pending"
        assert view.steps[0].started_at is None  # no step started: no deadline runs
    why = await api.why(id=nodes[3].id)
    assert why.reasons[0].kind == "queued", why
    assert (why.reasons[0].facts["running"], why.reasons[0].facts["ahead"]) == (LIMIT, 1)
    assert f"queued at site {site}" in why.answer

    # an aborted waiting workflow ends without ever starting its step, and holds no room
    aborted = await api.abort_workflow(id=wfs[3].id, reason="test")
    assert aborted.state == "aborted"
    late = await api.create_node(site_id=site)
    wfs.append(
        await api.start_workflow(profile_id=await flagged_profile(bc_api, f"{tag}-late"), node_id=late.id)
    )
    assert wfs[-1].queued is True  # wfs[2] waits before it
    flags.append(f"{tag}-late")

    # the first one ends: the oldest waiting one starts, the later one still waits
    await set_flag(db, flags[0])
    assert (await wait_workflow(bc_api, wfs[0].id, timeout=10)).state == "succeeded"
    await until(lambda: _is(step_state(wfs[2].id), "running"), timeout=10, what="the oldest waiting one ran")
    assert (await api.get_workflow(id=wfs[-1].id)).queued is True
    for flag in (flags[1], flags[2], flags[4], flags[-1]):
        await set_flag(db, flag)
    for wf in (wfs[1], wfs[2], wfs[-1], away):
        done = await wait_workflow(bc_api, wf.id, timeout=15)
        assert (done.state, done.queued) == ("succeeded", False), done
    never = await api.get_workflow(id=wfs[3].id)
    assert never.steps[0].started_at is None

    # at no moment did more than LIMIT of the site's steps run at once
    rows = await db.fetch(
        "SELECT s.started_at, s.finished_at FROM engine.workflow_steps s"
        " JOIN engine.workflows w ON w.id = s.workflow_id WHERE w.site_id = $1 AND s.started_at IS NOT NULL",
        site,
    )
    assert len(rows) == 4
    for r in rows:
        at_once = sum(1 for o in rows if o["started_at"] <= r["started_at"] < o["finished_at"])
        assert at_once <= LIMIT, rows


async def _is(value: Any, want: str) -> bool:
    return bool(await value == want)
