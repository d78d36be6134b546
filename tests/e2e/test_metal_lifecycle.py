"""The machine lifecycle end to end: engine, command-queue and PKI as processes, a simulated site
agent answering, the verbs mapped onto test profiles (``metal_test_app``)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import pytest_asyncio
from nats.aio.msg import Msg

from better_compute.clients import CommandQueueClient, EngineClient, PkiClient
from better_compute.config import Settings
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, refused, until
from better_compute.testing.agents import SimAgent, start_sim_agent
from better_compute.testing.images import register_sim_image
from better_compute.wire import Subjects
from engine_test_app import create_tables

FAST = {"BC_CMDQ_HEARTBEAT": "200ms", "BC_CMDQ_SILENT_AFTER": "1500ms", "BC_CMDQ_SWEEP": "100ms"}
REF = "sec_01JB0000000000000000000000"  # the BMC's credential, by reference only
BMC = {
    "driver": "redfish",
    "address": "https://10.1.2.3",
    "credentialsRef": REF,
    "systemId": "/redfish/v1/Systems/1",
}
STORED = {**BMC, "insecure": False}  # as the node record keeps it
SYSCTL = {"name": "sysctl", "settings": {"values": {"vm.swappiness": "10"}}}


class Metal:
    def __init__(self, api: ApiClient, settings: Settings) -> None:
        self.api = api
        self.settings = settings
        self.cq = CommandQueueClient(api)

    async def enroll(self, **extra: Any) -> dict[str, Any]:
        got: dict[str, Any] = await self.api.call("engine", "metal.enroll", {"siteId": "lab1", **extra})
        return got

    async def verb(self, verb: str, node: str, **extra: Any) -> dict[str, Any]:
        got: dict[str, Any] = await self.api.call("engine", f"metal.{verb}", {"nodeId": node, **extra})
        return got

    async def node(self, node: str) -> dict[str, Any]:
        got: dict[str, Any] = await self.api.call("engine", "nodes.get", {"id": node})
        return got

    async def reaches(self, node: str, state: str) -> dict[str, Any]:
        async def check() -> dict[str, Any] | None:
            doc = await self.node(node)
            assert doc["state"] != "failed" or state == "failed", doc["stateReason"]
            return doc if doc["state"] == state else None

        return await until(check, what=f"node {node} {state}")

    async def flag(self, name: str) -> None:
        conn = await asyncpg.connect(self.settings.database_url)
        try:
            await conn.execute("INSERT INTO plg_test_flags (name) VALUES ($1) ON CONFLICT DO NOTHING", name)
        finally:
            await conn.close()


@pytest_asyncio.fixture(loop_scope="session")
async def metal(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> AsyncIterator[tuple[Metal, SimAgent]]:
    settings = msgspec.structs.replace(bc_settings, app="metal_test_app:app")
    bc_processes.settings = settings
    bc_processes.extra_env.update(FAST)
    for name in ("bc-pki", "bc-command-queue", "bc-engine"):
        bc_processes.start(name)
    await bc_processes.wait_ready()
    await create_tables(settings.database_url)
    await register_sim_image(EngineClient(bc_api))  # the image the deploys name
    m = Metal(bc_api, settings)
    sim, _agent = await start_sim_agent(
        settings, tmp_path / "agent", site_id="lab1", pki=PkiClient(bc_api), cq=m.cq
    )
    try:
        yield m, sim
    finally:
        sim.close()


async def test_every_transition_with_agents_answering(metal: tuple[Metal, SimAgent]) -> None:
    m, sim = metal
    events: list[dict[str, Any]] = []

    async def heard(msg: Msg) -> None:
        events.append(json.loads(msg.data))

    node = await m.enroll(macs=["52:54:00:AA:BB:01"], bmc=BMC, labels={"rack": "r12"})
    sub = await m.api.nc.subscribe(Subjects(m.settings.subject_root).event("node", node["id"]), cb=heard)
    assert (node["state"], node["macs"], node["bmc"]) == ("enrolled", ["52:54:00:aa:bb:01"], STORED)

    started = await m.verb("inspect", node["id"])
    assert (started["state"], started["profile"]["id"]) == ("inspecting", "t.inspect")
    await m.reaches(node["id"], "inspected")
    # the power step's input had no bmc: the engine relayed the node's, credential by reference
    [power] = (await m.cq.list_commands(workflow_id=started["workflowId"], kind="power.setPower")).commands
    full = await m.cq.get(id=power.id)
    payload = full.payload if isinstance(full.payload, dict) else json.loads(full.payload)
    assert payload["bmc"] == STORED
    assert (await m.node(node["id"]))["powerState"] == "on"

    await m.verb("commission", node["id"])
    await m.reaches(node["id"], "ready")

    deploy = await m.verb("deploy", node["id"], image="ubuntu@24.04")
    assert deploy["state"] == "deploying"
    deployed = await m.reaches(node["id"], "deployed")
    # the profile's hostConfig became the host section (hugepages' when: gpu=true is false here)
    assert deployed["hostSection"] == {"units": [SYSCTL]}
    assert (deployed["generation"], deployed["image"]) == (2, "ubuntu@24.04")
    assert deployed["currentWorkflow"] is None

    await m.verb("release", node["id"])
    released = await m.reaches(node["id"], "ready")
    assert released["image"] is None

    await m.verb("adopt", node["id"])
    await m.reaches(node["id"], "deployed")
    await m.verb("release", node["id"])
    await m.reaches(node["id"], "ready")
    await m.verb("retire", node["id"])
    retired = await m.reaches(node["id"], "retired")
    assert retired["powerState"] == "off"

    # every change was an event on bc.events.node.<id>, in order
    await until(lambda: [e["state"] for e in events][-1:] == ["retired"])
    states = [e["state"] for e in events]
    for a, b in [("inspecting", "inspected"), ("deploying", "deployed"), ("retiring", "retired")]:
        assert states.index(a) < states.index(b), states
    await sub.unsubscribe()
    assert sim.executions()  # the simulated agent ran the BMC commands


async def test_wrong_state_verbs_are_refused_with_their_reason(metal: tuple[Metal, SimAgent]) -> None:
    m, _sim = metal
    node = (await m.enroll(bmc=BMC))["id"]
    for verb in ("commission", "deploy", "release"):
        err = await refused(m.verb(verb, node, image="ubuntu@24.04"))
        assert err.code.value == "INVALID_STATE", err
        assert err.message.startswith(f"node {node} is enrolled; {verb} needs "), err.message
        assert err.details["reason"] == "wrong-state"

    # a verb while another runs: the node is deploying
    await m.verb("inspect", node)
    await m.reaches(node, "inspected")
    await m.verb("commission", node)
    await m.reaches(node, "ready")
    await m.verb("deploy", node, profile="t.hold")
    await m.reaches(node, "deploying")
    err = await refused(m.verb("release", node))
    assert (err.code.value, err.message) == (
        "INVALID_STATE",
        f"node {node} is deploying; release needs deployed or failed",
    )
    for verb in ("inspect", "commission", "deploy", "retire", "adopt"):
        assert (await refused(m.verb(verb, node, image="ubuntu@24.04"))).code.value == "INVALID_STATE"
    await m.flag("hold")
    await m.reaches(node, "deployed")

    # a deploy needs an image: the verb's, or one the profile names
    other = (await m.enroll())["id"]
    await m.verb("adopt", other)
    await m.reaches(other, "deployed")
    err = await refused(m.verb("retire", other))
    assert err.message == f"node {other} is deployed; retire needs enrolled or inspected or ready or failed"

    # an unknown node, a malformed id, an inline password
    assert (await refused(m.verb("inspect", "node_01JB0000000000000000000000"))).code.value == "NOT_FOUND"
    assert (await refused(m.verb("inspect", "nope"))).details["path"] == "nodeId"
    err = await refused(m.enroll(bmc={**BMC, "password": "hunter2"}))
    assert (err.code.value, err.details["path"]) == ("INVALID_INPUT", "bmc.password")
    assert "hunter2" not in err.message


async def test_a_failed_workflow_fails_the_node_naming_the_step(metal: tuple[Metal, SimAgent]) -> None:
    m, _sim = metal
    node = (await m.enroll(bmc=BMC))["id"]
    started = await m.verb("inspect", node, profile="t.failing")
    failed = await m.reaches(node, "failed")
    reason = failed["stateReason"]
    assert reason["workflowId"] == started["workflowId"]
    assert (reason["verb"], reason["step"], reason["stepIndex"], reason["code"]) == (
        "inspect",
        "test.failUnlessFlag",
        1,
        "CONFLICT",
    )
    assert failed["lastError"] == reason
    # the workflow retried after the cause is fixed moves the node on after all
    await m.flag("go")
    retried = await m.api.call("engine", "workflows.retry", {"id": started["workflowId"]})
    assert retried["state"] == "running"
    assert (await m.node(node))["state"] in ("inspecting", "inspected")  # out of failed at once
    inspected = await m.reaches(node, "inspected")
    assert inspected["stateReason"] is None

    # an abort fails the node too, naming the step it cancelled
    await m.verb("commission", node)
    await m.reaches(node, "ready")
    held = await m.verb("deploy", node, profile="t.hold", image="ubuntu@24.04")
    assert (await m.reaches(node, "deploying"))["image"] == "ubuntu@24.04"
    await m.api.call("engine", "workflows.abort", {"id": held["workflowId"], "reason": "changed my mind"})
    aborted = (await m.reaches(node, "failed"))["stateReason"]
    assert (aborted["workflowState"], aborted["step"], aborted["message"]) == (
        "aborted",
        "test.waitFlag",
        "aborted by an operator: changed my mind",
    )
    # what the aborted deploy left (issue 26): no image it did not finish installing, and a word on it
    left = await m.node(node)
    assert left["image"] is None
    assert aborted["left"] == (
        "deploy aborted at test.waitFlag: the disk may hold part of an image; run deploy again or release"
    )
    why = await m.api.call("engine", "workflows.why", {"id": node})
    assert aborted["left"] in why["answer"]
    # resumed, the deploy names its image again, and its success leaves it on the node
    await m.api.call("engine", "workflows.resume", {"id": held["workflowId"]})
    assert (await m.node(node))["image"] == "ubuntu@24.04"
    await m.flag("hold")
    assert (await m.reaches(node, "deployed"))["image"] == "ubuntu@24.04"


async def test_a_bmc_step_on_a_node_without_a_bmc_fails_it(metal: tuple[Metal, SimAgent]) -> None:
    m, _sim = metal
    node = (await m.enroll())["id"]
    await m.verb("inspect", node)
    reason = (await m.reaches(node, "failed"))["stateReason"]
    assert (reason["step"], reason["code"]) == ("test.power", "INVALID_STATE")
    assert reason["message"].startswith(f"node {node} has no BMC")


async def _run_profile(m: Metal, node: str, document: dict[str, Any]) -> dict[str, Any]:
    """Store ``document`` and run it on ``node`` with workflows.start (no lifecycle verb)."""
    await m.api.call("engine", "profiles.create", {"document": document})
    started = await m.api.call("engine", "workflows.start", {"profileId": document["id"], "nodeId": node})

    async def done() -> dict[str, Any] | None:
        wf: dict[str, Any] = await m.api.call("engine", "workflows.get", {"id": started["id"]})
        return wf if wf["state"] != "running" else None

    wf = await until(done, what=f"workflow {started['id']} ended")
    assert wf["state"] == "succeeded", wf
    return wf


async def test_a_new_nodes_generation_is_observed(metal: tuple[Metal, SimAgent]) -> None:
    """Regression: a node started at generation 1 observed 0 and nothing ever observed it (there
    is no host section to apply), so the page's wait for observedGeneration >= generation never
    ended."""
    m, _ = metal
    node = await m.enroll()
    assert (node["generation"], node["observedGeneration"], node.get("hostSection")) == (1, 1, None)
    created = await m.api.call("engine", "nodes.create", {"siteId": "lab1"})
    assert (created["generation"], created["observedGeneration"]) == (1, 1)


async def test_the_host_config_of_any_succeeded_workflow_becomes_the_host_section(
    metal: tuple[Metal, SimAgent],
) -> None:
    """Regression: only workflows started by a metal verb gave the node their hostConfig."""
    m, _ = metal
    node = (await m.enroll(labels={"rack": "r1"}))["id"]
    doc = {"id": "t.host-only", "version": 1, "target": "metal", "role": "host",
           "steps": [{"use": "test.noop"}], "hostConfig": {"units": [SYSCTL]}}  # fmt: skip
    await _run_profile(m, node, doc)

    async def applied() -> dict[str, Any] | None:
        got = await m.node(node)
        return got if got["generation"] == 2 else None

    got = await until(applied, timeout=30, what="the workflow's host section on the node")
    assert got["hostSection"] == {"units": [SYSCTL]}
    assert got["state"] == "enrolled"  # not a lifecycle verb: the state is not the workflow's
    # and it went to the node's bcd: a node.converge of that generation
    sent = await until(lambda: _converges(m, node), timeout=30, what="node.converge of generation 2")
    assert sent[0].payload == {"generation": 2, "units": [SYSCTL]}


async def _converges(m: Metal, node: str) -> list[Any] | None:
    listed = (await m.cq.list_commands(node_id=node, kind="node.converge")).commands
    return [await m.cq.get(id=c.id) for c in listed] or None


async def test_power_is_the_last_state_a_bmc_command_left(metal: tuple[Metal, SimAgent]) -> None:
    """Regression: a power.setPower sent by metal's relaying step of a workflow that was no
    lifecycle verb (and any during a verb) left the node's power unknown."""
    m, _ = metal
    node = (await m.enroll(bmc=BMC))["id"]
    assert (await m.node(node))["powerState"] is None
    doc = {"id": "t.power-on", "version": 1, "target": "metal", "role": "host",
           "steps": [{"use": "power.setPower", "on": "site", "with": {"action": "on"}}]}  # fmt: skip
    await _run_profile(m, node, doc)
    assert (await m.node(node))["powerState"] == "on"
