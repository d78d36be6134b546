"""The node a step runs for, as steps see it (``ctx.node``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import store

__all__ = ["NodeInfo", "node_info"]


@dataclass(frozen=True)
class NodeInfo:
    id: str
    site_id: str
    tenant_id: str
    labels: Mapping[str, str]
    macs: Sequence[str] = ()
    bmc: Mapping[str, Any] | None = None
    state: str = "enrolled"
    inventory: Mapping[str, Any] | None = None  # read for a control-plane step run only


def node_info(record: Any) -> NodeInfo:
    """A fetched ``nodes`` row, or the ``node_info`` object of ``PASS_WORKFLOWS``."""
    node = store.node_row(record)
    return NodeInfo(node.id, node.site_id, node.tenant_id, node.labels, node.macs, node.bmc, node.state)
