"""What metal's steps share: the workflow's node, its BMC, sending a command and reading its
result, and the attestation check of node-signed results."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from better_compute.core.errors import BcError, ErrorCode
from better_compute.provision.commands import CommandResult, await_command
from better_compute.provision.context import StepNode

__all__ = ["attested_result", "node_bmc", "relay", "result_json", "workflow_node"]


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


def node_bmc(ctx: Any, step_input: Mapping[str, Any], step: str) -> dict[str, Any]:
    """The BMC a BMC command talks to: the step's ``with.bmc`` when given, else the node's.

    The node record holds ``credentialsRef`` (a SecretRef), never the password; the site agent
    fetches the credential through the secrets gate because the reference travels in the
    command's own body.

    Raises:
        BcError: ``INVALID_STATE`` (reason ``no-bmc``) when the node has no BMC.
    """
    given = step_input.get("bmc")
    if given:
        return dict(given)
    node = workflow_node(ctx, step)
    bmc = getattr(node, "bmc", None)
    if not bmc:
        raise BcError(
            ErrorCode.INVALID_STATE,
            f"node {node.id} has no BMC: add one to the node before {step}",
            {"path": "bmc", "reason": "no-bmc", "nodeId": node.id},
        )
    return {key: value for key, value in bmc.items() if value is not None}


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
    payload: Mapping[str, Any],
    key: str | None = None,
    target: Literal["site", "node"] = "site",
) -> dict[str, Any]:
    """Send one command of this step attempt (find-before-create by key) and wait for it.

    Returns ``{commandId, result}`` (the agent's result as JSON) once it succeeded; raises
    ``step_not_ready`` while it runs and ``DRIVER_ERROR`` when it failed (``await_command``).
    """
    node = workflow_node(ctx, kind)
    done = await await_command(ctx, node_id=node.id, kind=kind, payload=dict(payload), key=key, target=target)
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
