"""``wait.agentJoined``: wait until the node's own agent (bcd) joined.

A join is a certificate bc-pki issued for the node (a node's agent id is the node id, since
tokens a step mints are bound to the workflow's node) with the asked role, issued after the
attempt of the step before this one started (the step that boots the machine): a join from an
earlier boot (the ramdisk's, before the installed OS comes up) does not count, and a join that
beats the engine's settling of the booting step does. Role ``node`` also accepts
``provisioned``: the installed OS joins with the single-use ``provisioned`` token of
``userdata.render`` and re-keys the same node.

For a node whose ramdisk token came on a virtual medium (``tokenDelivery: media``), the step
ejects it (``media.eject``, key ``media-eject``) and clears its boot entries, which were not
one-time (``netboot.clearEntry``, keys ``clear-<n>``), once the join counts.

A ``pending`` certificate (a join with the ramdisk's held token, before the site agent reported
the boot entry closed clean) does not count: whoever asked for the entry first may have made it.

The step reads bc-pki each time it runs (``step_not_ready`` between looks), so it holds nothing
in memory and a re-run on another engine decides the same. It is event-driven: the engine runs it
again as soon as the node joins or its held join is confirmed (bc-pki's join events wake the
node's workflows). Under a lost event (an engine away from NATS when it came) lie two nets: the
engine's join watch (one look at bc-pki's new certificates every 10 s, in bulk, only while some
step of it waits for a join: nothing per machine, and nothing at all at rest) and this step's own
look every ``POLL_MS``. It was every 2 s: at a thousand machines waiting, 500 requests a second to
bc-pki, each a step run of the engine, for joins the events had already announced.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Final

from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.manifest import field, manifest
from better_compute.provision.steps import define_step
from better_compute.provision.waiting import step_not_ready
from better_compute.wire.commands import ClearEntry, MediaEject

from ..commands import MEDIA_EJECT, NETBOOT_CLEAR_ENTRY
from ._relay import relay, workflow_node
from .ramdisk import token_delivery

__all__ = ["ACCEPTED_ROLES", "JOINED_SINCE", "POLL_MS", "STEP_ID", "wait_agent_joined"]

STEP_ID: Final = "wait.agentJoined"
POLL_MS: Final = 120_000
ACCEPTED_ROLES: Final = {"node": ("node", "provisioned"), "provisioned": ("provisioned",)}
# When the attempt of the step before this one started (or the workflow began, for the first
# step): that step is what boots the machine (a power cycle, the ramdisk), and the machine may
# join as soon as that step's command ran, before the engine has settled the step. Seen twice:
# on the metal simulator a fast ramdisk joined 40 ms before metal.ensureRamdisk settled, and in
# the kill-point sweep a site agent killed after running the power-on and before reporting it
# let the join come first; counting from the step's end made the step wait for a join that had
# already happened, until its timeout.
JOINED_SINCE: Final = (
    "SELECT coalesce((SELECT started_at FROM workflow_steps WHERE workflow_id = $1 AND idx = $2 - 1),"
    " (SELECT created_at FROM workflows WHERE id = $1)) AS since"
)


async def _run(step_input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    node = workflow_node(ctx, STEP_ID)
    if ctx.pki is None:
        raise BcError(ErrorCode.INVALID_CONFIG, f"{STEP_ID} needs the pki service", {"path": "pki"})
    roles = ACCEPTED_ROLES[step_input["role"]]
    since: datetime | None = None
    if step_input["fresh"]:
        rows = await ctx.sql.query(JOINED_SINCE, ctx.workflow_id, ctx.step)
        since = rows[0]["since"] if rows else None
    held = False
    for cert in await ctx.pki.certificates(agent_id=node.id):
        if cert.role not in roles or (since is not None and cert.created_at < since):
            continue
        if getattr(cert, "state", "valid") == "pending":
            held = True
        if getattr(cert, "state", "valid") != "valid":
            continue
        found = {
            "agentId": node.id,
            "certId": cert.cert_id,
            "role": cert.role,
            "joinedAt": cert.created_at.isoformat(),
        }
        if step_input["fresh"] and token_delivery(node.bmc) == "media":
            # the ramdisk's token medium (metal.ensureRamdisk): spent, out it goes
            ejected = await relay(
                ctx, kind=MEDIA_EJECT.name, payload=MediaEject(device="cd"), key="media-eject"
            )
            found["mediaEjectCommand"] = ejected["commandId"]
            for index, mac in enumerate(node.macs):  # its boot entries were not one-time
                await relay(
                    ctx, kind=NETBOOT_CLEAR_ENTRY.name, payload=ClearEntry(mac=mac), key=f"clear-{index}"
                )
        return found
    after = f" since {since.strftime('%Y-%m-%dT%H:%M:%SZ')}" if since is not None else ""
    if held:
        raise step_not_ready(
            POLL_MS,
            reason=f"an agent of node {node.id} joined; it is held until the site agent reports the"
            " node's boot entry closed clean (no other ask within its quiet period)",
        )
    raise step_not_ready(POLL_MS, reason=f"no {' or '.join(roles)} agent of node {node.id} joined{after} yet")


wait_agent_joined = define_step(
    id=STEP_ID,
    runs_on="control-plane",
    relays=["site"],
    sends=[MEDIA_EJECT.name, NETBOOT_CLEAR_ENTRY.name],
    timeout="30m",
    input=manifest(
        {
            "role": field.enum(list(ACCEPTED_ROLES)).default("node"),
            # False: any valid join of the node counts (adopting a machine that runs already).
            "fresh": field.bool().default(True),
        }
    ),
    run=_run,
    retry_safe=True,
    description="Wait until the node's agent joined (since the step before this one finished)",
)
