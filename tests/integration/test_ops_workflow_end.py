"""Every end of a workflow is in the feed and in the engine's metrics: a failed workflow's last
event is ``finished`` (after its failed step's), an abort is its ``verb``; both are counted in
``bc_workflows_finished_total``, by profile and state."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import msgspec
import pytest_asyncio
from nats.aio.client import Client as Nats
from prometheus_client import REGISTRY

from bc_engine.service import EngineService
from better_compute.clients import EngineClient
from better_compute.config import Settings
from better_compute.service import ApiClient
from better_compute.testing import until
from better_compute.testing.workflows import wait_workflow
from better_compute.wire import Subjects
from better_compute.wire.engine import (
    StepChanged,
    VerbApplied,
    WorkflowEvent,
    WorkflowFinished,
    decode_workflow_event,
)
from engine_test_app import TABLES


@pytest_asyncio.fixture(loop_scope="session")
async def engine(bc_settings: Settings) -> AsyncIterator[EngineService]:
    conn = await asyncpg.connect(bc_settings.database_url)
    await conn.execute(TABLES)
    await conn.close()
    svc = EngineService(msgspec.structs.replace(bc_settings, app="engine_test_app:app"))
    async with svc:
        run = asyncio.create_task(svc.run())
        yield svc
        svc.request_stop()
        await asyncio.wait_for(run, 10)


def _finished(profile: str, state: str) -> float:
    value = REGISTRY.get_sample_value("bc_workflows_finished_total", {"profile": profile, "state": state})
    return value or 0.0


async def test_a_failed_and_an_aborted_workflow_end_in_the_feed_and_the_counter(
    engine: EngineService, bc_api: ApiClient, bc_nats: Nats, bc_subjects: Subjects
) -> None:
    events: dict[str, list[WorkflowEvent]] = {}

    async def collect(msg: Any) -> None:
        event = decode_workflow_event(msg.data)
        if event is not None:
            events.setdefault(msg.subject.rsplit(".", 1)[-1], []).append(event)

    sub = await bc_nats.subscribe(bc_subjects.events_all("workflow"), cb=collect)
    api = EngineClient(bc_api)
    steps = [{"use": "test.noop"}, {"use": "test.failUnlessFlag", "with": {"flag": "never"}}]
    await api.create_profile(
        document={"id": "ends", "version": 1, "target": "metal", "role": "host", "steps": steps}
    )
    failed_before, aborted_before = _finished("ends", "failed"), _finished("ends", "aborted")

    failing = await api.start_workflow(profile_id="ends")
    assert (await wait_workflow(bc_api, failing.id)).state == "failed"
    await until(lambda: any(isinstance(e, WorkflowFinished) for e in events.get(failing.id, [])), timeout=5)
    last_two = events[failing.id][-2:]
    assert isinstance(last_two[0], StepChanged)
    assert (last_two[0].step.index, last_two[0].step.state) == (1, "failed")
    assert isinstance(last_two[1], WorkflowFinished)
    assert last_two[1].workflow_state == "failed"
    assert _finished("ends", "failed") == failed_before + 1

    waiting = [{"use": "test.waitFlag", "with": {"flag": "never"}}]
    await api.create_profile(
        document={"id": "ends", "version": 2, "target": "metal", "role": "host", "steps": waiting}
    )
    aborted = await api.start_workflow(profile_id="ends", profile_version=2)
    await api.abort_workflow(id=aborted.id)
    await until(lambda: any(isinstance(e, VerbApplied) for e in events.get(aborted.id, [])), timeout=5)
    verb = next(e for e in events[aborted.id] if isinstance(e, VerbApplied))
    assert (verb.verb, verb.workflow_state) == ("abort", "aborted")
    assert _finished("ends", "aborted") == aborted_before + 1
    await sub.unsubscribe()
