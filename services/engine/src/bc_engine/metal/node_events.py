"""``bc.events.node.<id>``: every change of a node, as a wake-up (the node row is the truth)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from better_compute.wire.engine import NODE_EVENTS, NodeChanged, NodeRemoved

__all__ = ["Publish", "node_event", "node_removed"]

Publish = Callable[[str, str, Any], Awaitable[None]]


async def node_event(publish: Publish, row: Any, *, verb: str | None = None) -> None:
    """The node's state, generation and power after a change (``verb``: the request's)."""
    event = NodeChanged(
        node_id=row["id"],
        state=row["state"],
        workflow_id=row["workflow_id"],
        generation=row["generation"],
        observed_generation=row["observed_generation"],
        power_state=row["power_state"],
        verb=verb if verb is not None else msgspec.UNSET,
    )
    await publish(NODE_EVENTS, row["id"], event)


async def node_removed(publish: Publish, node_id: str) -> None:
    await publish(NODE_EVENTS, node_id, NodeRemoved(node_id=node_id))
