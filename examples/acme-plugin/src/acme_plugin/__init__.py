"""Acme's Better Compute plugin: ``acme.checkMemory`` and the ``acme-memory-check`` profile.

``acme.checkMemory`` reads the memory its node's bcd reported (``ctx.node.inventory``) and fails
the workflow when the node has less than ``minMemoryGiB``; its result shows what it read. The
profile collects the inventory from the node's running bcd first (metal's ``inspect.collect``),
then checks it. ``acme-nic-firmware`` is a config unit a profile's ``hostConfig`` can name.

Installed (``pip install acme-plugin``), the entry point ``acme`` in ``better_compute.plugins``
names ``plugin``; every service loads it at its next start.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from better_compute.core import BcError, ErrorCode, define_plugin, field, manifest
from better_compute.provision import ConfigUnit, StepContext, define_profile, define_step

__all__ = ["CHECK_MEMORY_STEPS", "check_memory", "memory_check", "nic_firmware", "plugin"]

GIB: Final = 1 << 30


def _memory_bytes(inventory: Mapping[str, Any]) -> int | None:
    memory = inventory.get("memory")
    total = memory.get("totalBytes") if isinstance(memory, Mapping) else None
    return total if isinstance(total, int) and not isinstance(total, bool) and total >= 0 else None


async def _check_memory(input: dict[str, Any], ctx: StepContext) -> dict[str, Any]:
    node = ctx.node
    if node is None:
        raise BcError(ErrorCode.INVALID_CONFIG, "acme.checkMemory runs for a node", {"path": "nodeId"})
    inventory = node.inventory
    if inventory is None:
        raise BcError(
            ErrorCode.INVALID_STATE,
            f"node {node.id} has no inventory yet: inspect it first (inspect.collect)",
            {"path": "inventory", "reason": "no-inventory"},
        )
    total = _memory_bytes(inventory)
    if total is None:
        raise BcError(
            ErrorCode.INVALID_STATE,
            f"node {node.id}'s inventory has no memory.totalBytes",
            {"path": "inventory.memory.totalBytes", "reason": "no-memory"},
        )
    wanted = input["minMemoryGiB"]
    if total < wanted * GIB:
        raise BcError(
            ErrorCode.INVALID_STATE,
            f"node {node.id} has {total / GIB:.1f} GiB of memory, less than the {wanted} GiB asked for",
            {"path": "with.minMemoryGiB", "reason": "too-little-memory"},
        )
    cpus = inventory.get("cpus")
    ctx.log.info("acme_memory_checked", node_id=node.id, memory_bytes=total)
    # Read-only, so a re-run after a crash returns the same result: nothing to key.
    return {
        "memoryBytes": total,
        "memoryGiB": round(total / GIB, 1),
        "minMemoryGiB": wanted,
        "cpuModel": cpus.get("model") if isinstance(cpus, Mapping) else None,
    }


check_memory = define_step(
    id="acme.checkMemory",
    runs_on="control-plane",
    timeout="1m",
    retry_safe=True,
    description="Check the memory the node's inventory reports against minMemoryGiB",
    input=manifest({"minMemoryGiB": field.int(min=1, max=1 << 20).default(16)}),
    run=_check_memory,
)

CHECK_MEMORY_STEPS: Final[list[dict[str, Any]]] = [
    {"use": "inspect.collect"},  # metal's: the inventory from the node's running bcd, node-signed
    {"use": "acme.checkMemory", "with": {"minMemoryGiB": 16}},
]

memory_check = define_profile(
    id="acme-memory-check",
    version=1,
    target="metal",
    role="host",
    steps=CHECK_MEMORY_STEPS,
)

nic_firmware = ConfigUnit(
    name="acme-nic-firmware",
    description="Pins the NIC firmware branch",
    settings=manifest({"branch": field.string(pattern=r"^[0-9]+\.[0-9]+$")}),
)

plugin = define_plugin(
    id="acme",
    description="Acme: a node's memory checked against its inventory",
    extensions=[check_memory],
    profiles=[memory_check],
    config_units=[nic_firmware],
)
