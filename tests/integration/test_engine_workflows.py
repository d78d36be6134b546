"""The engine on real PostgreSQL and NATS: workflows, waits, failures and verbs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import msgspec
import pytest
import pytest_asyncio
from nats.aio.client import Client as Nats

from bc_engine.service import EngineService
from better_compute.clients import EngineClient
from better_compute.config import Settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id
from better_compute.service import ApiClient
from better_compute.testing import until
from better_compute.testing.workflows import wait_workflow
from better_compute.wire import Subjects
from better_compute.wire.engine import (
    ProfileView,
    StepChanged,
    WorkflowEvent,
    WorkflowFinished,
    WorkflowProfile,
    decode_workflow_event,
)
from better_compute.wire.metal import NodeBmc
from better_compute.wire.pki import JOIN_EVENTS, CertificateInfo, CertificateList, JoinAccepted, JoinRefused


@pytest_asyncio.fixture(loop_scope="session")
async def engine(bc_settings: Settings, db: asyncpg.Connection) -> AsyncIterator[EngineService]:
    svc = EngineService(msgspec.structs.replace(bc_settings, app="engine_test_app:app"))
    async with svc:
        run = asyncio.create_task(svc.run())
        yield svc
        svc.request_stop()
        await asyncio.wait_for(run, 10)


async def create_profile(api: ApiClient, steps: list[dict[str, Any]], **kw: Any) -> ProfileView:
    doc = {"id": kw.pop("id", "t-profile"), "version": kw.pop("version", 1), "target": "metal",
           "role": "host", "steps": steps}  # fmt: skip
    return await EngineClient(api).create_profile(document=doc, **kw)


async def wait_step_running(api: ApiClient, workflow_id: str, idx: int) -> None:
    async def running() -> bool:
        view = await EngineClient(api).get_workflow(id=workflow_id)
        return bool(view.steps[idx].state == "running")

    await until(running, timeout=4, interval=0.02, what=f"step {idx} running")


async def flag(db: asyncpg.Connection, name: str) -> None:
    await db.execute("INSERT INTO public.plg_test_flags VALUES ($1) ON CONFLICT DO NOTHING", name)


async def test_a_chain_runs_in_order_and_publishes_each_change(
    engine: EngineService, bc_api: ApiClient, bc_nats: Nats, bc_subjects: Subjects
) -> None:
    events: list[WorkflowEvent] = []

    async def collect(msg: Any) -> None:
        event = decode_workflow_event(msg.data)
        assert event is not None, msg.data
        events.append(event)

    sub = await bc_nats.subscribe(bc_subjects.events_all("workflow"), cb=collect)
    wf = await EngineClient(bc_api).start_workflow(profile_id="test-chain", owner="test-owner")
    assert wf.profile == WorkflowProfile(tenant_id="builtin", id="test-chain", version=1)
    done = await wait_workflow(bc_api, wf.id)
    assert done.state == "succeeded"
    assert [(s.index, s.state, s.attempt) for s in done.steps] == [(i, "succeeded", 1) for i in range(6)]
    starts = [s.started_at for s in done.steps]
    assert starts == sorted(starts)
    assert all(s.result == {"ok": True} for s in done.steps)

    def all_heard() -> bool:
        return any(isinstance(e, WorkflowFinished) for e in events)

    await until(all_heard, timeout=5, what="every step's and the workflow's event")
    await sub.unsubscribe()
    seen = []
    for event in events:
        match event:
            case StepChanged(step=step):
                seen.append((step.index, step.state))
            case WorkflowFinished(workflow_state=state):
                assert state == "succeeded"
    assert seen == [(i, st) for i in range(6) for st in ("running", "succeeded")]
    assert isinstance(events[-1], WorkflowFinished)


async def test_the_owner_hears_when_its_workflow_ends(
    engine: EngineService, bc_api: ApiClient, db: asyncpg.Connection
) -> None:
    wf = await EngineClient(bc_api).start_workflow(profile_id="test-chain", owner="test-owner")
    await wait_workflow(bc_api, wf.id)
    heard = f"owner-heard:{wf.id}"
    await until(
        lambda: db.fetchval("SELECT 1 FROM public.plg_test_flags WHERE name = $1", heard),
        timeout=5,
        what="the owner reconciler ran",
    )


def spy_wakes(engine: EngineService, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The reconciler keys the engine wakes from now on (it still wakes them)."""
    woken: list[str] = []
    wake = engine.wake

    async def spy(rkey: str) -> None:
        woken.append(rkey)
        await wake(rkey)

    monkeypatch.setattr(engine, "wake", spy)
    monkeypatch.setattr(engine.engine, "wake", spy)
    monkeypatch.setattr(engine.engine_api.workflows, "wake", spy)
    return woken


async def test_the_owner_is_woken_when_its_workflow_ends_not_left_to_the_poll(
    engine: EngineService, bc_api: ApiClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A metal node moves on (deployed, ready) as its workflow ends, not up to a poll later."""
    woken = spy_wakes(engine, monkeypatch)
    wf = await EngineClient(bc_api).start_workflow(profile_id="test-chain", owner="test-owner")
    assert (await wait_workflow(bc_api, wf.id)).state == "succeeded"
    await until(lambda: f"test-owner:{wf.id}" in woken, timeout=5, what="the owner's key woken")


async def test_an_aborted_workflows_owner_is_woken(
    engine: EngineService, bc_api: ApiClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator's abort moves a metal node to failed at once, not at the next poll."""
    woken = spy_wakes(engine, monkeypatch)
    await create_profile(bc_api, [{"use": "test.waitFlag", "with": {"flag": "never"}}], id="t-abort-owner")
    wf = await EngineClient(bc_api).start_workflow(profile_id="t-abort-owner", owner="test-owner")
    await wait_step_running(bc_api, wf.id, 0)
    assert (await EngineClient(bc_api).abort_workflow(id=wf.id)).state == "aborted"
    await until(lambda: f"test-owner:{wf.id}" in woken, timeout=5, what="the owner's key woken")


async def test_a_nodes_join_wakes_its_workflows_key(
    engine: EngineService, bc_nats: Nats, bc_subjects: Subjects, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``wait.agentJoined`` of the node's workflow looks again when the node's agent joins (its
    workflows' key is the node id), not at its next poll; other joins wake no node's key."""
    woken = spy_wakes(engine, monkeypatch)
    for agent_id, role in [("agt_site", "site"), ("node_joined", "provisioned"), ("node_ramdisk", "node")]:
        event = JoinAccepted(join_token_id=f"jt_{agent_id}", agent_id=agent_id, cert_id="cert_x", role=role)
        await bc_nats.publish(bc_subjects.event(JOIN_EVENTS, f"jt_{agent_id}"), msgspec.json.encode(event))
    refused = JoinRefused(join_token_id="jt_bad", reason="token-used-up", code="UNAUTHENTICATED")
    await bc_nats.publish(bc_subjects.event(JOIN_EVENTS, "jt_bad"), msgspec.json.encode(refused))
    await until(
        lambda: {"node_joined", "node_ramdisk"} <= set(woken), timeout=5, what="the nodes' keys woken"
    )
    assert "agt_site" not in woken  # its event came first


async def test_step_not_ready_waits_then_succeeds_on_the_same_attempt(
    engine: EngineService, bc_api: ApiClient, db: asyncpg.Connection
) -> None:
    engine_api = EngineClient(bc_api)
    await create_profile(bc_api, [{"use": "test.waitFlag", "with": {"flag": "go", "pollMs": 100}}])
    wf = await engine_api.start_workflow(profile_id="t-profile")
    checks = "SELECT coalesce(max(n), 0) FROM public.plg_test_checks WHERE flag = 'go'"
    # the step checked its flag twice and was told not ready each time: it waits, it did not fail

    async def checked_twice() -> bool:
        return bool(await db.fetchval(checks) >= 2)

    await until(checked_twice, timeout=10, what="two checks of the flag")
    view = await engine_api.get_workflow(id=wf.id)
    assert view.state == "running"
    assert view.steps[0].state == "running"
    assert view.steps[0].deadline > view.steps[0].started_at
    await flag(db, "go")
    done = await wait_workflow(bc_api, wf.id)
    assert done.state == "succeeded"
    assert done.steps[0].result == {"flag": "go", "attempt": 1}


async def test_an_engine_that_takes_the_shards_runs_each_waiting_workflow_once_at_once(
    bc_settings: Settings, bc_api: ApiClient, db: asyncpg.Connection
) -> None:
    """A wake-up lives in one engine's memory: when that engine is gone (a kill after a step
    enqueued its next command and before it recorded it), the workflow's key may be due only at
    an earlier wait's end. The engine that takes the shards runs each key of them once, so the
    workflow goes on at once, not an hour later."""
    settings = msgspec.structs.replace(bc_settings, app="engine_test_app:app")
    engine_api = EngineClient(bc_api)
    first = EngineService(settings)
    async with first:
        run = asyncio.create_task(first.run())
        await create_profile(
            bc_api, [{"use": "test.waitFlag", "with": {"flag": "taken", "pollMs": 3_600_000}}], id="t-taken"
        )
        wf = await engine_api.start_workflow(profile_id="t-taken")
        checks = "SELECT coalesce(max(n), 0) FROM public.plg_test_checks WHERE flag = 'taken'"
        await until(lambda: db.fetchval(checks), timeout=10, what="the step checked its flag")
        first.request_stop()
        await asyncio.wait_for(run, 10)
    await flag(db, "taken")  # the wake-up that would have come is lost with the first engine
    due = await db.fetchval(
        "SELECT q.not_before FROM engine.work_queue q JOIN engine.workflows w ON w.rkey = q.rkey"
        " WHERE w.id = $1",
        wf.id,
    )
    assert due > datetime.now(UTC) + timedelta(minutes=30), "the key waits for the step's hour"
    second = EngineService(settings)
    async with second:
        run = asyncio.create_task(second.run())
        try:
            ended = "SELECT state <> 'running' FROM engine.workflows WHERE id = $1"
            await until(lambda: db.fetchval(ended, wf.id), timeout=20, what="the workflow ended")
            done = await engine_api.get_workflow(id=wf.id)
        finally:
            second.request_stop()
            await asyncio.wait_for(run, 10)
    assert done.state == "succeeded"
    assert done.steps[0].result == {"flag": "taken", "attempt": 1}


async def test_a_step_that_never_gets_ready_fails_timeout_at_its_deadline(
    engine: EngineService, bc_api: ApiClient
) -> None:
    await create_profile(
        bc_api, [{"use": "test.waitFlag", "with": {"flag": "never", "pollMs": 60000}, "timeout": "1s"}]
    )
    wf = await EngineClient(bc_api).start_workflow(profile_id="t-profile")
    done = await wait_workflow(bc_api, wf.id, timeout=15)
    assert done.state == "failed"
    step = done.steps[0]
    assert step.state == "failed"
    assert step.error["code"] == "TIMEOUT"
    assert step.error["details"]["path"] == "steps[0]"
    assert done.error["code"] == "TIMEOUT"


async def test_a_bc_error_fails_the_step_with_its_code_and_retry_runs_a_new_attempt(
    engine: EngineService, bc_api: ApiClient, db: asyncpg.Connection
) -> None:
    engine_api = EngineClient(bc_api)
    await create_profile(
        bc_api,
        [
            {"use": "test.noop"},
            {"use": "test.failUnlessFlag", "with": {"flag": "fixed"}},
            {"use": "test.noop"},
        ],
    )
    wf = await engine_api.start_workflow(profile_id="t-profile")
    done = await wait_workflow(bc_api, wf.id)
    assert done.state == "failed"
    assert [s.state for s in done.steps] == ["succeeded", "failed", "pending"]
    assert done.steps[1].error == {
        "code": "CONFLICT", "message": "the flag is not set", "details": {"path": "flag", "flag": "fixed"},
    }  # fmt: skip
    with pytest.raises(BcError) as e:
        await engine_api.resume_workflow(id=wf.id)
    assert (e.value.code, e.value.reason) == (ErrorCode.INVALID_STATE, "workflow-failed")
    instead = f"retry runs a failed workflow's failed step again (bcx workflows retry {wf.id})"
    assert e.value.message.endswith(instead)

    await flag(db, "fixed")
    await engine_api.retry_workflow(id=wf.id)
    done = await wait_workflow(bc_api, wf.id)
    assert done.state == "succeeded"
    assert [s.attempt for s in done.steps] == [1, 2, 1]
    assert done.steps[1].result == {"attempt": 2}


async def test_an_unexpected_exception_is_internal_without_its_text(
    engine: EngineService, bc_api: ApiClient
) -> None:
    await create_profile(bc_api, [{"use": "test.failUnlessFlag", "with": {"flag": "x", "crash": True}}])
    wf = await EngineClient(bc_api).start_workflow(profile_id="t-profile")
    done = await wait_workflow(bc_api, wf.id)
    err = done.steps[0].error
    assert err["code"] == "INTERNAL"
    assert "RuntimeError" in err["message"]
    assert b"s3cr3t" not in msgspec.json.encode(done)


async def test_abort_then_resume(engine: EngineService, bc_api: ApiClient, db: asyncpg.Connection) -> None:
    engine_api = EngineClient(bc_api)
    await create_profile(bc_api, [{"use": "test.waitFlag", "with": {"flag": "later"}}, {"use": "test.noop"}])
    wf = await engine_api.start_workflow(profile_id="t-profile")
    await wait_step_running(bc_api, wf.id, 0)
    aborted = await engine_api.abort_workflow(id=wf.id, reason="operator said so")
    assert aborted.state == "aborted"
    assert [s.state for s in aborted.steps] == ["cancelled", "pending"]
    assert aborted.error["message"] == "aborted by an operator: operator said so"
    with pytest.raises(BcError) as e:
        await engine_api.abort_workflow(id=wf.id)
    assert e.value.reason == "workflow-aborted"
    with pytest.raises(BcError) as e:
        await engine_api.retry_workflow(id=wf.id)
    assert e.value.code is ErrorCode.INVALID_STATE
    # the operator meant resume: the error says so, with the command
    assert e.value.message.endswith(f"resume carries on an aborted workflow (bcx workflows resume {wf.id})")

    await flag(db, "later")
    resumed = await engine_api.resume_workflow(id=wf.id)
    assert resumed.state == "running"
    done = await wait_workflow(bc_api, wf.id)
    assert done.state == "succeeded"
    assert [s.attempt for s in done.steps] == [2, 1]


async def test_workflow_list_filters(engine: EngineService, bc_api: ApiClient) -> None:
    engine_api = EngineClient(bc_api)
    node = await engine_api.create_node(site_id="eu1")
    a = await engine_api.start_workflow(profile_id="test-chain", node_id=node.id)
    await wait_workflow(bc_api, a.id)
    b = await engine_api.start_workflow(profile_id="test-chain")
    await wait_workflow(bc_api, b.id)
    by_node = await engine_api.list_workflows(node_id=node.id)
    assert [w.id for w in by_node.workflows] == [a.id]
    ok = await engine_api.list_workflows(state="succeeded", profile_id="test-chain")
    assert [w.id for w in ok.workflows] == [b.id, a.id]
    with pytest.raises(BcError) as e:
        await engine_api.list_workflows(state="sideways")
    assert (e.value.code, e.value.path) == (ErrorCode.INVALID_INPUT, "state")


async def test_one_running_workflow_per_node_and_unknown_nodes(
    engine: EngineService, bc_api: ApiClient, db: asyncpg.Connection
) -> None:
    engine_api = EngineClient(bc_api)
    await create_profile(bc_api, [{"use": "test.waitFlag", "with": {"flag": "free"}}])
    node = await engine_api.create_node(site_id="eu1")
    first = await engine_api.start_workflow(profile_id="t-profile", node_id=node.id)
    with pytest.raises(BcError) as e:
        await engine_api.start_workflow(profile_id="test-chain", node_id=node.id)
    assert (e.value.code, e.value.reason, e.value.details["workflowId"]) == (
        ErrorCode.CONFLICT, "node-busy", first.id,
    )  # fmt: skip
    with pytest.raises(BcError) as e:
        await engine_api.start_workflow(profile_id="test-chain", node_id="node_01M8KDF3AECW3VSXWF56ZQP5H1")
    assert (e.value.code, e.value.path) == (ErrorCode.NOT_FOUND, "nodeId")
    with pytest.raises(BcError) as e:
        await engine_api.start_workflow(profile_id="test-chain", node_id="n1")
    assert (e.value.code, e.value.path) == (ErrorCode.INVALID_INPUT, "nodeId")
    await flag(db, "free")
    await wait_workflow(bc_api, first.id)


async def test_malformed_requests_are_invalid_input_with_a_path(
    engine: EngineService, bc_api: ApiClient
) -> None:
    with pytest.raises(BcError) as e:
        await bc_api.call("engine", "workflows.start", {"profileId": 7})
    assert (e.value.code, e.value.path) == (ErrorCode.INVALID_INPUT, "profileId")
    with pytest.raises(BcError) as e:
        await bc_api.call("engine", "workflows.start", {"profileId": "x", "colour": "red"})
    # a field from a newer client is ignored (docs/compatibility.md): the request itself is served
    assert (e.value.code, e.value.path) == (ErrorCode.NOT_FOUND, "profileId")
    with pytest.raises(BcError) as e:
        await EngineClient(bc_api).get_workflow(id="wf_nope")
    # a malformed id is bad input, not a missing workflow (issue 10)
    assert (e.value.code, e.value.path) == (ErrorCode.INVALID_INPUT, "id")


async def test_a_step_starts_a_child_workflow_in_its_own_transaction(
    engine: EngineService, bc_api: ApiClient, db: asyncpg.Connection
) -> None:
    engine_api = EngineClient(bc_api)
    await create_profile(bc_api, [{"use": "test.startChild", "with": {"profileId": "test-chain"}}])
    wf = await engine_api.start_workflow(profile_id="t-profile")
    done = await wait_workflow(bc_api, wf.id)
    assert done.state == "succeeded"
    child_id = done.steps[0].result["child"]
    assert done.steps[0].result["state"] == "succeeded"
    child = await engine_api.get_workflow(id=child_id)
    assert (child.state, child.owner) == ("succeeded", "test-owner")
    # the step ran several times (not ready while the child ran) and started one child
    assert await db.fetchval("SELECT count(*) FROM public.plg_test_children") == 1


async def test_a_step_waits_for_our_own_services_until_its_deadline(
    engine: EngineService, bc_api: ApiClient
) -> None:
    # no bc-pki runs here: userdata.render's token waits for it, and at the deadline the step
    # fails TIMEOUT saying what it waited for
    engine_api = EngineClient(bc_api)
    node = await engine_api.create_node(site_id="lab1")
    doc = {"id": "render", "version": 1, "target": "metal", "role": "host",
           "userData": {"kind": "cloud-init"},
           "steps": [{"use": "userdata.render", "timeout": "3s"}]}  # fmt: skip
    await engine_api.create_profile(document=doc)
    wf = await engine_api.start_workflow(profile_id="render", node_id=node.id)
    done = await wait_workflow(bc_api, wf.id, timeout=20)
    err = done.steps[0].error
    assert (done.state, err["code"]) == ("failed", "TIMEOUT"), err
    assert err["details"]["waitingFor"]["service"] == "bc-pki"
    assert err["details"]["waitingFor"]["tries"] >= 2


async def test_a_steps_own_unavailable_error_still_fails_it_at_once(
    engine: EngineService, bc_api: ApiClient
) -> None:
    await create_profile(bc_api, [{"use": "test.raiseUnavailable"}])
    wf = await EngineClient(bc_api).start_workflow(profile_id="t-profile")
    done = await wait_workflow(bc_api, wf.id, timeout=10)
    assert done.state == "failed"
    assert done.steps[0].error["code"] == "UNAVAILABLE"
    assert done.steps[0].attempt == 1


async def test_a_transient_looking_exception_from_a_step_fails_it(
    engine: EngineService, bc_api: ApiClient
) -> None:
    # only our own clients' ServiceUnavailableError makes a step wait; a refused connection
    # to the step's own device is the step's failure, at its first attempt
    await create_profile(bc_api, [{"use": "test.raiseRefused"}])
    wf = await EngineClient(bc_api).start_workflow(profile_id="t-profile")
    done = await wait_workflow(bc_api, wf.id, timeout=10)
    assert done.state == "failed"
    step = done.steps[0]
    assert (step.error["code"], step.attempt) == ("INTERNAL", 1)
    assert "ConnectionRefusedError" in step.error["message"]


async def test_steps_returning_strings_show_them_as_strings(engine: EngineService, bc_api: ApiClient) -> None:
    values = [{"a": "{}"}, '{"a":1}', "[1, 2]", "12", "ok"]
    steps = [{"use": "test.returnValue", "with": {"value": v}} for v in values]
    await create_profile(bc_api, [*steps, {"use": "test.previous"}])
    engine_api = EngineClient(bc_api)
    wf = await engine_api.start_workflow(profile_id="t-profile")
    done = await wait_workflow(bc_api, wf.id, timeout=10)
    assert done.state == "succeeded", done
    assert [s.result for s in done.steps] == [*values, {"previous": "ok"}]
    listed = await engine_api.list_workflows(state="succeeded")
    assert wf.id in [w.id for w in listed.workflows]


async def test_a_result_that_is_json_only_once_encoded_is_stored_as_that_json(
    engine: EngineService, bc_api: ApiClient
) -> None:
    # a datetime passes the step's JSON check (msgspec writes it as an ISO string); the settle
    # stores that same text (it used to encode again with json.dumps, which refused it, and the
    # workflow stayed running, its pass failing over and over)
    await create_profile(bc_api, [{"use": "test.returnDatetime"}, {"use": "test.noop"}])
    wf = await EngineClient(bc_api).start_workflow(profile_id="t-profile")
    done = await wait_workflow(bc_api, wf.id, timeout=10)
    assert done.state == "succeeded", done
    assert done.steps[0].result == {"at": "2026-01-02T03:04:05Z"}


async def test_steps_see_their_workflows_node(engine: EngineService, bc_api: ApiClient) -> None:
    engine_api = EngineClient(bc_api)
    bmc = NodeBmc(driver="sim", address="sim-bmc-7", system_id="sys-1")
    node = await engine_api.create_node(
        site_id="eu7", labels={"rack": "r7"}, macs=["52:54:00:00:00:07"], bmc=bmc
    )
    await create_profile(bc_api, [{"use": "test.nodeSeen"}, {"use": "test.nodeSeen"}])
    wf = await engine_api.start_workflow(profile_id="t-profile", node_id=node.id)
    done = await wait_workflow(bc_api, wf.id, timeout=10)
    assert done.state == "succeeded", done
    seen = {"id": node.id, "siteId": "eu7", "tenantId": "root", "labels": {"rack": "r7"},
            "macs": ["52:54:00:00:00:07"], "bmc": bmc.to_document(), "state": "enrolled"}  # fmt: skip
    assert [s.result for s in done.steps] == [seen, seen]
    # without a node, ctx.node is None
    bare = await engine_api.start_workflow(profile_id="t-profile")
    done = await wait_workflow(bc_api, bare.id, timeout=10)
    assert [s.result for s in done.steps] == [None, None]


async def test_a_nodes_json_columns_are_shown_as_stored(
    engine: EngineService, bc_api: ApiClient, db: asyncpg.Connection
) -> None:
    # the pool's codec decodes jsonb once; a value that is a JSON string stays that string (it
    # used to be parsed again: text that looks like JSON became an object, other text INTERNAL)
    engine_api = EngineClient(bc_api)
    node = await engine_api.create_node(site_id="eu8")
    await db.execute(
        "UPDATE engine.nodes SET last_error = to_jsonb($2::text), inventory = to_jsonb($3::text)"
        " WHERE id = $1",
        node.id, "disk full", '{"cpus": {"cores": 8}}',
    )  # fmt: skip
    got = await engine_api.get_node(id=node.id)
    assert (got.last_error, got.inventory, got.inventory_summary) == (
        "disk full",
        '{"cpus": {"cores": 8}}',
        None,
    )
    listed = await engine_api.list_nodes(site_id="eu8")
    assert [n.last_error for n in listed.nodes] == ["disk full"]


async def test_a_start_sent_again_with_its_id_returns_the_workflow_it_made(
    engine: EngineService, bc_api: ApiClient, db: asyncpg.Connection
) -> None:
    """A caller whose answer never came (the engine died after its commit) asks again with the
    same id: the first start's workflow comes back, and nothing runs twice."""
    engine_api = EngineClient(bc_api)
    await create_profile(bc_api, [{"use": "test.waitFlag", "with": {"flag": "again"}}], id="t-again")
    node = await engine_api.create_node(site_id="eu1")
    wf_id = new_id("wf")
    first = await engine_api.start_workflow(profile_id="t-again", node_id=node.id, id=wf_id)
    again = await engine_api.start_workflow(profile_id="t-again", node_id=node.id, id=wf_id)
    assert (first.id, again.id, again.state) == (wf_id, wf_id, "running")
    both = await asyncio.gather(
        *(engine_api.start_workflow(profile_id="test-chain", id=same) for same in [new_id("wf")] * 2)
    )
    assert both[0].id == both[1].id  # two at once with one id: one workflow
    listed = await engine_api.list_workflows(profile_id="test-chain")
    assert [w.id for w in listed.workflows].count(both[0].id) == 1
    assert [w.id for w in (await engine_api.list_workflows(node_id=node.id)).workflows] == [wf_id]

    with pytest.raises(BcError) as e:  # the id of another start: not this one's to take
        await engine_api.start_workflow(profile_id="test-chain", node_id=node.id, id=wf_id)
    assert (e.value.code, e.value.path, e.value.reason) == (ErrorCode.CONFLICT, "id", "id-taken")
    with pytest.raises(BcError) as e:
        await engine_api.start_workflow(profile_id="t-again", id="wf_1")
    assert (e.value.code, e.value.path) == (ErrorCode.INVALID_INPUT, "id")
    await flag(db, "again")
    await wait_workflow(bc_api, wf_id)


async def test_wait_agent_joined_asks_pki_once_and_a_join_whose_event_was_lost_still_settles_it(
    engine: EngineService, bc_api: ApiClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``wait.agentJoined`` is event-driven: while the node has not joined, the step does not ask
    bc-pki again every 2 s (a thousand machines waiting were 500 requests a second); a join whose
    event never reached the engine is still found by the engine's join watch, one look in bulk."""
    import bc_engine.service as service_module

    monkeypatch.setattr(service_module, "AGENT_POLL_S", 0.5)  # the watch's period, from its next look
    engine_api = EngineClient(bc_api)
    node = await engine_api.create_node(site_id="lab1")
    joined: list[Any] = []
    asked: list[str] = []

    async def list_certificates(*, agent_id: str | None = None, **_: Any) -> list[Any]:
        asked.append(agent_id or "")
        return [c for c in joined if c.agent_id == agent_id]

    async def certificates_page(**_: Any) -> CertificateList:
        return CertificateList(certificates=list(joined))

    monkeypatch.setattr(engine.engine.pki, "list_certificates", list_certificates)
    monkeypatch.setattr(engine.engine.pki, "certificates_page", certificates_page)
    await create_profile(bc_api, [{"use": "wait.agentJoined", "with": {"fresh": False}}], id="t-joined")
    wf = await engine_api.start_workflow(profile_id="t-joined", node_id=node.id)
    await wait_step_running(bc_api, wf.id, 0)
    await until(lambda: len(asked) >= 1, timeout=10, what="the step's first look at bc-pki")
    await asyncio.sleep(3)  # what a 2 s poll would have asked again in (the absence is the point)
    assert asked == [node.id]
    now = datetime.now(UTC)
    cert = CertificateInfo(
        cert_id="cert_lost", agent_id=node.id, tenant_id="root", site_id="lab1", role="node",
        join_token_id="jt_lost", serial="1", key_type="ed25519", state="valid", not_before=now,
        not_after=now + timedelta(days=1), created_at=now, certificate_pem="-",
    )  # fmt: skip
    joined.append(cert)  # bc-pki issued it; its JoinAccepted event never came
    done = await wait_workflow(bc_api, wf.id, timeout=30)
    assert done.state == "succeeded"
    assert done.steps[0].result["certId"] == "cert_lost"


async def test_steps_see_the_nodes_inventory_as_it_is_when_they_run(
    engine: EngineService, bc_api: ApiClient, db: asyncpg.Connection
) -> None:
    """An engine keeps the inventory of the version its pass read (engine migration 0012):
    a step that set it, a later step of the same pass, an update by any statement and another
    workflow all see it as stored, and what a step does to its copy stays its own."""
    engine_api = EngineClient(bc_api)
    node = await engine_api.create_node(site_id="eu9")
    await create_profile(bc_api, [
        {"use": "test.inventorySeen"},  # none yet
        {"use": "test.setInventory", "with": {"inventory": {"cpus": 8}}},
        {"use": "test.inventorySeen"},  # the same pass: set by the step before
        {"use": "test.inventorySeen"},  # its copy changed by the step before: not seen here
    ], id="t-inv")  # fmt: skip
    wf = await engine_api.start_workflow(profile_id="t-inv", node_id=node.id)
    done = await wait_workflow(bc_api, wf.id, timeout=10)
    assert done.state == "succeeded", done
    assert [s.result for s in done.steps] == [
        {"inventory": None}, {}, {"inventory": {"cpus": 8}}, {"inventory": {"cpus": 8}}
    ]  # fmt: skip
    await create_profile(bc_api, [{"use": "test.inventorySeen"}], id="t-inv-seen")
    for stored in ({"cpus": 16}, {"cpus": 16, "gpus": 2}, None):  # by another statement than a step's
        await db.execute("UPDATE engine.nodes SET inventory = $2::jsonb WHERE id = $1", node.id,
                         None if stored is None else msgspec.json.encode(stored).decode())  # fmt: skip
        wf = await engine_api.start_workflow(profile_id="t-inv-seen", node_id=node.id)
        done = await wait_workflow(bc_api, wf.id, timeout=10)
        assert [s.result for s in done.steps] == [{"inventory": stored}]
    versions = await db.fetch(
        "SELECT inventory_version FROM engine.nodes WHERE id = $1 OR site_id = 'eu9'", node.id
    )
    assert len({r["inventory_version"] for r in versions}) == len(versions)
