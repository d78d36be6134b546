"""The steps of the shipped ``metal.enroll`` profile: the BMC checked, then read.

``enroll.validateBmc`` sends the site agent ``management.validate`` (it answers, takes the
credentials, has the system, reads power: nothing changes) and fails the step, naming each
failed check, when one failed; an agent that answers without checks (an older or simulated one)
leaves the BMC unchecked, which is no failure. ``enroll.readBmc`` sends ``management.inventory``
and keeps what the BMC says of the machine on the node: its power state and ``bmcInventory``
(system: maker, model, serial, UUID; processors; memory; NICs); a node enrolled without MACs
takes its NICs' MACs (none another node has), so that it can network-boot. Both are relaying steps, like the
BMC steps: the engine adds the node's BMC and credential reference to their commands.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.manifest import manifest
from better_compute.provision.steps import define_step
from better_compute.wire.commands import BmcInventoryResult, decode_result
from better_compute.wire.metal import MAC_PATTERN, normal_mac

from ..commands import BMC, MANAGEMENT_INVENTORY, MANAGEMENT_VALIDATE
from ._relay import relay, workflow_node

__all__ = ["ENROLL_STEPS", "STORE_BMC_INVENTORY", "enroll_read_bmc", "enroll_validate_bmc"]

# $4: the MACs of the NICs the BMC reports. A node enrolled without MACs takes them (Ironic's
# out-of-band inspection makes its ports so): the BMC answered with the node's own credential, so
# they are the machine's, not a claim off the boot network. A node with MACs keeps its own, and no
# MAC another node has is taken (then none is).
STORE_BMC_INVENTORY: Final = """
UPDATE nodes SET bmc_inventory = $2::jsonb, power_state = coalesce($3, power_state),
    macs = CASE WHEN macs = '{}' AND NOT EXISTS (
                    SELECT 1 FROM nodes o WHERE o.id <> $1 AND o.macs && $4::text[])
                THEN $4::text[] ELSE macs END,
    updated_at = now()
WHERE id = $1
RETURNING macs
"""


_MAC: Final = re.compile(MAC_PATTERN)


def _given_bmc(step_input: dict[str, Any]) -> dict[str, Any]:
    return {"bmc": step_input["bmc"]} if step_input.get("bmc") is not None else {}


async def _validate(step_input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    node = workflow_node(ctx, "enroll.validateBmc")
    done = await relay(ctx, kind=MANAGEMENT_VALIDATE.name, payload=_given_bmc(step_input))
    answer = done["result"]
    listed = answer.get("checks") if isinstance(answer, dict) else None
    checks = [c for c in listed if isinstance(c, dict)] if isinstance(listed, list) else []
    failed = [c for c in checks if c.get("status") == "failed"]
    if failed:
        said = "; ".join(f"{c.get('check')}: {c.get('message')}" for c in failed)
        raise BcError(
            ErrorCode.DRIVER_ERROR,
            f"the BMC of node {node.id} failed validation: {said}; fix it with bcx nodes update"
            f" {node.id} --bmc … --bmc-credentials-file …",
            {"path": "bmc", "reason": "bmc-invalid", "checks": checks, "commandId": done["commandId"]},
        )
    return {"commandId": done["commandId"], "checks": checks, "checked": bool(checks)}


def _summary(inventory: dict[str, Any]) -> dict[str, Any]:
    found = inventory.get("system")
    system: dict[str, Any] = found if isinstance(found, dict) else {}
    keep = ("manufacturer", "model", "serial", "uuid")
    return {k: system.get(k) for k in keep if system.get(k)}


async def _read(step_input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    node = workflow_node(ctx, "enroll.readBmc")
    done = await relay(ctx, kind=MANAGEMENT_INVENTORY.name, payload=_given_bmc(step_input))
    answer = done["result"]
    system = answer.get("system") if isinstance(answer, dict) else None
    if not isinstance(system, dict):
        # an agent that answers without an inventory (a simulated one): nothing to keep
        return {"commandId": done["commandId"], "powerState": None, "system": {}}
    power = system.get("powerState")
    power = power.lower() if isinstance(power, str) and power.lower() in ("on", "off") else None
    # The same answer on a re-run: writing it again changes nothing.
    rows = await ctx.sql.query(STORE_BMC_INVENTORY, node.id, json.dumps(answer), power, _nic_macs(answer))
    macs = list(rows[0]["macs"]) if rows else []
    return {"commandId": done["commandId"], "powerState": power, "system": _summary(answer), "macs": macs}


def _nic_macs(inventory: dict[str, Any]) -> list[str]:
    """The NICs' MACs the BMC reports (``aa:bb:…``), each once, in its order."""
    read = decode_result(MANAGEMENT_INVENTORY.name, inventory)
    nics = read.nics if isinstance(read, BmcInventoryResult) else []
    return list(dict.fromkeys(normal_mac(n.mac) for n in nics if n.mac and _MAC.match(n.mac)))


enroll_validate_bmc = define_step(
    id="enroll.validateBmc",
    runs_on="control-plane",
    relays=["site"],
    sends=[MANAGEMENT_VALIDATE.name],
    timeout="2m",
    input=manifest({"bmc": BMC.optional()}),
    run=_validate,
    retry_safe=True,
    description="Check the node's BMC (management.validate); fail, naming each failed check, if one failed",
)

enroll_read_bmc = define_step(
    id="enroll.readBmc",
    runs_on="control-plane",
    relays=["site"],
    sends=[MANAGEMENT_INVENTORY.name],
    timeout="5m",
    input=manifest({"bmc": BMC.optional()}),
    run=_read,
    retry_safe=True,
    description=(
        "Read the machine through its BMC (management.inventory): keep its power and bmcInventory;"
        " a node without MACs takes its NICs'"
    ),
)

ENROLL_STEPS: Final = (enroll_validate_bmc, enroll_read_bmc)
