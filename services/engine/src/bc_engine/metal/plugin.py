"""Metal as a plug-in of the engine: what it adds goes through the engine's hooks
(``steps.hooks.EngineHooks``), as an app plugin's owner reconcilers do.

* owners ``metal`` (a lifecycle verb's workflow ended: the node moves on), ``metal-host`` (a host
  section goes to bcd), ``metal-undo`` (an abort's boot set-up is undone) and ``metal-discovery``
  (a discovered node's inventory and enrolment by rule);
* a settled ``host:g…`` or ``discovery:…`` command wakes its node's ``metal-host`` or
  ``metal-discovery`` key;
* what a command says of its node (power, observed generation) is kept on the node;
* a BMC command gets its node's BMC (``relay``);
* bc-pki's ``join`` events: a discovery join records a discovered node, a burned token quarantines
  its node;
* the discovery sweep beside the reconciler; the image signers' allowlist written at the start;
* the ``metal.*``, ``images.*`` and ``enrollmentRules.*`` routes.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any, Final

from nats.aio.msg import Msg

from better_compute.config import ImagesSettings, RamdiskSettings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.metal.module import configured_ramdisk
from better_compute.service import Handler
from better_compute.wire.pki import JoinAccepted, JoinTokenBurned, JoinTokenConfirmed, decode_join_event

from ..steps.hooks import EngineHooks
from ..steps.node import NodeInfo
from .api import MetalApi
from .discovery import discovery_sweep, inventory_discovered, on_join, refuse_discovered
from .host import MetalHost
from .images_api import ImagesApi, allowlist, image_signers, write_image_signers
from .lifecycle import converge_host, reconcile_metal, record_command_result, reopen_node, undo_aborted
from .names import (
    DISCOVERY_KEY_PREFIX,
    DISCOVERY_OWNER,
    HOST_KEY_PREFIX,
    HOST_OWNER,
    JOIN_EVENTS,
    METAL_OWNER,
    UNDO_OWNER,
)
from .node_events import node_event
from .quarantine import quarantine_node, refuse_maintenance
from .ramdisk_api import RamdiskApi
from .relay import needs_bmc, relay_bmc
from .rules import EnrollmentRulesApi

__all__ = ["BmcRelay", "MetalPlugin", "check_rerun", "check_start"]


def check_start(node: Any, owner: str | None) -> None:
    """No workflow on a discovered node, nor on one in maintenance; on a quarantined one only
    metal's verbs (they check it themselves: inspect and retire are the ways out)."""
    refuse_discovered(node)
    held = refuse_maintenance(node, "start a workflow")
    if held is not None:
        raise held
    if owner != METAL_OWNER and node["quarantine"] is not None:
        raise BcError(
            ErrorCode.INVALID_STATE,
            f"node {node['id']} is quarantined: inspect or retire it first",
            {"path": "nodeId", "reason": "node-quarantined"},
        )


def check_rerun(node: Any, verb: str) -> None:
    """No retry or resume of a workflow on a node in maintenance."""
    held = refuse_maintenance(node, verb)
    if held is not None:
        raise held


class BmcRelay:
    """The payload filler that adds the node's BMC to a BMC command (``relay``)."""

    def __init__(self, host: MetalHost) -> None:
        self._host = host

    def needs(self, kind: str, payload: Any) -> bool:
        return needs_bmc(self._host.app, kind, payload)

    def fill(self, kind: str, payload: Any, node_id: str, node: NodeInfo | None) -> Any:
        return relay_bmc(self._host.app, kind, payload, node_id, node.bmc if node is not None else None)


# [ramdisk] of bc.toml changed while the engines run (row 2, migration 0010; row 1 is the
# operator's): $1 {doc, replaces}
_SET_CONFIGURED_RAMDISK: Final = (
    "INSERT INTO ramdisk_override (id, doc, set_by) VALUES (2, $1::jsonb, NULL)"
    " ON CONFLICT (id) DO UPDATE SET doc = EXCLUDED.doc, updated_at = now()"
)
_DROP_CONFIGURED_RAMDISK: Final = "DELETE FROM ramdisk_override WHERE id = 2"


def _ramdisk_with(settings: RamdiskSettings | None) -> dict[str, Any]:
    """What ``[ramdisk]`` puts in the shipped profiles' ``metal.ensureRamdisk`` step."""
    ramdisk = configured_ramdisk(settings) if settings is not None else None
    return ramdisk.to_with() if ramdisk is not None else {}


class MetalPlugin:
    def __init__(
        self, host: MetalHost, *, images: ImagesSettings, ramdisk: RamdiskSettings | None = None
    ) -> None:
        self.host = host
        self.images = images
        self.started_ramdisk = _ramdisk_with(ramdisk)
        """``[ramdisk]`` as this engine started with it (what its shipped profiles boot)."""

    def register(self, hooks: EngineHooks) -> None:
        """Metal's owners, wake-ups, command facts, BMC relay, event handlers and side loop."""
        hooks.owners.update(
            {
                METAL_OWNER: reconcile_metal,
                HOST_OWNER: converge_host,
                UNDO_OWNER: undo_aborted,
                DISCOVERY_OWNER: inventory_discovered,
            }
        )
        hooks.wake_prefixes.update({HOST_KEY_PREFIX: HOST_OWNER, DISCOVERY_KEY_PREFIX: DISCOVERY_OWNER})
        hooks.command_settled.append(partial(record_command_result, self.host))
        hooks.payload_fillers.append(BmcRelay(self.host))
        hooks.on_event(JOIN_EVENTS, self.on_join)
        hooks.side_loops["discovery_sweep"] = lambda: discovery_sweep(self.host)
        hooks.host_config_owner = METAL_OWNER
        hooks.start_checks.append(check_start)
        hooks.rerun_checks.append(check_rerun)
        hooks.reopen.append(self.reopen)

    def routes(self, engine_api: Any, quorum: Any) -> dict[str, Handler]:
        """``metal.*``, ``images.*`` and ``enrollmentRules.*``: ``engine_api`` starts the verbs'
        workflows (``EngineApi``), ``quorum`` makes their batches."""
        routes: dict[str, Handler] = {
            **ImagesApi(app=self.host.app, db=self.host.db).routes(),
            **MetalApi(engine_api, quorum).routes(),
            **EnrollmentRulesApi(self.host.db, self.host).routes(),
            **RamdiskApi(self.host.db).routes(),
        }
        return routes

    async def start(self) -> None:
        """Before the routes answer: the image signers' allowlist (``[images] signers`` and the
        plugins' signers)."""
        await write_image_signers(self.host.db, allowlist(self.host.app, image_signers(self.images)))

    async def use_images(self, images: ImagesSettings) -> None:
        """A new ``[images]`` (the config file changed): its signers checked, then written as the
        catalog's allowlist.

        Raises:
            BcError: ``INVALID_CONFIG`` at ``images.signers[i]…``: the allowlist stays as it was.
        """
        signers = allowlist(self.host.app, image_signers(images))
        await write_image_signers(self.host.db, signers)
        self.images = images

    def check(self, images: ImagesSettings, ramdisk: RamdiskSettings) -> None:
        """Raise what ``use_images`` and ``use_ramdisk`` would, changing nothing (a config file
        read again is applied whole or not at all)."""
        allowlist(self.host.app, image_signers(images))
        _ramdisk_with(ramdisk)

    async def use_ramdisk(self, ramdisk: RamdiskSettings) -> None:
        """A new ``[ramdisk]`` (the config file changed): the steps that boot the one the engines
        started with boot this one from their next run, every engine (row 2 of
        ``ramdisk_override``); back to the start's, the row goes. ``bcx ramdisk set`` still wins.

        Raises:
            BcError: ``INVALID_CONFIG`` at ``ramdisk.<key>``: nothing changes.
        """
        now = _ramdisk_with(ramdisk)
        if now == self.started_ramdisk:
            await self.host.db.execute(_DROP_CONFIGURED_RAMDISK)
        else:
            change = {"doc": now, "replaces": self.started_ramdisk}
            await self.host.db.execute(_SET_CONFIGURED_RAMDISK, json.dumps(change))

    async def reopen(self, conn: Any, wf: Any) -> None:
        """A retried or resumed metal workflow: its node back from ``failed`` to the verb's
        ``…ing`` state, and its batch, closed by its failure or abort (``lifecycle.close_batch``),
        open again, or the workflow waits for approvals it can no longer get."""
        node = await reopen_node(conn, wf)
        if node is not None:
            await node_event(self.host.publish, node, verb="retry")
        if wf["batch_id"] is not None and wf["owner"] == METAL_OWNER:
            await self.host.cmdq.reopen_batch(id=wf["batch_id"])

    async def on_join(self, msg: Msg) -> None:
        """A burned join token quarantines its node; a discovery join records a discovered node
        (another role's join is the engine's own business: its node's workflows are woken)."""
        match decode_join_event(msg.data):
            case JoinTokenBurned() as burned:
                await quarantine_node(self.host, burned)
            case JoinAccepted(role=role) if role != "discovery":
                return
            case JoinTokenConfirmed():
                return  # the engine's own: the node's workflows are woken
            case _:
                await on_join(self.host, msg)
