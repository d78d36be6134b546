"""Quarantine: a node whose ramdisk token was seen twice stops where it is, visibly.

bc-pki publishes ``JoinTokenBurned`` (``bc.events.join.<token id>``) when a site agent saw a
node's one-time boot entry asked for again, or a second join tried the node's single-use token
(``bc_pki.burns``). Nobody can tell which of the two askers was the machine, so the node is
trusted with nothing until an operator looks:

* ``quarantine`` on the node says why (``bcx nodes get``, ``bcx why``), and a node event with
  verb ``quarantine`` goes on the feed;
* the metal workflow running on it is aborted (so the node goes ``failed`` naming it, and the
  abort's clean-up revokes what the workflow minted); bc-pki has already revoked every
  certificate issued with the token, so whoever joined with it is refused from then on;
* every verb but ``inspect`` and ``retire`` is refused (``INVALID_STATE``, reason
  ``node-quarantined``); starting either is the operator's look and clears the quarantine.
"""

from __future__ import annotations

import json
import time
from typing import Any, Final

from better_compute.core.errors import BcError, ErrorCode
from better_compute.wire.pki import JoinTokenBurned

from .. import store
from ..core import queue
from .host import MetalHost
from .node_events import node_event

__all__ = ["QUARANTINE_EXITS", "quarantine_node", "refuse_maintenance", "refuse_quarantined"]

QUARANTINE_EXITS: Final = ("inspect", "retire")
_SET = "UPDATE nodes SET quarantine = $2::jsonb, updated_at = now() WHERE id = $1 RETURNING *"
_MESSAGES: Final = {
    "boot-entry-fetched-twice": "its one-time boot entry (and ramdisk join token) was asked for twice on"
    " the boot network",
    "second-join": "a second join tried its single-use ramdisk join token",
    "boot-medium-fetched-twice": "its ramdisk join token's virtual medium was asked for again, or by"
    " another address than its BMC's",
}


def refuse_quarantined(node: Any, verb: str) -> BcError | None:
    """Why ``verb`` may not start on ``node`` while it is quarantined (None: it may)."""
    found = node["quarantine"]
    if found is None or verb in QUARANTINE_EXITS:
        return None
    found = json.loads(found) if isinstance(found, str) else found
    return BcError(
        ErrorCode.INVALID_STATE,
        f"node {node['id']} is quarantined: {found.get('message', '')}; inspect or retire it",
        {"path": "nodeId", "reason": "node-quarantined", "quarantine": found},
    )


async def quarantine_node(engine: MetalHost, event: JoinTokenBurned) -> Any:
    """Quarantine the node of a burned token (see the module); safe to repeat."""
    node_id = event.node_id
    if not node_id:
        return None
    message = _MESSAGES.get(event.reason, event.reason)
    doc = {
        "reason": event.reason,
        "message": message,
        "joinTokenId": event.join_token_id,
        "mac": event.mac,
        "revokedCertIds": event.revoked_cert_ids,
        "at": event.at or time.time(),
    }
    aborted: Any = None
    async with engine.db.transaction() as conn:
        node = await conn.fetchrow(store.NODE + " FOR UPDATE", node_id)
        if node is None:
            return None
        if node["quarantine"] is not None:
            return node  # one burn, one quarantine: a repeat changes nothing
        row = await conn.fetchrow(_SET, node_id, json.dumps(doc))
        if node["workflow_id"] is not None:
            wf = await conn.fetchrow(store.LOCK_WORKFLOW, node["workflow_id"])
            if wf is not None and wf["state"] == "running":
                sent = await conn.fetchval(store.ABORT_LEAVES_WORK, wf["id"])
                error = json.dumps(
                    {
                        "code": "PERMISSION_DENIED",
                        "message": f"node quarantined: {message}",
                        "details": {"reason": "node-quarantined", "joinTokenId": event.join_token_id},
                    }
                )
                await conn.execute(store.ABORT_STEP, wf["id"], error)
                await conn.execute(store.ABORT_WORKFLOW, wf["id"], bool(sent), error)
                await queue.queue_now(conn, wf["rkey"])
                if wf["owner"]:
                    await queue.queue_now(conn, queue.owner_key(wf["owner"], wf["id"]))
                aborted = wf
    engine.log.warning(
        "node_quarantined", node_id=node_id, reason=event.reason, join_token_id=event.join_token_id,
        aborted_workflow_id=aborted["id"] if aborted is not None else None,
    )  # fmt: skip
    if aborted is not None and engine.wake is not None:
        await engine.wake(aborted["rkey"])
        if aborted["owner"]:
            await engine.wake(queue.owner_key(aborted["owner"], aborted["id"]))
    await node_event(engine.publish, row, verb="quarantine")
    return row


def refuse_maintenance(node: Any, what: str) -> BcError | None:
    """``INVALID_STATE`` (reason ``node-in-maintenance``) for a node in maintenance."""
    held = node["maintenance"]
    if held is None:
        return None
    held = json.loads(held) if isinstance(held, str) else held
    why = f": {held.get('reason')}" if isinstance(held, dict) and held.get("reason") else ""
    return BcError(
        ErrorCode.INVALID_STATE,
        f"node {node['id']} is in maintenance{why}; {what} once it is out"
        f" (bcx nodes maintenance off {node['id']})",
        {"path": "nodeId", "reason": "node-in-maintenance"},
    )
