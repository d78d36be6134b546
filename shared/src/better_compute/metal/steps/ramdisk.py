"""``metal.ensureRamdisk``: boot the node into the bcd ramdisk.

Three things in sequence, each its own command of this step attempt with its own key, so a
re-run (after a crash, or a wake-up while one still runs) finds the ones already done and sends
nothing twice:

1. ``management.setBootDevice`` ``pxe``, one time (key ``boot-device``);
2. a ``netboot.setEntry`` per MAC of the node, one time (key ``netboot-<n>``);
3. ``power.setPower`` ``cycle`` (key ``power-cycle``).

The ramdisk's bcd joins with a single-use ``node`` join token bound to the node (its agent id is
the node id) and to the MAC it boots from. The token is ``held``: the certificate a join gets is
``pending`` (it counts for nothing) until the site agent reports the boot entry closed clean,
so whoever asked for the entry before the machine never becomes the node (docs/security.md).
The step mints it under its attempt's key (``ctx.pki``, so a re-run gets the same token back
through the attempt's mint secret), stores it through ``ctx.secrets`` and sends only the
reference: each boot entry carries ``joinTokenRef``,
which the site agent resolves through the secrets gate (sealed) while it installs the entry, and
it adds ``bcd.token=`` to the command line it serves that MAC. The token is in no command payload,
step result or log. A retry's new attempt mints a new token; the superseded attempt's token and
secret are revoked by the engine.

A node whose BMC says ``tokenDelivery: media`` (Redfish virtual media) gets its token another
way, never on the boot network: the token is minted without ``held``, and a ``media.insert``
(key ``media-insert``, before the boot device and the power cycle) carries ``joinTokenRef``:
the site agent builds a small ISO labelled ``BCBOOT`` holding it and serves it once, to the
BMC alone (bc_site_agent.media). The boot entries then carry no token and are not one-time
(whoever asks first takes nothing, and the machine still finds its entry), and the kernel line
says ``bcd.token_from=media``: bcd reads the token from that medium. ``wait.agentJoined``
ejects the medium and clears the entries once the node joined. The step's result says which
(``tokenDelivery``).

The ramdisk (kernel and initrd, or an iPXE script) comes from the step's ``with``; metal's
shipped profiles fill it from ``metal(ramdisk=Ramdisk(...))`` or ``[ramdisk]`` of bc.toml. A
ramdisk an operator set while the engines run (``bcx ramdisk set``, the engine's
``ramdisk_override``) is read at each attempt's first run and wins for the shipped lifecycle
profiles, and for any step whose ``with`` names no ramdisk (``ramdisk_in_force``): no restart.
``[ramdisk]`` edited in bc.toml while the engines run is read there too (``configured_in_force``):
the steps that boot the ramdisk the engines started with boot the new one. An attempt's later
runs take what its first run found (its commands carry that ramdisk).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.manifest import manifest
from better_compute.provision.steps import define_step
from better_compute.wire.commands import MediaInsert, SetBootDevice, SetPower, decode_payload
from better_compute.wire.metal import NodeBmc

from ..commands import (
    BMC,
    MANAGEMENT_SET_BOOT_DEVICE,
    MEDIA_INSERT,
    NETBOOT_SET_ENTRY,
    POWER_SET_POWER,
)
from ._relay import relay, workflow_node
from .profiles import LIFECYCLE_PROFILE_IDS

__all__ = [
    "RAMDISK_FIELDS",
    "RAMDISK_OVERRIDE",
    "configured_in_force",
    "ensure_ramdisk",
    "ramdisk_in_force",
    "token_delivery",
]

STEP_ID: Final = "metal.ensureRamdisk"
TOKEN_TTL_SECONDS: Final = 3600  # the step's own deadline is 15 minutes; the join follows it
RAMDISK_FIELDS: Final = ("kernel", "initrd", "kernelSha256", "initrdSha256", "cmdline", "script")
_ENTRY = NETBOOT_SET_ENTRY.payload.fields
# row 1: the operator's (bcx ramdisk set); row 2: [ramdisk] of bc.toml changed while the engines
# run, {doc, replaces} (the engine's reload; engine migration 0010)
RAMDISK_OVERRIDE: Final = "SELECT id, doc FROM ramdisk_override ORDER BY id"
_WORKFLOW_PROFILE: Final = "SELECT profile_id FROM workflows WHERE id = $1"


def ramdisk_in_force(
    step_input: Mapping[str, Any], override: Mapping[str, Any] | None, *, shipped: bool
) -> dict[str, Any]:
    """The step's input with the ramdisk it boots: the operator's ``override`` (``bcx ramdisk
    set``) for a shipped lifecycle profile or a step whose ``with`` names no ramdisk, else the
    step's own."""
    own = bool(step_input.get("kernel") or step_input.get("script"))
    if override is None or (own and not shipped):
        return dict(step_input)
    rest = {k: v for k, v in step_input.items() if k not in RAMDISK_FIELDS}
    return {**rest, **{k: override[k] for k in RAMDISK_FIELDS if override.get(k) is not None}}


def _ramdisk_of(step_input: Mapping[str, Any]) -> dict[str, Any]:
    return {k: step_input[k] for k in RAMDISK_FIELDS if step_input.get(k) not in (None, "")}


def configured_in_force(step_input: Mapping[str, Any], change: Mapping[str, Any]) -> dict[str, Any]:
    """The step's input with ``[ramdisk]`` as bc.toml says now, when it changed while the engines
    run (``change``: ``doc``, the new one, and ``replaces``, the one the engines started with): a
    step that boots what the engines started with (the shipped profiles' ramdisk came from
    ``[ramdisk]``), or no ramdisk at all, boots the new one; any other keeps its own (an app's
    ``metal(ramdisk=…)``, a custom profile's)."""
    if _ramdisk_of(step_input) != _ramdisk_of(change.get("replaces") or {}):
        return dict(step_input)
    rest = {k: v for k, v in step_input.items() if k not in RAMDISK_FIELDS}
    return {**rest, **_ramdisk_of(change.get("doc") or {})}


async def _with_override(step_input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    docs, shipped = await ctx.once("metal.ramdisk_in_force", lambda: _found(ctx))
    override = docs.get(1)
    if override is None:
        change = docs.get(2)
        return configured_in_force(step_input, change) if change is not None else step_input
    return ramdisk_in_force(step_input, override, shipped=shipped)


async def _found(ctx: Any) -> tuple[dict[int, Any], bool]:
    """The ``ramdisk_override`` rows, and whether the workflow runs a shipped lifecycle profile.
    Read by the attempt's first run (``ctx.once``): its later runs, one at each of its commands'
    ends, take the same, and its commands carry that ramdisk; a ``bcx ramdisk set`` meanwhile is
    for the next attempt."""
    rows = await ctx.sql.query(RAMDISK_OVERRIDE)
    docs = {r["id"]: json.loads(r["doc"]) if isinstance(r["doc"], str) else r["doc"] for r in rows}
    shipped = False
    if docs.get(1) is not None:
        profile = await ctx.sql.query(_WORKFLOW_PROFILE, ctx.workflow_id)
        shipped = bool(profile) and profile[0]["profile_id"] in LIFECYCLE_PROFILE_IDS.values()
    return docs, shipped


async def _run(step_input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    node = workflow_node(ctx, STEP_ID)
    step_input = await _with_override(step_input, ctx)
    if not step_input.get("kernel") and not step_input.get("script"):
        raise BcError(
            ErrorCode.INVALID_CONFIG,
            f"{STEP_ID} needs the ramdisk and none is configured: set one with `bcx ramdisk set"
            " --kernel URL --initrd URL` (every engine, at once), or build it with `bcx ramdisk"
            " build`, which `bcx dev up` then serves (restart the stack), or set [ramdisk] kernel and"
            " initrd in bc.toml (docs/settings.md); a profile's own step may give kernel (and"
            " initrd) or script",
            {"path": "kernel"},
        )
    macs = list(getattr(node, "macs", ()) or ())
    if not macs:
        raise BcError(
            ErrorCode.INVALID_STATE,
            f"node {node.id} has no MAC address to network-boot",
            {"path": "macs", "reason": "no-macs", "nodeId": node.id},
        )
    # the step's own bmc, else None: the engine adds the node's
    bmc = (
        decode_payload(step_input["bmc"], NodeBmc, path="bmc") if step_input.get("bmc") is not None else None
    )
    entry = {k: step_input[k] for k in RAMDISK_FIELDS if step_input.get(k) is not None}
    if ctx.pki is None or ctx.secrets is None:
        raise BcError(
            ErrorCode.INVALID_CONFIG, f"{STEP_ID} needs the pki and secrets services", {"path": "pki"}
        )
    delivery = token_delivery(bmc.to_document() if bmc is not None else node.bmc)
    on_media = delivery == "media"
    token = await ctx.pki.issue_join_token(
        tenant_id=node.tenant_id,
        role="node",
        site_id=node.site_id,
        ttl_seconds=TOKEN_TTL_SECONDS,
        max_uses=1,
        expect={"mac": macs[0]},  # a machine's claims show every NIC's MAC
        # served on the boot network: its join is pending until the entry closes clean; on a
        # medium only the BMC fetched, the join counts at once
        held=not on_media,
    )
    token_ref = await ctx.secrets.put(
        token.token.encode(), idempotency_key="ramdisk-join-token", label="ramdisk join token"
    )
    cmdline = _with_control_plane(entry.get("cmdline", ""), ctx)
    if on_media:
        cmdline = f"{cmdline} bcd.token_from=media".strip()
    if cmdline:
        entry["cmdline"] = cmdline

    medium = None
    if on_media:
        medium = await relay(
            ctx,
            kind=MEDIA_INSERT.name,
            payload=MediaInsert(device="cd", join_token_ref=token_ref, bmc=bmc),
            key="media-insert",
        )
    boot = await relay(
        ctx,
        kind=MANAGEMENT_SET_BOOT_DEVICE.name,
        payload=SetBootDevice(device="pxe", persistent=False, bmc=bmc),
        key="boot-device",
    )
    entries = []
    # On a medium, the entry holds nothing secret: anyone may fetch it, any number of times, so
    # a host that asks before the machine takes nothing and leaves the machine its boot;
    # wait.agentJoined clears it with the medium. Otherwise it is one-time and carries the token.
    by_ref = {"oneTime": False} if on_media else {"oneTime": True, "joinTokenRef": token_ref}
    for index, mac in enumerate(macs):
        done = await relay(
            ctx,
            kind=NETBOOT_SET_ENTRY.name,
            payload={**entry, "mac": mac, **by_ref},
            key=f"netboot-{index}",
        )
        entries.append({"mac": mac, "commandId": done["commandId"]})
    cycle = await relay(
        ctx, kind=POWER_SET_POWER.name, payload=SetPower(action="cycle", bmc=bmc), key="power-cycle"
    )
    return {
        "joinTokenId": token.join_token_id,
        "tokenDelivery": delivery,
        **({"mediaInsertCommand": medium["commandId"]} if medium is not None else {}),
        "bootDeviceCommand": boot["commandId"],
        "netbootEntries": entries,
        "powerCycleCommand": cycle["commandId"],
    }


def token_delivery(bmc: Any) -> str:
    """How the ramdisk gets its token for a node with this BMC (its document): ``media`` when
    the BMC says so (``tokenDelivery``, Redfish or the simulator only), else ``network``."""
    if isinstance(bmc, dict) and bmc.get("tokenDelivery") == "media" and bmc.get("driver") != "ipmi":
        return "media"
    return "network"


def _with_control_plane(cmdline: str, ctx: Any) -> str:
    """The command line with ``bcd.control_plane=`` (the user data's control-plane URL) when the
    ramdisk's own does not say where bcd joins."""
    settings = getattr(getattr(ctx, "provision", None), "user_data", None)
    url = getattr(settings, "control_plane_url", None)
    if not url or "bcd.control_plane=" in cmdline:
        return cmdline
    return f"{cmdline} bcd.control_plane={url}".strip()


ensure_ramdisk = define_step(
    id=STEP_ID,
    runs_on="control-plane",
    relays=["site"],
    sends=[MEDIA_INSERT.name, MANAGEMENT_SET_BOOT_DEVICE.name, NETBOOT_SET_ENTRY.name, POWER_SET_POWER.name],
    timeout="15m",
    input=manifest({**{k: _ENTRY[k] for k in RAMDISK_FIELDS}, "bmc": BMC.optional()}),
    run=_run,
    retry_safe=True,
    description="Boot the node into the bcd ramdisk: one-time PXE, a boot entry per MAC, a power cycle",
)
