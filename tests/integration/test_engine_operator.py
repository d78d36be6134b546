"""The operator's engine routes: the registered steps and driver operations, node update, label
and delete (issue 10 item 10)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest
import pytest_asyncio

from bc_engine.service import EngineService
from better_compute.clients import EngineClient
from better_compute.config import Settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.service import ApiClient
from better_compute.wire.engine import NodeDeleted
from engine_test_app import create_tables


@pytest_asyncio.fixture(loop_scope="session")
async def engine(bc_settings: Settings) -> AsyncIterator[EngineService]:
    await create_tables(bc_settings.database_url)  # test.waitFlag's own tables
    svc = EngineService(msgspec.structs.replace(bc_settings, app="engine_test_app:app"))
    async with svc:
        run = asyncio.create_task(svc.run())
        yield svc
        svc.request_stop()
        await asyncio.wait_for(run, 10)


async def test_steps_list_shows_steps_and_driver_operations_with_their_inputs(
    engine: EngineService, bc_api: ApiClient
) -> None:
    got = await EngineClient(bc_api).list_steps()
    steps = {s.id: s for s in got.steps}
    assert steps["test.waitFlag"].runs_on == "control-plane"
    assert {"flag", "pollMs"} <= set(steps["test.waitFlag"].input["properties"])
    assert steps["userdata.render"].runs_on == "control-plane"
    ops = {o.name: o for o in got.driver_operations}
    assert set(ops["power.setPower"].input["properties"]["action"]["enum"]) >= {"on", "off", "cycle"}
    assert "media.eject" in ops
    # a plugin's driver operation (tests/support/engine_test_app.py), and it validates like metal's
    assert set(ops["bios.flash"].input["properties"]) == {"image", "slot"}
    doc = {"id": "bios", "version": 1, "target": "metal", "role": "host", "steps": [
        {"use": "bios.flash", "on": "site", "with": {"image": "http://x/b.bin"}},
        {"use": "bios.flash", "on": "site", "with": {"slot": 2}},
        {"use": "bios.flsh", "on": "site", "with": {"image": "i"}},
    ]}  # fmt: skip
    checked = await EngineClient(bc_api).validate_profile(document=doc)
    assert [p.path for p in checked.problems] == [
        "document.steps[1].with.image",
        "document.steps[1].with.slot",
        "document.steps[2].use",
    ]  # a document sent in the request is named `document` (one path style, docs/engine.md)
    assert "did you mean bios.flash" in checked.problems[2].message


async def test_plugins_list_shows_what_the_engine_runs(engine: EngineService, bc_api: ApiClient) -> None:
    got = {p.id: p for p in (await EngineClient(bc_api).list_plugins()).plugins}
    bios = got["test-bios"]  # listed in the app (tests/support/engine_test_app.py), not installed
    assert (bios.source, bios.entry_point, bios.lent) == ("app", None, False)
    assert bios.driver_operations == ["bios.flash"]
    steps = {s.id: s.plugin for s in (await EngineClient(bc_api).list_steps()).steps}
    assert steps["metal.ensureRamdisk"] == "metal"  # lent by metal
    assert steps["test.waitFlag"] is None  # provision's own


async def test_nodes_update_label_and_delete(engine: EngineService, bc_api: ApiClient) -> None:
    engine_api = EngineClient(bc_api)
    node = await engine_api.create_node(site_id="lab1", labels={"rack": "4"})
    nid = node.id
    got = await engine_api.update_node(id=nid, site_id="lab2", labels={"row": "b"})
    assert (got.site_id, got.labels) == ("lab2", {"row": "b"})
    got = await engine_api.label_node(id=nid, set={"gpu": "h100"}, remove=["row"])
    assert got.labels == {"gpu": "h100"}
    assert (await engine_api.get_node(id=nid)).labels == {"gpu": "h100"}
    # the bounds of create
    for request, path in (
        ({"id": nid, "siteId": "lab 1!"}, "siteId"),
        ({"id": nid, "labels": {"bad key!": "x"}}, "labels"),
        ({"id": nid, "labels": {f"k{i}": "v" for i in range(65)}}, "labels"),
    ):
        with pytest.raises(BcError) as e:
            await bc_api.call("engine", "nodes.update", request)
        assert (e.value.code, e.value.path) == (ErrorCode.INVALID_INPUT, path)
    with pytest.raises(BcError) as e:
        await engine_api.label_node(id=nid, set={f"k{i}": "v" for i in range(64)})
    assert (e.value.code, e.value.path) == (ErrorCode.INVALID_INPUT, "labels")
    with pytest.raises(BcError) as e:
        await engine_api.update_node(id="node_01ARZ3NDEKTSV4RRFFQ69G5FAV", site_id="x")
    assert e.value.code is ErrorCode.NOT_FOUND
    for route in ("nodes.update", "nodes.label", "nodes.delete"):
        with pytest.raises(BcError) as e:
            await bc_api.call("engine", route, {"id": "node_\u0000 x"})
        assert (e.value.code, e.value.path) == (ErrorCode.INVALID_INPUT, "id")

    # a node with a running workflow is not deleted; with only finished ones it is
    hold = [{"use": "test.waitFlag", "with": {"flag": "never", "pollMs": 60000}}]
    await engine_api.create_profile(
        document={"id": "hold", "version": 1, "target": "metal", "role": "host", "steps": hold}
    )
    wf = await engine_api.start_workflow(profile_id="hold", node_id=nid)
    with pytest.raises(BcError) as e:
        await engine_api.delete_node(id=nid)
    assert (e.value.code, e.value.details.get("reason")) == (ErrorCode.INVALID_STATE, "node-busy")
    with pytest.raises(BcError) as e:
        await engine_api.update_node(id=nid, site_id="lab3")
    assert (e.value.code, e.value.details.get("reason")) == (ErrorCode.INVALID_STATE, "node-busy")
    await engine_api.abort_workflow(id=wf.id)
    assert await engine_api.delete_node(id=nid) == NodeDeleted(deleted=nid)
    with pytest.raises(BcError) as e:
        await engine_api.get_node(id=nid)
    assert e.value.code is ErrorCode.NOT_FOUND
    # the finished workflow is kept
    assert (await engine_api.get_workflow(id=wf.id)).state == "aborted"


async def test_a_name_is_unique_in_its_site_even_asked_for_twice_at_once(
    engine: EngineService, bc_api: ApiClient
) -> None:
    """Issue 26: two creates and an enrolment asking for one name at the same moment: one gets
    it, the others CONFLICT at name (the unique index, when both passed the first look)."""
    engine_api = EngineClient(bc_api)
    asks = [
        engine_api.create_node(site_id="lab1", name="race-1"),
        engine_api.create_node(site_id="lab1", name="race-1"),
        engine_api.enroll_node(site_id="lab1", name="race-1"),
    ]
    got = await asyncio.gather(*asks, return_exceptions=True)
    made = [g for g in got if not isinstance(g, BaseException)]
    refused = [g for g in got if isinstance(g, BcError)]
    assert len(made) == 1, got
    assert [(e.code, e.path, e.details["reason"]) for e in refused] == [
        (ErrorCode.CONFLICT, "name", "name-taken")
    ] * 2
    # another site may use it; a node listed by name is the one of that name
    other = await engine_api.create_node(site_id="lab2", name="race-1")
    named = await engine_api.list_nodes(name="race-1")
    assert sorted(n.id for n in named.nodes) == sorted([made[0].id, other.id])
    assert [n.id for n in (await engine_api.list_nodes(name="race-1", site_id="lab2")).nodes] == [other.id]
    # renamed, then cleared: the name is free again
    assert (await engine_api.update_node(id=other.id, name="race-2")).name == "race-2"
    assert (await engine_api.update_node(id=other.id, clear_name=True)).name is None
    with pytest.raises(BcError) as e:
        await bc_api.call("engine", "nodes.update", {"id": other.id, "name": "x", "clearName": True})
    assert (e.value.code, e.value.path) == (ErrorCode.INVALID_INPUT, "clearName")
