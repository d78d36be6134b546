"""Metal's owner reconciler and the node facts the engine records.

When a workflow started with ``owner='metal'`` ends, the engine queues ``metal:<workflow id>``
and runs ``reconcile_metal``: success moves the node to the verb's next state (a deploy also
writes the profile's host section, bumping ``generation``; an inspect keeps the inventory a
step returned), failure or abort moves it to ``failed`` naming the workflow and the step. No
polling: the end of the workflow is what queues it. A second run finds the node moved on and
does nothing, so it is safe to repeat.

A new host section also queues ``metal-host:<node id>`` in the same transaction (an outbox in the
work queue): ``converge_host`` sends bcd a ``node.converge`` of that generation and keeps the
``observedGeneration`` bcd reports. Facts reported by agents land here too: that generation (from
any ``node.converge`` result) and the power state a ``power.setPower`` left.

An aborted workflow also queues ``metal-undo:<workflow id>``: ``undo_aborted`` waits until every
command of the workflow ended at its agent (a cancel is a handshake: ``cancelling`` may still
reach the machine), then undoes what the workflow set up at the site (docs/metal.md, Abort):
each boot entry cleared, an inserted medium ejected, a boot override set back to the disk, and a
machine it powered on powered off.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any, Final

from better_compute.app import App
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.keys import workflow_command_prefix
from better_compute.metal.lifecycle import TRANSITIONS
from better_compute.provision import BUILTIN_CONFIG_UNITS, resolve_host_section, step_not_ready
from better_compute.wire.agent import is_call_failure
from better_compute.wire.cmdq import LIVE_STATES, EnqueueCommand
from better_compute.wire.commands import BmcInventoryResult, ConvergeResult, PowerResult, decode_result
from better_compute.wire.engine import CurrentStep, CurrentWorkflow

from .. import store
from ..core import queue
from . import store as metal_store
from .host import MetalHost
from .names import HOST_KEY_PREFIX, HOST_OWNER, METAL_OWNER, UNDO_OWNER
from .node_events import node_event

__all__ = [
    "HOST_KEY_PREFIX",
    "HOST_OWNER",
    "METAL_OWNER",
    "UNDO_OWNER",
    "close_batch",
    "converge_host",
    "current_workflow",
    "host_look_ms",
    "left_text",
    "reconcile_metal",
    "record_command_result",
    "reopen_node",
    "undo_aborted",
]

# wf:<workflow id>:undo:<what>: under the workflow's keys (bc-secrets opens a node's BMC
# credential to a live workflow command of the node), never under a step attempt's
UNDO_KEY = "undo"
UNDO_LOOK_MS = 2_000  # the workflow's commands still end at their agents: look again this soon
UNDO_TIMEOUT_MS = 600_000
HOST_CONVERGE_S = 3600  # bcd has this long to come up and apply a host section
HOST_LOOK_MS = 10_000  # a converge still live is looked at again this soon at first (its event is sooner) …
HOST_LOOK_MAX_MS = 600_000  # … then as long as it has waited, up to this (bcd is not up: the node is off)
_BY_RUNNING = {t.running: t for t in TRANSITIONS.values()}
_POWER = {"on": "on", "off": "off", "softOff": "off", "cycle": "on", "reset": "on"}


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


async def reconcile_metal(engine: MetalHost, workflow_id: str) -> None:
    """Move the workflow's node on, once the workflow has ended."""
    wf_row = await engine.db.fetchrow(store.WORKFLOW, workflow_id)
    if wf_row is None or wf_row["state"] == "running" or wf_row["node_id"] is None:
        return
    profile = await engine.profile(store.workflow_row(wf_row))
    if wf_row["state"] in ("failed", "aborted") and wf_row["batch_id"] is not None:
        await close_batch(engine, wf_row)
    applied, moved = None, None
    async with engine.db.transaction() as conn:
        node = await conn.fetchrow(metal_store.NODE_OF_WORKFLOW, wf_row["node_id"], workflow_id)
        if node is None:  # moved on already (or deleted), or a workflow that was no verb
            applied = await _workflow_host_config(engine, conn, wf_row, profile)
        else:
            moved = await _move_node(engine, conn, node, wf_row, profile)
    if applied is not None:
        await node_event(engine.publish, applied)
        if engine.wake is not None:
            await engine.wake(queue.owner_key(HOST_OWNER, applied["id"]))
    if moved is None:
        return
    row, section = moved
    engine.log.info("metal_node_moved", node_id=row["id"], state=row["state"], workflow_id=workflow_id)
    await node_event(engine.publish, row)
    if section is not None and engine.wake is not None:  # the new host section goes to bcd now
        await engine.wake(queue.owner_key(HOST_OWNER, row["id"]))
    if wf_row["state"] == "aborted" and engine.wake is not None:
        await engine.wake(queue.owner_key(UNDO_OWNER, workflow_id))


async def close_batch(engine: MetalHost, wf_row: Any) -> None:
    """A failed or aborted verb's workflow closes its destructive batch (the last one of a bulk
    verb's batch to end: the others may still need it), so it no longer counts as open; a retry
    or resume opens it again (``workflows_api``). The command-queue away: this key runs again."""
    if await engine.db.fetchval(metal_store.BATCH_STILL_RUNNING, wf_row["batch_id"], wf_row["id"]):
        return
    try:
        await engine.cmdq.close_batch(
            id=wf_row["batch_id"], reason=f"workflow {wf_row['id']} {wf_row['state']}"
        )
    except BcError as err:
        if err.code.value in ("UNAVAILABLE", "TIMEOUT"):
            raise step_not_ready(UNDO_LOOK_MS) from err
        engine.log.warning("batch_close_refused", workflow_id=wf_row["id"], code=err.code.value)


def _reached(view: Any) -> bool:
    """Whether a command may have acted on the machine: it succeeded, or its agent made a try
    (its progress names one) before it failed or was stopped."""
    return bool(view.state == "succeeded" or view.progress)


_UNDONE_KINDS = frozenset(
    {"netboot.setEntry", "media.insert", "media.eject", "management.setBootDevice", "power.setPower",
     "driver.invoke"}
)  # fmt: skip


def _undo_plan(views: list[Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    """What to send to return the site to where the aborted workflow found it, by key:
    (kind, payload), from its commands oldest first (what it undid itself needs no undo).
    Driver operations sent as ``driver.invoke`` count as their operation."""
    plan: dict[str, tuple[str, dict[str, Any]]] = {}
    for view in views:
        kind, payload = view.kind, view.payload if isinstance(view.payload, dict) else {}
        if kind == "driver.invoke":
            kind, payload = str(payload.get("operation")), payload.get("input") or {}
        given = {"bmc": payload["bmc"]} if payload.get("bmc") is not None else {}
        if kind == "netboot.setEntry" and payload.get("mac"):
            mac = str(payload["mac"]).lower().replace("-", ":")
            plan[f"netboot-{mac}"] = ("netboot.clearEntry", {"mac": mac})
        elif not given or not _reached(view):
            continue
        elif kind == "media.insert":
            device = str(payload.get("device", "cd"))
            plan[f"media-{device}"] = ("media.eject", {"device": device, **given})
        elif kind == "media.eject" and view.state == "succeeded":
            plan.pop(f"media-{payload.get('device', 'cd')}", None)
        elif kind == "management.setBootDevice" and payload.get("device") != "disk":
            plan["boot-device"] = ("management.setBootDevice", {"device": "disk", **given})
        elif kind == "management.setBootDevice" and view.state == "succeeded":
            plan.pop("boot-device", None)
        elif kind == "power.setPower" and payload.get("action") in ("on", "cycle", "reset"):
            plan["power"] = ("power.setPower", {"action": "off", **given})
        elif kind == "power.setPower" and view.state == "succeeded":
            plan.pop("power", None)
    return plan


async def undo_aborted(engine: MetalHost, workflow_id: str) -> None:
    """After an abort, once every command of the workflow ended at its agent: clear its boot
    entries, eject its media, set a boot override back to the disk and power off a machine it
    powered on. Each is keyed (``wf:<workflow>:undo:<abort ms>:<what>``), so a second run of
    this reconciler sends nothing new, and a resumed workflow aborted again undoes again."""
    wf = await engine.db.fetchrow(store.WORKFLOW, workflow_id)
    if wf is None or wf["state"] != "aborted" or wf["node_id"] is None:
        return
    if wf["cancel_commands"]:  # the engine still revokes and cancels what the workflow left
        raise step_not_ready(UNDO_LOOK_MS)
    listed = (await engine.cmdq.list_commands(workflow_id=workflow_id, limit=500)).commands
    undo_prefix = f"{workflow_command_prefix(workflow_id)}:{UNDO_KEY}:"
    own = [v for v in listed if not v.key.startswith(undo_prefix)]
    if any(v.state in LIVE_STATES for v in own):
        raise step_not_ready(UNDO_LOOK_MS)  # nothing is undone while the workflow's may still act
    views = [await engine.cmdq.get(id=v.id) for v in reversed(own) if v.kind in _UNDONE_KINDS]
    plan = _undo_plan(views)
    if not plan:
        return
    # per abort (a resumed workflow aborted again undoes again): the abort's time names it
    abort_ms = int(wf["finished_at"].timestamp() * 1000) if wf["finished_at"] is not None else 0
    node = await engine.db.fetchrow(store.NODE, wf["node_id"])
    if node is None:
        return
    for what, (kind, payload) in plan.items():
        try:
            view = await engine.cmdq.enqueue(
                EnqueueCommand(
                    node_id=node["id"],
                    site_id=node["site_id"],
                    kind=kind,
                    payload=payload,
                    key=f"{undo_prefix}{abort_ms}:{what}",
                    workflow_id=workflow_id,
                    timeout_ms=UNDO_TIMEOUT_MS,
                    tenant_id=node["tenant_id"],
                )
            )
        except BcError as err:
            if err.code.value in ("UNAVAILABLE", "TIMEOUT"):
                raise step_not_ready(UNDO_LOOK_MS) from err
            # refused for good (a kind this deployment holds destructive, a bad payload): say so
            engine.log.warning("abort_undo_refused", workflow_id=workflow_id, kind=kind, code=err.code.value)
            continue
        engine.log.info("abort_undo_sent", workflow_id=workflow_id, kind=kind, command_id=view.id)


async def _move_node(engine: MetalHost, conn: Any, node: Any, wf_row: Any, profile: Any) -> Any:
    """A lifecycle verb's workflow ended: the node's next state (or failed), its host section
    and power. Returns ``(row, section)``, or None when the node is in no state to move."""
    if node["state"] == "failed":
        verb = (_json(node["state_reason"]) or {}).get("verb")
        transition = TRANSITIONS.get(verb) if verb else None
    else:
        transition = _BY_RUNNING.get(node["state"])
    if transition is None:
        engine.log.warning("metal_node_unexpected", node_id=node["id"], state=node["state"])
        return None
    section, error = None, None
    if wf_row["state"] == "succeeded" and profile is not None and profile.host_config is not None:
        try:
            section = host_section(engine.app, profile, _json(node["labels"]) or {})
        except BcError as err:
            error = {"code": err.code.value, "message": err.message, "path": err.path}
    if wf_row["state"] == "succeeded" and error is None:
        row = await conn.fetchrow(
            metal_store.FINISH_OK,
            node["id"], transition.done, json.dumps(section) if section is not None else None,
            transition.verb in ("release", "retire"),
        )  # fmt: skip
        if section is not None:
            await queue.queue_now(conn, queue.owner_key(HOST_OWNER, node["id"]))
    else:
        step = await conn.fetchrow(metal_store.STOPPED_STEP, wf_row["id"])
        if error is None:
            error = (_json(step["error"]) if step else None) or _json(wf_row["error"]) or {}
        reason = {
            "workflowId": wf_row["id"],
            "verb": transition.verb,
            "workflowState": wf_row["state"],
            "step": "hostConfig" if step is None and wf_row["state"] == "succeeded" else None,
            "stepIndex": None,
            "code": error.get("code"),
            "message": error.get("message"),
        }
        if step is not None:
            reason.update(step=step["action"], stepIndex=step["idx"])
        reason["left"] = left_text(transition.verb, wf_row["state"], reason["step"])
        if transition.verb == "deploy" and node["image"] is not None:
            reason["image"] = node["image"]  # the image it was installing: a retry names it again
        row = await conn.fetchrow(
            metal_store.FINISH_FAILED, node["id"], json.dumps(reason), transition.verb == "deploy"
        )
        if wf_row["state"] == "aborted":  # undo its boot set-up once its commands ended
            await queue.queue_now(conn, queue.owner_key(UNDO_OWNER, wf_row["id"]))
    power = _POWER.get(str(await conn.fetchval(metal_store.LAST_POWER_ACTION, wf_row["id"])))
    if power is not None:
        row = await conn.fetchrow(metal_store.POWER_STATE, node["id"], power) or row
    return row, section


# What a failed or aborted verb may have left on the machine, and what the operator does next.
_LEFT = {
    "deploy": "the disk may hold part of an image; run deploy again or release",
    "release": "the disk may not be wiped whole; run release again",
    "retire": "the disk may not be wiped whole; run retire again",
    "commission": "the node's hardware checks did not finish; run commission again",
    "inspect": "the inventory was not taken; run inspect again",
    "adopt": "the node was not adopted; run adopt again or retire",
}


def left_text(verb: str, state: str, step: str | None) -> str:
    """``stateReason.left``: "<verb> failed|aborted at <step>: <what it left>; <what to do>"."""
    what = _LEFT.get(verb, f"run {verb} again")
    return f"{verb} {'aborted' if state == 'aborted' else 'failed'} at {step or '-'}: {what}"


async def _workflow_host_config(engine: MetalHost, conn: Any, wf_row: Any, profile: Any) -> Any:
    """A succeeded workflow that was no lifecycle verb (started with ``workflows.start``): its
    profile's ``hostConfig`` becomes the node's host section all the same (generation + 1, and
    ``metal-host`` sends it). One that does not resolve for the node is its ``lastError``; the
    node's state is not the workflow's to change. Returns the node's row when it changed."""
    if wf_row["state"] != "succeeded" or profile is None or profile.host_config is None:
        return None
    node = await conn.fetchrow(metal_store.LOCK_NODE, wf_row["node_id"])
    if node is None or await conn.fetchval(metal_store.NEWER_WORKFLOW, node["id"], wf_row["id"]):
        return None  # gone, or a later workflow had its say (this is a late second run)
    try:
        section = host_section(engine.app, profile, _json(node["labels"]) or {})
    except BcError as err:
        error = {"code": err.code.value, "message": err.message, "path": err.path,
                 "reason": "host-config", "workflowId": wf_row["id"]}  # fmt: skip
        return await conn.fetchrow(metal_store.SET_LAST_ERROR, node["id"], json.dumps(error))
    row = await conn.fetchrow(metal_store.SET_HOST_SECTION, node["id"], json.dumps(section))
    if row is not None:
        await queue.queue_now(conn, queue.owner_key(HOST_OWNER, node["id"]))
    return row


def host_look_ms(created_at: float, now: float) -> int:
    """When to look again at a live converge sent at ``created_at``: its settle event wakes the
    node's key at once, so the look only stands in for a lost event. Every ``HOST_LOOK_MS`` it
    was an enqueue per waiting node for as long as bcd stayed away (a node off: 360 an hour; a
    deploy's 30 s: 3.4 a machine, bench_fleet --agent-events); now as long as it has waited,
    ``HOST_LOOK_MS`` to ``HOST_LOOK_MAX_MS``."""
    waited_ms = int((now - created_at) * 1000)
    return max(HOST_LOOK_MS, min(waited_ms, HOST_LOOK_MAX_MS))


async def converge_host(engine: MetalHost, node_id: str) -> None:
    """Send bcd the node's host section (``node.converge`` of its generation) until it reports
    that generation applied; its settle event wakes this key, a live one is looked at again."""
    node = await engine.db.fetchrow(store.NODE, node_id)
    if node is None or node["host_section"] is None or node["observed_generation"] >= node["generation"]:
        return
    generation = node["generation"]
    units = (_json(node["host_section"]) or {}).get("units") or []
    view = await engine.cmdq.enqueue(
        EnqueueCommand(
            node_id=node_id,
            site_id=node["site_id"],
            kind="node.converge",
            payload={"generation": generation, "units": units},
            key=f"{HOST_KEY_PREFIX}{generation}",
            target="node",
            timeout_ms=HOST_CONVERGE_S * 1000,
            tenant_id=node["tenant_id"],
        )
    )
    if view.state in LIVE_STATES:
        raise step_not_ready(host_look_ms(view.created_at, time.time()))
    if view.state == "succeeded":
        result = json.loads(view.result) if view.result else None
        await record_command_result(engine, node_id, "node.converge", None, result)
        return
    message = f"node.converge {view.state}" + (f": {view.reason}" if view.reason else "")
    error = {
        "code": "DRIVER_ERROR",
        "reason": "host-section-not-applied",
        "generation": generation,
        "commandId": view.id,
        "message": message,
    }
    row = await engine.db.fetchrow(metal_store.SET_LAST_ERROR, node_id, json.dumps(error))
    engine.log.warning("host_section_not_applied", node_id=node_id, generation=generation, state=view.state)
    if row is not None:
        await node_event(engine.publish, row)


async def reopen_node(conn: Any, wf: Any) -> Any:
    """A retried or resumed metal workflow takes its node back from ``failed`` to the verb's
    ``…ing`` state (returns the node row, or None when there is nothing to move)."""
    if wf["owner"] != METAL_OWNER or wf["node_id"] is None:
        return None
    node = await conn.fetchrow(metal_store.NODE_OF_WORKFLOW, wf["node_id"], wf["id"])
    if node is None or node["state"] != "failed":
        return None
    if node["quarantine"] is not None:  # its token was seen twice: only an operator's look goes on
        raise BcError(
            ErrorCode.INVALID_STATE,
            f"node {node['id']} is quarantined: inspect or retire it, a retry or resume does not",
            {"path": "id", "reason": "node-quarantined", "nodeId": node["id"]},
        )
    transition = TRANSITIONS.get((_json(node["state_reason"]) or {}).get("verb", ""))
    if transition is None:
        return None
    return await conn.fetchrow(metal_store.REOPEN_NODE, node["id"], wf["id"], transition.running)


def host_section(app: App, profile: Any, labels: Mapping[str, str]) -> dict[str, Any]:
    """The node's host section: the profile's ``hostConfig`` units whose ``when:`` holds for its
    labels, settings checked and defaulted (``INVALID_INPUT`` for an unknown unit)."""
    units = app.provision.config_units if app.provision is not None else BUILTIN_CONFIG_UNITS
    return {"units": resolve_host_section(profile.host_config, labels, units=units)}


_RECORDED: Final = frozenset({"node.converge", "power.setPower", "management.inventory"})


async def record_command_result(
    engine: MetalHost, node_id: str, kind: str, payload: Any, result: Any
) -> None:
    """Keep what a settled command says of its node: bcd's observed generation, the power a
    ``power.setPower`` left or a BMC read (``management.inventory``) showed. Agent steps and
    every command a control-plane step sends (``ctx.commands``) come here when they succeed."""
    row = None
    if kind not in _RECORDED:
        return
    # decoded once into the kind's Structs; a result that does not fit says nothing
    done = decode_result(kind, result)
    if isinstance(done, ConvergeResult) and done.observed_generation:
        row = await engine.db.fetchrow(metal_store.OBSERVED_GENERATION, node_id, done.observed_generation)
    elif kind in ("power.setPower", "management.inventory"):
        said = done.power_state if isinstance(done, PowerResult) else None
        if isinstance(done, BmcInventoryResult):
            said = done.system.power_state
        power = said.lower() if said else None
        if power is None and kind == "power.setPower" and isinstance(payload, Mapping):
            power = _POWER.get(str(payload.get("action")))  # what the action asked for
        if power in ("on", "off"):
            row = await engine.db.fetchrow(metal_store.POWER_STATE, node_id, power)
    if row is not None:
        await node_event(engine.publish, row)


async def current_workflow(db: Any, row: Any, cmdq: Any = None) -> CurrentWorkflow | None:
    """``nodes.get``: the workflow moving the node now (its lifecycle verb's, else any running
    on it: a power or boot-device action, a ``workflows.start``), its step and what that waits
    for: what the step says (a service, an earlier attempt's commands), else the approvals of
    its batch."""
    workflow_id = row["workflow_id"] or await db.fetchval(store.NODE_BUSY, row["id"], None)
    if workflow_id is None:
        return None
    wf = await db.fetchrow(metal_store.RUNNING_STEP, workflow_id)
    if wf is None:
        return None
    waiting = _json(wf["waiting_for"])
    if wf["workflow_state"] == "running" and not wf["admitted"]:
        # no step started: it waits for its site's admission (docs/engine.md, "Admission")
        waiting = {"reason": "queued", "message": f"queued for admission at site {wf['site_id']}"}
    # a relaying step's own command ({reason: command}): said only when its batch's approvals
    # or a failing BMC, which say more, are not the matter
    command = waiting if isinstance(waiting, dict) and waiting.get("reason") == "command" else None
    if command is not None:
        waiting = None
    if waiting is None and wf["batch_id"] is not None and cmdq is not None:
        waiting = await _batch_waits(cmdq, wf["batch_id"])
    if waiting is None and wf["idx"] is not None and cmdq is not None:
        waiting = await _failing_bmc(cmdq, workflow_id)
    if waiting is None:
        waiting = command
    return CurrentWorkflow(
        id=workflow_id,
        state=wf["workflow_state"],
        profile_id=wf["profile_id"],
        batch_id=wf["batch_id"],
        step=CurrentStep(index=wf["idx"], action=wf["action"]) if wf["idx"] is not None else None,
        waiting_for=waiting,
    )


async def _failing_bmc(cmdq: Any, workflow_id: str) -> dict[str, Any] | None:
    """``{reason: bmc-failing, message, commandId}`` while a running command of the workflow
    reports that its tries of the BMC fail (its progress, ``call_failure_text``)."""
    try:
        listed = await cmdq.list_commands(workflow_id=workflow_id, state="running", limit=20)
    except BcError:
        return None  # the command queue is away: nodes.get still answers
    for cmd in listed.commands:
        if is_call_failure(cmd.progress):
            return {"reason": "bmc-failing", "message": cmd.progress, "commandId": cmd.id}
    return None


async def _batch_waits(cmdq: Any, batch_id: str) -> dict[str, Any] | None:
    """``{reason: batch-approval, batchId, approvals, threshold}`` while the batch is open."""
    try:
        batch = await cmdq.get_batch(id=batch_id)
    except BcError:
        return None  # the command queue is away: nodes.get still answers
    if batch.state != "open":
        return None
    counted = sum(1 for a in batch.approvals if a.counted)
    return {"reason": "batch-approval", "batchId": batch_id, "approvals": counted,
            "threshold": batch.threshold}  # fmt: skip
