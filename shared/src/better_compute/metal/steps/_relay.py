"""What metal's steps share: the workflow's node, sending a command and reading its result, and
the attestation check of node-signed results. A BMC command's ``bmc`` is the engine's to add
(``bc_engine.metal.relay``) when the step gives none."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from better_compute.core.errors import BcError, ErrorCode
from better_compute.provision.commands import CommandResult, await_command
from better_compute.provision.context import StepNode
from better_compute.wire.commands import payload_document

__all__ = ["attested_result", "relay", "result_json", "workflow_node"]


def workflow_node(ctx: Any, step: str) -> StepNode:
    """The workflow's node; metal's steps run for one (``INVALID_CONFIG`` otherwise)."""
    node: StepNode | None = ctx.node
    if node is None:
        raise BcError(
            ErrorCode.INVALID_CONFIG,
            f"{step} runs for a node: start the workflow with one",
            {"path": "nodeId"},
        )
    return node


def result_json(done: CommandResult) -> Any:
    """The agent's result bytes as JSON (None when empty or not JSON)."""
    try:
        return json.loads(done["result"]) if done["result"] else None
    except ValueError:
        return None


async def relay(
    ctx: Any,
    *,
    kind: str,
    payload: Mapping[str, Any] | msgspec.Struct,
    key: str | None = None,
    target: Literal["site", "node"] = "site",
) -> dict[str, Any]:
    """Send one command of this step attempt (find-before-create by key) and wait for it.
    ``payload`` is the kind's Struct (``wire.commands``), or its JSON for a kind without one.

    Returns ``{commandId, result}`` (the agent's result as JSON) once it succeeded; raises
    ``step_not_ready`` while it runs and ``DRIVER_ERROR`` when it failed (``await_command``).
    """
    node = workflow_node(ctx, kind)
    body = payload_document(payload) if isinstance(payload, msgspec.Struct) else dict(payload)
    done = await await_command(ctx, node_id=node.id, kind=kind, payload=body, key=key, target=target)
    return {"commandId": done["command_id"], "result": result_json(done)}


async def attested_result(
    ctx: Any, *, kind: str, payload: Mapping[str, Any], step: str, key: str | None = None
) -> dict[str, Any]:
    """Send a node command and accept its result only when it is ``attested``: signed by the
    node's key and checked against that node's certificate (by the command queue, through
    bc-pki). A result that decides a transition (a wipe, an install, an inventory) counts
    only then.

    Raises:
        BcError: ``UNAUTHENTICATED`` (reason ``not-attested``) for a result that is not.
    """
    node = workflow_node(ctx, step)
    done = await await_command(ctx, node_id=node.id, kind=kind, payload=dict(payload), key=key, target="node")
    if not done["attested"]:
        ctx.log.warning("result_not_attested", kind=kind, command_id=done["command_id"])
        raise BcError(
            ErrorCode.UNAUTHENTICATED,
            f"the {kind} result of node {node.id} is not signed by the node's key; it does not count",
            {"path": "result", "reason": "not-attested", "commandId": done["command_id"], "kind": kind},
        )
    return {"commandId": done["command_id"], "result": result_json(done), "attested": True}
