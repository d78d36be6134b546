"""``metal.bulk``: one verb over 50 nodes under one batch of a 2-of-3 quorum, with engine,
command-queue and PKI as processes and a simulated site agent counting what it ran."""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import pytest_asyncio
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from bc_command_queue import store as cmdq_store
from better_compute.clients import CommandQueueClient, EngineClient, PkiClient
from better_compute.clients.audit import AuditClient
from better_compute.config import Settings
from better_compute.crypto import sign_batch
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, bcx, refused, until
from better_compute.testing.agents import SimAgent, start_sim_agent
from better_compute.testing.approvers import approver_keys, write_approvers

APPROVERS = ("alice", "bob", "carol")
N = 50
SELECTOR = {"site": "lab1", "rack": "r12"}
BMC = {"driver": "sim", "address": "bmc-r12"}
ADMITTED = 3


async def _stack(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path, **env: str
) -> AsyncIterator[tuple[dict[str, ed25519.Ed25519PrivateKey], SimAgent]]:
    keys = approver_keys(APPROVERS)
    write_approvers(tmp_path / "approvers.toml", keys)
    bc_processes.settings = msgspec.structs.replace(bc_settings, app="metal_test_app:app")
    quorum = str(tmp_path / "approvers.toml")
    bc_processes.extra_env.update(
        BC_CMDQ_QUORUM_FILE=quorum, BC_CMDQ_HEARTBEAT="200ms", BC_CMDQ_SWEEP="100ms", **env
    )  # fmt: skip
    for name in ("bc-pki", "bc-command-queue", "bc-engine"):
        bc_processes.start(name)
    await bc_processes.wait_ready()
    sim, _agent = await start_sim_agent(
        bc_processes.settings, tmp_path / "agent", site_id="lab1", pki=PkiClient(bc_api),
        cq=CommandQueueClient(bc_api),
    )  # fmt: skip
    try:
        yield keys, sim
    finally:
        sim.close()


@pytest_asyncio.fixture(loop_scope="session")
async def stack(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> AsyncIterator[tuple[dict[str, ed25519.Ed25519PrivateKey], SimAgent]]:
    async for got in _stack(bc_settings, bc_api, bc_processes, tmp_path):
        yield got


@pytest_asyncio.fixture(loop_scope="session")
async def admitting_stack(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> AsyncIterator[tuple[dict[str, ed25519.Ed25519PrivateKey], SimAgent]]:
    """The same stack, its engine admitting ADMITTED workflows of a site at once."""
    async for got in _stack(
        bc_settings, bc_api, bc_processes, tmp_path, BC_ENGINE_SITE_ADMISSION=str(ADMITTED)
    ):
        yield got


async def _states(api: ApiClient, ids: list[str]) -> dict[str, str]:
    return {i: (await api.call("engine", "nodes.get", {"id": i}))["state"] for i in ids}


def _destructive_runs(sim: SimAgent) -> int:
    return sum(1 for line in sim.executions() if line.endswith(" driver.invoke"))


async def test_a_bulk_release_of_50_nodes_needs_exactly_two_approvals(
    stack: tuple[dict[str, ed25519.Ed25519PrivateKey], SimAgent], bc_api: ApiClient
) -> None:
    keys, sim = stack
    cq = CommandQueueClient(bc_api)
    ids = []
    for i in range(N):  # one BMC, one node (issue 23)
        body = {"siteId": "lab1", "labels": {"rack": "r12"}, "bmc": {**BMC, "address": f"bmc-r12-{i}"}}
        node = await bc_api.call("engine", "metal.enroll", body)
        ids.append(node["id"])
    # adopt sends nothing destructive: no batch, all 50 deployed
    adopted = await bc_api.call("engine", "metal.bulk", {"verb": "adopt", "selector": SELECTOR})
    assert (len(adopted["started"]), adopted["refused"], adopted["batchId"]) == (N, [], None)
    await until(lambda: _all(bc_api, ids, "deployed"), what="50 nodes deployed")

    # two more in the rack that are not deployed: refused one by one, not fatal to the rest
    late = [(await bc_api.call("engine", "metal.enroll", {"siteId": "lab1", "labels": {"rack": "r12"}}))["id"]
            for _ in range(2)]  # fmt: skip
    bulk = await bc_api.call("engine", "metal.bulk", {"verb": "release", "selector": SELECTOR})
    assert sorted(s["nodeId"] for s in bulk["started"]) == sorted(ids)
    assert [(r["nodeId"], r["code"], r["reason"]) for r in bulk["refused"]] == [
        (n, "INVALID_STATE", "wrong-state") for n in sorted(late)
    ]
    # one batch for all 50 workflows, scoped before anything was sent
    batch = await cq.get_batch(id=bulk["batchId"])
    assert (batch.kinds, sorted(batch.nodes), batch.threshold) == (["driver.invoke"], sorted(ids), 2)
    assert sorted(batch.workflow_ids) == sorted(s["workflowId"] for s in bulk["started"])

    async def pending() -> bool:
        listed = (await cq.list_commands(batch_id=batch.id, limit=N + 10)).commands
        return len(listed) == N and all(c.state == "pending" for c in listed)

    await until(pending, what="50 destructive commands enqueued, held for the quorum")
    assert _destructive_runs(sim) == 0
    await cq.approve_batch(batch_id=batch.id, approver_id="alice", signature=sign_batch(batch, keys["alice"]))
    assert (await cq.get_batch(id=batch.id)).state == "open"
    assert await pending()  # one approval delivers nothing
    assert _destructive_runs(sim) == 0
    assert set((await _states(bc_api, ids)).values()) == {"releasing"}
    shown = (await bc_api.call("engine", "nodes.get", {"id": ids[0]}))["currentWorkflow"]
    waits = {"reason": "batch-approval", "batchId": batch.id, "approvals": 1, "threshold": 2}
    assert shown["waitingFor"] == waits

    await cq.approve_batch(batch_id=batch.id, approver_id="bob", signature=sign_batch(batch, keys["bob"]))
    await until(lambda: _all(bc_api, ids, "ready"), what="50 nodes released")
    assert _destructive_runs(sim) == N
    assert len((await cq.get_batch(id=batch.id)).approvals) == 2

    # nodes in the wrong state only: nothing starts, no batch, each one said why
    again = await bc_api.call("engine", "metal.bulk", {"verb": "release", "nodeIds": ids[:2]})
    assert (again["started"], again["batchId"], len(again["refused"])) == ([], None, 2)
    nobody = {"verb": "release", "selector": {"rack": "nope"}}
    err = await refused(bc_api.call("engine", "metal.bulk", nobody))
    assert (err.code.value, err.details["path"]) == ("NOT_FOUND", "selector")


async def test_a_bulk_verb_over_more_nodes_than_the_site_admits_runs_them_in_turn_under_one_batch(
    admitting_stack: tuple[dict[str, ed25519.Ed25519PrivateKey], SimAgent], bc_api: ApiClient
) -> None:
    """Issue 25: the engine admits ADMITTED of a site's workflows at once; the rest wait with no
    step started and are admitted as the first end. One batch covers them all: approved once,
    each node is released once, counted at the site agent."""
    keys, sim = admitting_stack
    cq, engine = CommandQueueClient(bc_api), EngineClient(bc_api)
    n = 8
    ids = []
    for i in range(n):
        body = {"siteId": "lab1", "labels": {"rack": "r25"}, "bmc": {**BMC, "address": f"bmc-r25-{i}"}}
        ids.append((await bc_api.call("engine", "metal.enroll", body))["id"])
    await bc_api.call("engine", "metal.bulk", {"verb": "adopt", "nodeIds": ids})
    await until(lambda: _all(bc_api, ids, "deployed"), what=f"{n} nodes adopted, {ADMITTED} at a time")
    bulk = await bc_api.call("engine", "metal.bulk", {"verb": "release", "nodeIds": ids})
    started = [s["workflowId"] for s in bulk["started"]]
    assert len(started) == n
    views = [await engine.get_workflow(id=w) for w in started]
    assert sorted(v.queued for v in views) == [False] * ADMITTED + [True] * (n - ADMITTED)
    batch = await cq.get_batch(id=bulk["batchId"])
    assert sorted(batch.workflow_ids) == sorted(started)  # one batch names the waiting ones too

    async def pending() -> int:
        return len((await cq.list_commands(batch_id=batch.id, limit=n + 10)).commands)

    await until(lambda: _is(pending(), ADMITTED), what=f"{ADMITTED} destructive commands held for the quorum")
    waiting = next(v for v in views if v.queued)
    why = await engine.why(id=waiting.id)
    assert why.reasons[0].kind == "queued", why
    assert why.reasons[0].facts["running"] == ADMITTED
    shown = (await bc_api.call("engine", "nodes.get", {"id": waiting.node_id}))["currentWorkflow"]
    assert (shown["step"], shown["waitingFor"]["reason"]) == (None, "queued")  # what bcx nodes watch says
    assert await pending() == ADMITTED  # the others sent nothing, approved or not
    for who in ("alice", "bob"):
        await cq.approve_batch(batch_id=batch.id, approver_id=who, signature=sign_batch(batch, keys[who]))
    await until(lambda: _all(bc_api, ids, "ready"), what=f"{n} nodes released, {ADMITTED} at a time")
    assert _destructive_runs(sim) == n  # each once, at the agent
    assert not any([(await engine.get_workflow(id=w)).queued for w in started])


async def _is(value: Any, want: Any) -> bool:
    return bool(await value == want)


async def _all(api: ApiClient, ids: list[str], state: str) -> bool:
    states: dict[str, Any] = await _states(api, ids)
    assert "failed" not in states.values(), states
    return set(states.values()) == {state}


async def test_a_bulk_verb_aborted_closes_its_batch_once_its_last_workflow_ended(
    stack: tuple[dict[str, ed25519.Ed25519PrivateKey], SimAgent],
    bc_api: ApiClient,
    bc_processes: ServiceProcesses,
) -> None:
    """Issue 26: an abandoned batch no longer counts as open (the gauge of batches awaiting
    approval counts the same), a retry opens it again."""
    cq, settings = CommandQueueClient(bc_api), bc_processes.settings
    ids = []
    for i in range(2):
        body = {"siteId": "lab1", "labels": {"rack": "r26"}, "bmc": {**BMC, "address": f"bmc-r26-{i}"}}
        ids.append((await bc_api.call("engine", "metal.enroll", body))["id"])
    await bc_api.call("engine", "metal.bulk", {"verb": "adopt", "nodeIds": ids})
    await until(lambda: _all(bc_api, ids, "deployed"), what="2 nodes deployed")
    bulk = await bc_api.call("engine", "metal.bulk", {"verb": "release", "nodeIds": ids})
    batch_id, (first, second) = bulk["batchId"], [s["workflowId"] for s in bulk["started"]]
    assert (await cq.get_batch(id=batch_id)).state == "open"

    async def node_failed(wf: str) -> bool:
        shown = await bc_api.call("engine", "workflows.get", {"id": wf})
        node = await bc_api.call("engine", "nodes.get", {"id": shown["nodeId"]})
        return node["state"] == "failed"

    await bc_api.call("engine", "workflows.abort", {"id": first, "reason": "not today"})
    await until(lambda: node_failed(first), what="the first node failed")
    assert (await cq.get_batch(id=batch_id)).state == "open"  # the other workflow still needs it
    await bc_api.call("engine", "workflows.abort", {"id": second, "reason": "not today"})

    async def closed() -> bool:
        return (await cq.get_batch(id=batch_id)).state == "closed"

    await until(closed, what="the batch closed once both workflows ended")
    batch = await cq.get_batch(id=batch_id)
    assert batch.closed_reason == f"workflow {second} aborted"
    assert batch_id not in [b.id for b in await cq.list_batches(state="open", limit=100)]
    conn = await asyncpg.connect(settings.database_url, server_settings={"search_path": "cmdq"})  # the gauge
    try:
        assert await conn.fetchval(cmdq_store.BATCHES_WAITING + " AND id = $1", batch_id) == 0
    finally:
        await conn.close()
    approve = cq.approve_batch(
        batch_id=batch_id, approver_id="alice", signature=sign_batch(batch, stack[0]["alice"])
    )
    err = await refused(approve)
    assert (err.code.value, err.details["reason"]) == ("INVALID_STATE", "batch-closed")

    # resumed: the workflow waits for its approvals again, so its batch is open again
    await bc_api.call("engine", "workflows.resume", {"id": first})
    assert (await cq.get_batch(id=batch_id)).state == "open"


async def _what_exists(api: ApiClient) -> tuple[int, int, int, int]:
    """Workflows, batches, commands and audit entries there are now."""
    cq = CommandQueueClient(api)
    entries, missing = await AuditClient(api).merged(limit=1000)
    assert set(missing) == {"secrets"}  # not in this stack; the plan never asks it anything
    return (
        len((await EngineClient(api).list_workflows(limit=500)).workflows),
        len(await cq.list_batches(limit=500)),
        len((await cq.list_commands(limit=500)).commands),
        len(entries),
    )


def _pem(key: ed25519.Ed25519PrivateKey, path: Path) -> str:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path.chmod(0o600)
    return str(path)


async def test_bulk_plan_shows_steps_commands_approvals_and_refusals_and_changes_nothing(
    stack: tuple[dict[str, ed25519.Ed25519PrivateKey], SimAgent],
    bc_api: ApiClient,
    bc_processes: ServiceProcesses,
    tmp_path: Path,
) -> None:
    """Issue 26: ``bcx bulk <verb> --plan`` (and ``bcx <verb> NODE --plan``) is what the verb
    would do, per node, and does none of it; ``bcx batches approve`` shows the scope it signs
    first. Seen failing before metal.plan (bcx: unrecognized arguments: --plan). The approvers
    file changed while the services run is in force for the next plan and batch (seen failing
    before the reload: the plan still said 2 of 3)."""
    keys, settings = stack[0], bc_processes.settings
    ids = []
    for i in range(3):
        body = {"siteId": "lab1", "labels": {"rack": "r7"}, "bmc": {**BMC, "address": f"bmc-r7-{i}"},
                "name": f"r7-m{i}"}  # fmt: skip
        ids.append((await bc_api.call("engine", "metal.enroll", body))["id"])
    await bc_api.call("engine", "metal.bulk", {"verb": "adopt", "nodeIds": ids[:2]})
    await until(lambda: _all(bc_api, ids[:2], "deployed"), what="2 nodes deployed")
    before = await _what_exists(bc_api)
    states = await _states(bc_api, ids)

    out = await bcx(settings, "bulk", "release", "--selector", "site=lab1,rack=r7", "--plan", "--json")
    assert out.returncode == 0, out.stderr
    plan = msgspec.json.decode(out.stdout)
    release = plan["profile"]
    assert release["id"] == "t.release"  # the test app's release profile
    assert [(n["nodeId"], n["state"], n["becomes"], n["profile"]) for n in plan["nodes"]] == [
        (n, "deployed", "releasing", release) for n in sorted(ids[:2])
    ]
    assert sorted(n["name"] for n in plan["nodes"]) == ["r7-m0", "r7-m1"]
    assert plan["steps"], plan
    assert [s["index"] for s in plan["steps"]] == list(range(len(plan["steps"])))
    # the wipe is the destructive one; it is in the commands of its step and in the batch's scope
    assert plan["destructive"] == ["driver.invoke"]
    wiping = [s for s in plan["steps"] if s["destructive"]]
    assert wiping, plan["steps"]
    assert all(set(s["destructive"]) <= set(s["commands"]) for s in plan["steps"])
    assert set(plan["destructive"]) <= set(plan["commands"])
    assert plan["approvals"] == {"threshold": 2, "approvers": list(APPROVERS)}
    assert [(r["nodeId"], r["name"], r["code"], r["reason"]) for r in plan["refused"]] == [
        (ids[2], "r7-m2", "INVALID_STATE", "wrong-state")
    ]

    table = await bcx(settings, "bulk", "release", "--node", ids[0], "--node", ids[2], "--plan")
    assert table.returncode == 0, table.stderr
    text = table.stdout
    assert "plan: release of 1 node (t.release@" in text
    assert "nothing was started" in text
    row = rf"^{ids[0]}\s+r7-m0\s+deployed\s+releasing\s+t\.release@\d+\s+\d+\s+\d+\s+driver\.invoke$"
    assert re.search(row, text, re.M), text
    assert "needs 2 of 3 (alice, bob, carol)" in text
    assert "would refuse 1:" in text
    assert re.search(
        rf"^{ids[2]}\s+r7-m2\s+INVALID_STATE\s+node {ids[2]} is enrolled; release needs deployed", text, re.M
    ), text
    assert f"to run it: bcx bulk release --node {ids[0]} --node {ids[2]}" in text
    watch = await bcx(settings, "bulk", "release", "--node", ids[0], "--plan", "--watch")
    assert watch.returncode == 1
    assert "error: INVALID_INPUT: --plan starts nothing to watch" in watch.stderr

    # one node's verb plans the same way (by name or id), and exits 1 when it would be refused
    one = await bcx(settings, "release", "r7-m0", "--plan")
    assert one.returncode == 0, one.stderr
    assert "plan: release of 1 node (t.release@" in one.stdout
    assert re.search(rf"^{ids[0]}\s+r7-m0\s+deployed\s+releasing\s", one.stdout, re.M), one.stdout
    assert "needs 2 of 3 (alice, bob, carol)" in one.stdout
    assert f"to run it: bcx release {ids[0]}" in one.stdout
    inspect = await bcx(settings, "inspect", ids[2], "--plan", "--json")
    assert inspect.returncode == 0, inspect.stderr
    planned = msgspec.json.decode(inspect.stdout)
    assert [(n["nodeId"], n["name"], n["state"], n["becomes"]) for n in planned["nodes"]] == [
        (ids[2], "r7-m2", "enrolled", "inspecting")
    ]
    wrong = await bcx(settings, "release", "r7-m2", "--plan")
    assert wrong.returncode == 1
    assert "would refuse 1:" in wrong.stdout
    assert "is enrolled; release needs deployed" in wrong.stdout
    assert "to run it" not in wrong.stdout
    waiting = await bcx(settings, "deploy", "r7-m0", "--plan", "--wait")
    assert waiting.returncode == 1
    assert "error: INVALID_INPUT: --plan starts nothing to watch: drop --wait" in waiting.stderr

    # nothing happened: no workflow, no batch, no command, no audit entry, no node moved
    assert await _what_exists(bc_api) == before
    assert await _states(bc_api, ids) == states

    # the approvers are configuration read again when their file changes, with no restart: the
    # next plan and the next verb's batch need 3 of 4, and the new approver's signature counts
    keys["dave"] = ed25519.Ed25519PrivateKey.generate()
    os.replace(write_approvers(tmp_path / "approvers.next", keys, threshold=3), tmp_path / "approvers.toml")
    cq = CommandQueueClient(bc_api)

    async def in_force() -> bool:
        quorum = await cq.quorum()
        return (quorum.threshold, [a.id for a in quorum.approvers]) == (3, [*APPROVERS, "dave"])

    await until(in_force, timeout=30, what="the new approvers in force")
    replanned = await bcx(settings, "release", "r7-m0", "--plan")
    assert replanned.returncode == 0, replanned.stderr
    assert "needs 3 of 4 (alice, bob, carol, dave)" in replanned.stdout

    # the verb itself does what the plan said
    bulk = await bc_api.call(
        "engine", "metal.bulk", {"verb": "release", "selector": {"site": "lab1", "rack": "r7"}}
    )
    assert [s["nodeId"] for s in bulk["started"]] == [n["nodeId"] for n in plan["nodes"]]
    assert [(r["nodeId"], r["name"]) for r in bulk["refused"]] == [
        (r["nodeId"], r["name"]) for r in plan["refused"]
    ]
    batch = await CommandQueueClient(bc_api).get_batch(id=bulk["batchId"])
    assert batch.kinds == plan["destructive"]

    # approve shows what the signature covers before it signs; --json keeps stdout one document
    signed = await bcx(settings, "batches", "approve", batch.id, "--approver", "alice",
                       "--key-file", _pem(keys["alice"], tmp_path / "alice.pem"))  # fmt: skip
    assert signed.returncode == 0, signed.stderr
    scope, _, _ = signed.stdout.partition("approved by alice")
    assert f"you sign batch {batch.id} (open, 0/3):" in scope
    assert "kinds      driver.invoke" in scope
    assert "nodes      2: " in scope
    for s in bulk["started"]:
        assert f"{s['workflowId']}  t.release@{release['version']} on {s['nodeId']}" in scope
    as_json = await bcx(settings, "batches", "approve", batch.id, "--approver", "bob",
                        "--key-file", _pem(keys["bob"], tmp_path / "bob.pem"), "--json")  # fmt: skip
    assert as_json.returncode == 0, as_json.stderr
    assert msgspec.json.decode(as_json.stdout)["state"] == "open"
    assert f"you sign batch {batch.id} (open, 1/3):" in as_json.stderr
    dave = await cq.approve_batch(
        batch_id=batch.id, approver_id="dave", signature=sign_batch(batch, keys["dave"])
    )
    assert (dave.state, [a.approver_id for a in dave.approvals if a.counted]) == (
        "approved",
        ["alice", "bob", "dave"],
    )
