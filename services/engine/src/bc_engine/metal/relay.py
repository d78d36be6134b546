"""Relaying: the control plane adds the node's BMC to a BMC command.

For a command kind whose payload has a ``bmc`` field (power, boot device, media, BMC inventory;
``better_compute.metal.commands``), and for a ``driver.invoke`` of such an operation, the engine
fills ``bmc`` from the node record when the step did not give one. The BMC names its credential by
reference (``credentialsRef``); the site agent fetches the value through bc-secrets' gate.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from better_compute.app import App
from better_compute.core.errors import BcError, ErrorCode

__all__ = ["DRIVER_INVOKE", "needs_bmc", "relay_bmc"]

DRIVER_INVOKE = "driver.invoke"


def _takes_bmc(fields: Mapping[str, Any]) -> bool:
    return "bmc" in fields


def _no_bmc(node_id: str) -> BcError:
    return BcError(
        ErrorCode.INVALID_STATE,
        f"node {node_id} has no BMC: give it one (nodes update --bmc …) before a BMC step",
        {"path": "bmc", "reason": "no-bmc", "nodeId": node_id},
    )


def needs_bmc(app: App, kind: str, payload: Any) -> bool:
    """Whether ``relay_bmc`` would fill in the node's BMC (so the node must be read for it)."""
    if not isinstance(payload, Mapping):
        return False
    definition = app.command_kinds.get(kind)
    if definition is None:
        return False
    if _takes_bmc(definition.payload.fields):
        return payload.get("bmc") is None
    if kind == DRIVER_INVOKE:
        operation = app.driver_operations.get(str(payload.get("operation")))
        given = payload.get("input")
        return (
            operation is not None
            and _takes_bmc(operation.input.fields)
            and isinstance(given, Mapping)
            and given.get("bmc") is None
        )
    return False


def relay_bmc(app: App, kind: str, payload: Any, node_id: str, bmc: Mapping[str, Any] | None) -> Any:
    """``payload`` with the node's ``bmc`` filled in where the kind takes one and it is absent.

    Raises:
        BcError: ``INVALID_STATE`` (reason ``no-bmc``) when the node has no BMC to relay to.
    """
    if not needs_bmc(app, kind, payload):
        return payload
    if bmc is None:
        raise _no_bmc(node_id)
    if kind == DRIVER_INVOKE:
        return {**payload, "input": {**payload["input"], "bmc": dict(bmc)}}
    return {**payload, "bmc": dict(bmc)}
