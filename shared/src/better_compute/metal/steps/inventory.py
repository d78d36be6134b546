"""``inspect.collect``: the node's inventory from its own agent, node-signed, stored on the node.

bcd answers ``node.inventory`` with the machine's hardware (CPUs, memory, disks, NICs, GPUs:
``NodeInventoryResult``) and signs the result with the node key; only an attested result that
decodes as one is stored (``nodes.inventory``), as the node signed it.
"""

from __future__ import annotations

import json
from typing import Any, Final

from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.manifest import manifest
from better_compute.provision.steps import define_step
from better_compute.wire.commands import NodeInventoryResult, decode_result

from ..commands import NODE_INVENTORY
from ._relay import attested_result, workflow_node

__all__ = ["STORE_INVENTORY", "inspect_collect"]

STEP_ID: Final = "inspect.collect"
STORE_INVENTORY: Final = "UPDATE nodes SET inventory = $2::jsonb, updated_at = now() WHERE id = $1"


async def _run(_input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    node = workflow_node(ctx, STEP_ID)
    done = await attested_result(ctx, kind=NODE_INVENTORY.name, payload={}, step=STEP_ID)
    document = done["result"]
    if not isinstance(decode_result(NODE_INVENTORY.name, document), NodeInventoryResult):
        raise BcError(
            ErrorCode.DRIVER_ERROR,
            f"node {node.id} answered node.inventory with something that is not an inventory",
            {"path": "result", "commandId": done["commandId"]},
        )
    # Stored as the node signed it. The same inventory on a re-run: writing it again changes nothing.
    await ctx.sql.query(STORE_INVENTORY, node.id, json.dumps(document))
    return {"commandId": done["commandId"], "attested": True, "inventory": sorted(document)}


inspect_collect = define_step(
    id=STEP_ID,
    runs_on="control-plane",
    relays=["node"],
    sends=[NODE_INVENTORY.name],
    timeout="10m",
    input=manifest({}),
    run=_run,
    retry_safe=True,
    description="Collect the node's inventory from its agent (node-signed) and store it on the node",
)
