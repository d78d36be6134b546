"""``bc.events.node.<id>``: every change of a node, as a wake-up (the node row is the truth)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["Publish", "node_event"]

Publish = Callable[[str, str, Any], Awaitable[None]]


async def node_event(publish: Publish, row: Any, **extra: Any) -> None:
    """The node's state, generation and power after a change."""
    payload = {
        "nodeId": row["id"],
        "state": row["state"],
        "workflowId": row["workflow_id"],
        "generation": row["generation"],
        "observedGeneration": row["observed_generation"],
        "powerState": row["power_state"],
        **extra,
    }
    await publish("node", row["id"], payload)
