"""Profiles through the engine API: lookup order, immutability, validate and render."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from bc_engine.service import EngineService
from better_compute.clients import EngineClient
from better_compute.config import Settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.service import ApiClient
from better_compute.testing.workflows import wait_workflow
from better_compute.wire.engine import ProfileView, WorkflowProfile


@pytest_asyncio.fixture(loop_scope="session")
async def engine(bc_settings: Settings) -> AsyncIterator[EngineService]:
    svc = EngineService(msgspec.structs.replace(bc_settings, app="engine_test_app:app"))
    async with svc:
        run = asyncio.create_task(svc.run())
        yield svc
        svc.request_stop()
        await asyncio.wait_for(run, 10)


def doc(pid: str, version: int, steps: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"id": pid, "version": version, "target": "metal", "role": "host", "steps": steps, **extra}


async def create(api: ApiClient, tenant: str, document: dict[str, Any], **kw: Any) -> ProfileView:
    return await EngineClient(api).create_profile(tenant_id=tenant, document=document, **kw)


async def get(api: ApiClient, tenant: str, pid: str, version: int | None = None) -> ProfileView:
    return await EngineClient(api).get_profile(tenant_id=tenant, id=pid, version=version)


async def test_lookup_prefers_own_then_public_then_shipped(engine: EngineService, bc_api: ApiClient) -> None:
    engine_api = EngineClient(bc_api)
    one = [{"use": "test.noop"}]
    two = [{"use": "test.noop"}, {"use": "test.noop"}]
    # shipped only
    got = await get(bc_api, "acme", "test-chain")
    assert (got.tenant_id, got.shipped, got.immutable) == ("builtin", True, True)
    # a public stored one beats the shipped one for every tenant
    await create(bc_api, "globex", doc("test-chain", 1, one), public=True)
    assert (await get(bc_api, "acme", "test-chain")).tenant_id == "globex"
    # the tenant's own beats both
    await create(bc_api, "acme", doc("test-chain", 1, two))
    got = await get(bc_api, "acme", "test-chain")
    assert (got.tenant_id, len(got.document["steps"])) == ("acme", 2)
    assert (await get(bc_api, "initech", "test-chain")).tenant_id == "globex"
    # a private profile of another tenant is invisible
    await create(bc_api, "globex", doc("private-one", 1, one))
    with pytest.raises(BcError) as e:
        await get(bc_api, "acme", "private-one")
    assert (e.value.code, e.value.path) == (ErrorCode.NOT_FOUND, "profileId")
    # no version: the latest of the first place that has the id
    await create(bc_api, "acme", doc("mine", 1, one))
    await create(bc_api, "acme", doc("mine", 3, two))
    assert (await get(bc_api, "acme", "mine")).version == 3
    assert (await get(bc_api, "acme", "mine", 1)).version == 1
    listed = await engine_api.list_profiles(tenant_id="acme")
    rows = {(p.tenant_id, p.id, p.version) for p in listed.profiles}
    assert {("acme", "mine", 1), ("acme", "mine", 3), ("globex", "test-chain", 1),
            ("builtin", "test-chain", 1)} <= rows  # fmt: skip
    assert ("globex", "private-one", 1) not in rows
    # a workflow started by a tenant runs the profile its lookup found
    wf = await engine_api.start_workflow(tenant_id="acme", profile_id="test-chain")
    assert wf.profile == WorkflowProfile(tenant_id="acme", id="test-chain", version=1)
    assert len(wf.steps) == 2


async def test_a_used_version_is_immutable(engine: EngineService, bc_api: ApiClient) -> None:
    engine_api = EngineClient(bc_api)
    await create(bc_api, "acme", doc("p", 1, [{"use": "test.noop"}]))
    # before any workflow used it, a version may be replaced (but not silently)
    with pytest.raises(BcError) as e:
        await create(bc_api, "acme", doc("p", 1, [{"use": "test.noop"}] * 2))
    assert (e.value.code, e.value.path) == (ErrorCode.CONFLICT, "document.version")
    await create(bc_api, "acme", doc("p", 1, [{"use": "test.noop"}] * 2), replace=True)
    wf = await engine_api.start_workflow(tenant_id="acme", profile_id="p")
    await wait_workflow(bc_api, wf.id)
    got = await get(bc_api, "acme", "p", 1)
    assert got.immutable is True
    assert got.first_used_at is not None
    with pytest.raises(BcError) as e:
        await create(bc_api, "acme", doc("p", 1, [{"use": "test.noop"}]), replace=True)
    assert (e.value.code, e.value.reason) == (ErrorCode.INVALID_STATE, "profile-in-use")
    # later starts of the pinned version (parsed once, started without a transaction of their
    # own) run what was pinned
    again = await wait_workflow(
        bc_api, (await engine_api.start_workflow(tenant_id="acme", profile_id="p")).id
    )
    assert (again.state, len(again.steps), again.profile.version) == ("succeeded", 2, 1)
    with pytest.raises(BcError) as e:
        await engine_api.delete_profile(tenant_id="acme", id="p", version=1)
    assert (e.value.code, e.value.reason) == (ErrorCode.INVALID_STATE, "profile-in-use")
    # the next version is free to change, and an unused version can be deleted
    await create(bc_api, "acme", doc("p", 2, [{"use": "test.noop"}]))
    assert await engine_api.delete_profile(tenant_id="acme", id="p", version=2)
    with pytest.raises(BcError) as e:
        await get(bc_api, "acme", "p", 2)
    assert e.value.code is ErrorCode.NOT_FOUND
    # shipped profiles are read-only
    with pytest.raises(BcError) as e:
        await create(bc_api, "builtin", doc("test-chain", 9, [{"use": "test.noop"}]))
    assert (e.value.code, e.value.path) == (ErrorCode.PERMISSION_DENIED, "tenantId")


async def test_validate_reports_every_problem_with_its_path(engine: EngineService, bc_api: ApiClient) -> None:
    engine_api = EngineClient(bc_api)
    document = doc(
        "bad",
        1,
        [
            {"use": "test.noop"},
            {"use": "acme.unknown"},
            {"use": "test.waitFlag", "with": {"flag": "x", "pollMs": "soon"}},
            {"use": "test.noop", "on": "site"},
            {"use": "acme.nothing", "fallback": {"use": "acme.neither"}},
            {"use": "test.waitFlag", "with": {"flag": "x", "colour": "red"}},
        ],
    )
    got = await engine_api.validate_profile(document=document)
    assert got.valid is False
    # one path style: a document sent in the request is named from the request (document.…)
    expected = [
        ("document.steps[1].use", "INVALID_INPUT"),
        ("document.steps[2].with.pollMs", "INVALID_INPUT"),
        ("document.steps[3].on", "INVALID_INPUT"),
        ("document.steps[4].use", "INVALID_INPUT"),
        ("document.steps[5].with.colour", "INVALID_INPUT"),
    ]
    assert [(p.path, p.code) for p in got.problems] == expected
    # shape errors: every one in one pass, with the names an unknown key may have meant
    shapes = {**doc("bad", 1, [{"use": "test.noop", "wiht": {}}, {"use": "test.noop", "on": "moon"}]),
              "descripton": "typo"}  # fmt: skip
    shape = await engine_api.validate_profile(document=shapes)
    assert shape.valid is False
    assert [(p.path, p.message) for p in shape.problems] == [
        ("document.descripton", "unknown field; did you mean description?"),
        ("document.steps[0].wiht", "unknown field; did you mean with?"),
        ("document.steps[1].on", "on must be one of control-plane, site, node, got 'moon'"),
    ]
    with pytest.raises(BcError) as e:
        await engine_api.create_profile(document=shapes)
    assert (e.value.code, e.value.path) == (ErrorCode.INVALID_CONFIG, "document.descripton")
    assert [p["path"] for p in e.value.details["problems"]] == [p.path for p in shape.problems]
    with pytest.raises(BcError) as e:
        await engine_api.create_profile(document=document)
    assert (e.value.code, e.value.path) == (ErrorCode.INVALID_INPUT, "document.steps[1].use")
    assert [(p["path"], p["code"]) for p in e.value.details["problems"]] == expected
    with pytest.raises(BcError) as e:
        await engine_api.render_profile(document=document)
    assert (e.value.code, e.value.path) == (ErrorCode.INVALID_INPUT, "document.steps[1].use")
    assert [(p["path"], p["code"]) for p in e.value.details["problems"]] == expected
    ok = await engine_api.validate_profile(id="test-chain")
    assert (ok.valid, ok.problems) == (True, [])


async def test_render_expands_registered_steps_driver_operations_and_fallbacks(
    engine: EngineService, bc_api: ApiClient
) -> None:
    engine_api = EngineClient(bc_api)
    document = doc(
        "r",
        1,
        [
            {"use": "test.waitFlag", "with": {"flag": "f"}},
            # a driver operation (power.setPower is metal's relaying step, not a driver operation)
            {"use": "netboot.clearEntry", "on": "site", "with": {"mac": "52:54:00:00:00:01"}},
            {"use": "acme.missing", "fallback": {"use": "test.noop"}},
        ],
    )
    got = await engine_api.render_profile(document=document)
    steps = got.steps
    assert steps[0].input == {"flag": "f", "pollMs": 200}
    assert (steps[0].mode, steps[0].via, steps[0].timeout_ms) == ("control-plane", "step", 3_600_000)
    assert (steps[1].mode, steps[1].command, steps[1].runs_on) == ("driver", "driver.invoke", "site")
    assert steps[1].input == {"operation": "netboot.clearEntry", "input": {"mac": "52:54:00:00:00:01"}}
    assert (steps[2].action, steps[2].via) == ("test.noop", "fallback-step")
    assert got.command_kinds == ["driver.invoke"]
    # a workflow without a node cannot hold agent steps
    await create(bc_api, "root", document)
    with pytest.raises(BcError) as e:
        await engine_api.start_workflow(profile_id="r")
    assert (e.value.code, e.value.path) == (ErrorCode.INVALID_INPUT, "steps[1].on")


async def test_the_512_step_cap(engine: EngineService, bc_api: ApiClient) -> None:
    with pytest.raises(BcError) as e:
        await create(bc_api, "root", doc("big", 1, [{"use": "test.noop"}] * 513))
    assert (e.value.code, e.value.path) == (ErrorCode.INVALID_CONFIG, "document.steps")
    await create(bc_api, "root", doc("big", 1, [{"use": "test.noop"}] * 512))
    wf = await EngineClient(bc_api).start_workflow(profile_id="big")
    done = await wait_workflow(bc_api, wf.id, timeout=60)
    assert done.state == "succeeded"
    assert len(done.steps) == 512


async def test_every_problem_of_one_steps_with_is_reported_with_its_path(
    engine: EngineService, bc_api: ApiClient
) -> None:
    """Issue 10 item 7, the gap left: validation went on past a step, but stopped at the first
    bad field of one step's ``with``."""
    bmc = {"driver": "redfsh", "adress": "10.0.0.9", "insecure": "yes"}
    document = doc(
        "with-problems",
        1,
        [
            {"use": "test.waitFlag", "with": {"flag": 5, "pollMs": "soon", "polMs": 3}},
            {"use": "power.setPower", "on": "site", "with": {"action": "explode", "bmc": bmc}},
        ],
    )
    got = await EngineClient(bc_api).validate_profile(document=document)
    assert got.valid is False
    assert [p.path for p in got.problems] == [
        "document.steps[0].with.polMs",
        "document.steps[0].with.flag",
        "document.steps[0].with.pollMs",
        "document.steps[1].with.action",
        "document.steps[1].with.bmc.adress",
        "document.steps[1].with.bmc.driver",
        "document.steps[1].with.bmc.address",
        "document.steps[1].with.bmc.insecure",
    ]
    messages = {p.path: p.message for p in got.problems}
    assert "did you mean pollMs" in messages["document.steps[0].with.polMs"]
    assert "did you mean address" in messages["document.steps[1].with.bmc.adress"]
    assert "did you mean redfish" in messages["document.steps[1].with.bmc.driver"]
    with pytest.raises(BcError) as e:
        await create(bc_api, "acme", document)
    assert (e.value.code, e.value.path) == (ErrorCode.INVALID_INPUT, "document.steps[0].with.polMs")
    assert len(e.value.details["problems"]) == 8


async def test_driver_operations_are_a_registry_validated_like_steps(
    engine: EngineService, bc_api: ApiClient
) -> None:
    """Issue 10 item 7: a misspelt operation, a driver step without `with` and a bad `with`
    are all reported in one pass, with did-you-mean; `profiles.create` refuses the profile."""
    document = doc(
        "drivers",
        1,
        [
            {"use": "power.setPowr", "on": "site", "with": {"action": "cycle"}},
            {"use": "power.setPower", "on": "site"},
            {"use": "power.setPower", "on": "site", "with": {"action": "explode"}},
            {"use": "test.nop"},
            {"use": "media.eject", "on": "site"},
        ],
    )
    got = await EngineClient(bc_api).validate_profile(document=document)
    assert got.valid is False
    assert [p.path for p in got.problems] == [
        "document.steps[0].use",
        "document.steps[1].with.action",
        "document.steps[2].with.action",
        "document.steps[3].use",
    ]
    assert "did you mean power.setPower" in got.problems[0].message
    assert "did you mean test.noop" in got.problems[3].message
    with pytest.raises(BcError) as e:
        await create(bc_api, "acme", document)
    assert (e.value.code, e.value.path) == (ErrorCode.INVALID_INPUT, "document.steps[0].use")
    assert len(e.value.details["problems"]) == 4
    with pytest.raises(BcError) as e:
        await get(bc_api, "acme", "drivers")
    assert e.value.code is ErrorCode.NOT_FOUND


async def test_user_data_and_config_units_are_checked_with_the_steps_in_one_pass(
    engine: EngineService, bc_api: ApiClient
) -> None:
    """Issue 26: a profile naming a template or a config unit nobody registered, or a unit's bad
    settings, is refused when it is validated or stored, with every other problem, not when a
    deploy reaches the machine. Seen failing first (valid: True)."""
    document = doc(
        "doc-problems",
        1,
        [{"use": "test.nop"}],
        userData={"kind": "cloud-init", "template": "plain.tx"},
        hostConfig={"units": [{"name": "sysctll", "settings": {}},
                              {"name": "sysctl", "settings": {"values": "x", "colour": 1}}]},
    )  # fmt: skip
    got = await EngineClient(bc_api).validate_profile(document=document)
    assert got.valid is False
    problems = [(p.path, p.message) for p in got.problems]
    assert problems[0][0] == "document.steps[0].use"
    assert problems[1:] == [
        ("document.userData.template", "no user-data template named plain.tx; did you mean plain.txt?"),
        ("document.hostConfig.units[0].name", "unknown config unit 'sysctll'; did you mean sysctl?"),
        ("document.hostConfig.units[1].settings.colour", "unknown field"),
        ("document.hostConfig.units[1].settings.values", problems[4][1]),
    ]
    with pytest.raises(BcError) as e:
        await create(bc_api, "acme", document)
    assert len(e.value.details["problems"]) == 5
    units = {"units": [{"name": "sysctl", "settings": {"values": {"vm.swappiness": "10"}}}]}
    ok = doc("doc-fine", 1, [{"use": "test.noop"}], userData={"kind": "ignition"}, hostConfig=units)
    assert (await EngineClient(bc_api).validate_profile(document=ok)).valid
