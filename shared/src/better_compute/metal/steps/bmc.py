"""The BMC steps: ``power.setPower``, ``management.setBootDevice``, ``media.insert``,
``media.eject`` and ``power.getPower`` (a read: the BMC answers, and with what power state).

Each is a relaying step (``relays: ['site']``): it runs in the engine, where the node record
is, and sends the BMC command kind of the same name to the node's site agent. The step's own
``with.bmc`` goes as given; without one the engine adds the node's BMC (address and credential
reference) to the command, as it does for every BMC command (``bc_engine.metal.relay``, the one place
that does). None is destructive, so none waits for a quorum.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.manifest import Manifest, field, manifest
from better_compute.core.plugins import DOTTED_NAME_PATTERN
from better_compute.provision.results import latest_result
from better_compute.provision.steps import Step, define_step
from better_compute.wire.commands import (
    BmcInventoryResult,
    MediaEject,
    MediaInsert,
    SetBootDevice,
    SetPower,
    decode_payload,
    decode_result,
)

from ..commands import (
    BMC,
    MANAGEMENT_INVENTORY,
    MANAGEMENT_SET_BOOT_DEVICE,
    MANAGEMENT_VALIDATE,
    MEDIA_EJECT,
    MEDIA_INSERT,
    POWER_SET_POWER,
)
from ._relay import relay, workflow_node

__all__ = [
    "BMC_STEPS",
    "management_set_boot_device",
    "management_validate",
    "media_eject",
    "media_insert",
    "power_get_power",
    "power_set_power",
]

BMC_TIMEOUT: Final = "10m"


def _input(kind_payload: Manifest, **changes: Any) -> Manifest:
    """The command kind's payload with ``bmc`` optional (the node's is used when absent)."""
    fields = {**kind_payload.fields, "bmc": BMC.optional(), **changes}
    return manifest(fields)


def _bmc_step(
    kind: str,
    payload: Manifest,
    description: str,
    *,
    timeout: str = BMC_TIMEOUT,
    into: type[msgspec.Struct] | None = None,
) -> Step:
    """A step that sends the BMC command ``kind``: its ``with`` decoded into the kind's payload
    Struct ``into`` (``bmc`` absent: the engine adds the node's), or relayed as checked."""

    async def run(step_input: dict[str, Any], ctx: Any) -> dict[str, Any]:
        command = decode_payload(step_input, into, path="with") if into is not None else step_input
        done = await relay(ctx, kind=kind, payload=command)  # the engine adds the node's BMC
        return {**done, **{k: v for k, v in step_input.items() if k != "bmc"}}

    return define_step(
        id=kind,
        runs_on="control-plane",
        relays=["site"],
        sends=[kind],
        timeout=timeout,
        input=_input(payload),
        run=run,
        retry_safe=True,
        description=description,
    )


power_set_power = _bmc_step(
    POWER_SET_POWER.name,
    POWER_SET_POWER.payload,
    "Change the node's power state through its BMC",
    into=SetPower,
)
management_set_boot_device = _bmc_step(
    MANAGEMENT_SET_BOOT_DEVICE.name,
    MANAGEMENT_SET_BOOT_DEVICE.payload,
    "Set the node's next boot device through its BMC",
    into=SetBootDevice,
)
media_eject = _bmc_step(
    MEDIA_EJECT.name, MEDIA_EJECT.payload, "Eject the node's virtual medium", into=MediaEject
)
management_validate = _bmc_step(
    MANAGEMENT_VALIDATE.name,
    MANAGEMENT_VALIDATE.payload,
    "Check the node's BMC (it answers, takes the credentials, has the system, reads power): no change",
    timeout="2m",
)


async def _insert(step_input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    url, sha256 = step_input.get("url"), step_input.get("sha256")
    source = step_input.get("fromStep")
    if source is not None:
        if url is not None:
            raise BcError(ErrorCode.INVALID_INPUT, "give url or fromStep, not both", {"path": "fromStep"})
        # From the store, by workflow and action: a re-run on another engine finds the same.
        earlier = await latest_result(ctx.sql, ctx.workflow_id, source, path="fromStep")
        url = earlier.get("url") if isinstance(earlier, dict) else None
        if not isinstance(url, str):
            raise BcError(
                ErrorCode.INVALID_INPUT,
                f"step {source} returned no url to insert",
                {"path": "fromStep", "fromStep": source},
            )
        if sha256 is None and isinstance(earlier.get("sha256"), str):
            sha256 = earlier["sha256"]
    if url is None:
        raise BcError(ErrorCode.INVALID_INPUT, "give url or fromStep", {"path": "url"})
    # without bmc the engine adds the node's
    doc = {"url": url, "device": step_input["device"], "sha256": sha256, "bmc": step_input.get("bmc")}
    command = decode_payload(doc, MediaInsert, path="with")
    done = await relay(ctx, kind=MEDIA_INSERT.name, payload=command)
    return {**done, "url": url, "device": step_input["device"]}


media_insert = define_step(
    id=MEDIA_INSERT.name,
    runs_on="control-plane",
    relays=["site"],
    sends=[MEDIA_INSERT.name],
    timeout=BMC_TIMEOUT,
    input=_input(
        MEDIA_INSERT.payload,
        url=MEDIA_INSERT.payload.fields["url"].optional(),
        fromStep=field.string(pattern=DOTTED_NAME_PATTERN).optional(),
    ),
    run=_insert,
    retry_safe=True,
    description="Insert a virtual medium: a url, or the url an earlier step (fromStep) returned",
)

STORE_POWER: Final = (
    "UPDATE nodes SET power_state = $2, updated_at = now() WHERE id = $1 AND power_state IS DISTINCT FROM $2"
)


async def _get_power(step_input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    node = workflow_node(ctx, "power.getPower")
    command: dict[str, Any] = {}
    if step_input.get("bmc") is not None:
        command["bmc"] = step_input["bmc"]  # else the engine adds the node's
    done = await relay(ctx, kind=MANAGEMENT_INVENTORY.name, payload=command)
    answer = decode_result(MANAGEMENT_INVENTORY.name, done["result"])
    power = answer.system.power_state if isinstance(answer, BmcInventoryResult) else None
    if power is None or power.lower() not in ("on", "off"):
        raise BcError(
            ErrorCode.DRIVER_ERROR,
            f"the BMC of node {node.id} did not say whether the machine is on",
            {"path": "result.system.powerState", "commandId": done["commandId"], "reason": "no-power-state"},
        )
    await ctx.sql.query(STORE_POWER, node.id, power.lower())
    return {"commandId": done["commandId"], "powerState": power.lower()}


power_get_power = define_step(
    id="power.getPower",
    runs_on="control-plane",
    relays=["site"],
    sends=[MANAGEMENT_INVENTORY.name],
    timeout=BMC_TIMEOUT,
    input=manifest({"bmc": BMC.optional()}),
    run=_get_power,
    retry_safe=True,
    description="Read the node's power state through its BMC (management.inventory): the BMC answers",
)

BMC_STEPS: Final = (
    power_set_power,
    management_set_boot_device,
    media_insert,
    media_eject,
    power_get_power,
    management_validate,
)
