"""Discovery: a machine that joined with a site's ``discovery`` token becomes a ``discovered`` node.

bc-pki publishes a ``join`` event (``bc.events.join.<token id>``) for every join. The engine
reads the certificate back from bc-pki (the event is a wake-up, bc-pki is the truth) and, for a
``discovery`` certificate, records the node in the same transaction that queues
``metal-discovery:<node id>``:

* the node id is the agent id bc-pki gave the join (``node_…``: the same for the same hardware,
  see ``bc_pki.discovery``), so node commands reach that machine's bcd;
* a node of that id in ``discovered`` gets the new claims (a second discovery updates it, never
  a duplicate); one in any other state (enrolled meanwhile) is left alone;
* hardware that another node already has (its product UUID, serial or a MAC) is not recorded
  again: the join is logged (``discovery_known_hardware``) and nothing changes; when its
  claims differ from that node's (other MACs, another serial), the node shows the discovery as
  ``discoveryConflict`` (``bcx nodes show``): a discovery never changes a node's MACs or
  hardware, an operator does (issue 23, H2). bc-pki gives a join an earlier discovery's node id
  only for the same key, so a second discovery with other MACs is a conflict here too.

A lost event delays a discovery, never loses it: ``discovery_sweep`` (an engine side loop) looks
at bc-pki's discovery certificates of the last hour every 30 s, from the engine's start, and
records those whose node is missing.

``metal-discovery:<node>`` then asks the node's bcd for ``node.inventory`` (not destructive; key
``discovery:<cert id>``, so each discovery inventories once) and keeps the result as the node's
inventory; with it, the first enrollment rule that matches the node enrolls it
(``metal_rules``). Once the node is enrolled, the same key revokes the node's discovery certificates in
bc-pki (``enroll`` queues it): the discovery ramdisk's key is trusted with nothing from then on;
the lifecycle's own ramdisk joins with a token bound to the node.

A discovered node is trusted with nothing: every lifecycle verb but ``enroll`` is
``INVALID_STATE`` (``metal.lifecycle.TRANSITIONS``), it has no BMC and no standing secret, and
its bcd gets only the inventory command.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from typing import Any, Final

import asyncpg
from nats.aio.msg import Msg

from better_compute.core.errors import BcError, ErrorCode
from better_compute.metal.enrollment import host_name
from better_compute.provision import step_not_ready
from better_compute.wire.cmdq import LIVE_STATES, EnqueueCommand
from better_compute.wire.commands import decode_result
from better_compute.wire.pki import CertificateInfo, JoinClaims

from .. import store
from ..core import queue
from .host import MetalHost
from .names import DISCOVERY_KEY_PREFIX, DISCOVERY_OWNER, JOIN_EVENTS
from .node_events import node_event
from .rules import enroll_by_rules

__all__ = [
    "DISCOVERY_KEY_PREFIX",
    "DISCOVERY_OWNER",
    "JOIN_EVENTS",
    "discovery_key",
    "discovery_sweep",
    "inventory_discovered",
    "on_join",
    "record_discovery",
    "refuse_discovered",
]

INVENTORY_TIMEOUT_S: Final = 900  # the ramdisk's bcd has this long to answer
INVENTORY_LOOK_MS: Final = 10_000  # a live inventory is looked at again this soon (its event is sooner)
SWEEP_S: Final = 30.0  # the look for discovery joins whose event was lost
SWEEP_WINDOW_S: Final = 3600.0  # ... among the certificates of the last hour
SWEEP_LIMIT: Final = 200

# Another node with this hardware: its product UUID, serial or one of its MACs.
_OTHER_NODE_WITH = """
SELECT id FROM nodes WHERE id <> $1 AND (
    ($2::text IS NOT NULL AND hardware ->> 'productUuid' = $2)
    OR ($3::text IS NOT NULL AND hardware ->> 'serial' = $3)
    OR macs && $4::text[]) LIMIT 1
"""
# A discovered node, new or the same hardware again (only while it is still discovered). $6 its
# name from the reported host name, taken only while no other node of the site has it; a node
# that has a name keeps it.
_UPSERT_DISCOVERED = """
INSERT INTO nodes (id, tenant_id, site_id, state, macs, hardware, observed_generation, name)
VALUES ($1, $2, $3, 'discovered', $4::text[], $5::jsonb, 1,
    (SELECT $6::text WHERE NOT EXISTS (SELECT 1 FROM nodes WHERE site_id = $3 AND name = $6 AND id <> $1)))
ON CONFLICT (id) DO UPDATE SET macs = EXCLUDED.macs, hardware = EXCLUDED.hardware,
    name = COALESCE(nodes.name, EXCLUDED.name), updated_at = now()
    WHERE nodes.state = 'discovered'
RETURNING *
"""
# What the engine has of the nodes of some discovery certificates (the sweep).
_NODES_OF = "SELECT id, state, hardware ->> 'certId' AS cert_id FROM nodes WHERE id = ANY($1::text[])"
_SET_INVENTORY = (
    "UPDATE nodes SET inventory = $2::jsonb, updated_at = now()"
    " WHERE id = $1 AND state = 'discovered' RETURNING *"
)
_SET_CONFLICT = (
    "UPDATE nodes SET discovery_conflict = $2::jsonb, updated_at = now() WHERE id = $1 RETURNING *"
)
_SET_LAST_ERROR = "UPDATE nodes SET last_error = $2::jsonb, updated_at = now() WHERE id = $1 RETURNING *"


def refuse_discovered(node: Any) -> None:
    """No workflow runs on a discovered node (``INVALID_STATE``, reason ``node-discovered``)."""
    if node["state"] == "discovered":
        raise BcError(
            ErrorCode.INVALID_STATE,
            f"node {node['id']} is discovered: enroll it before anything runs on it",
            {"path": "nodeId", "reason": "node-discovered"},
        )


def discovery_key(cert_id: str) -> str:
    return f"{DISCOVERY_KEY_PREFIX}{cert_id}"


def _hardware(claims: JoinClaims, cert_id: str) -> dict[str, Any]:
    return {
        "productUuid": claims.product_uuid,
        "serial": claims.serial,
        "macs": list(claims.macs),
        "gpuUuids": list(claims.gpu_uuids),
        "hostname": claims.hostname,
        "certId": cert_id,
    }


async def on_join(engine: MetalHost, msg: Msg) -> None:
    """A ``join`` event of bc-pki: the certificate of a discovery join, read back (the event's
    ``role`` only spares reading the others; the certificate's role is what counts)."""
    try:
        event = json.loads(msg.data)
    except ValueError:
        return
    if not isinstance(event, dict) or event.get("role", "discovery") != "discovery":
        return  # another role's join: no certificate to read back
    cert_id = event.get("certId")
    if not isinstance(cert_id, str) or not cert_id.startswith("cert_"):
        return
    try:
        cert = await engine.pki.get_certificate(cert_id=cert_id)
        await record_discovery(engine, cert)
    except BcError as err:
        engine.log.warning("discovery_not_recorded", cert_id=cert_id, code=err.code.value, reason=err.reason)


async def record_discovery(engine: MetalHost, cert: CertificateInfo) -> Any:
    """Record the node of a discovery certificate (see the module); returns its row, or None
    when there is nothing to record (another role, hardware known as another node, enrolled)."""
    if cert.role != "discovery" or cert.state != "valid" or not cert.agent_id.startswith("node_"):
        return None
    claims = cert.claims or JoinClaims()
    async with engine.db.transaction() as conn:
        other = await conn.fetchval(
            _OTHER_NODE_WITH, cert.agent_id, claims.product_uuid, claims.serial, list(claims.macs)
        )
        same = await conn.fetchrow(store.NODE, cert.agent_id)
        known = other if other is not None else (same["id"] if same is not None else None)
        conflict = None
        if known is not None:
            node = same if other is None else await conn.fetchrow(store.NODE, other)
            conflict = await _conflict(conn, node, claims, cert)
        if other is not None or conflict is not None:
            engine.log.info(
                "discovery_known_hardware", node_id=known, agent_id=cert.agent_id, cert_id=cert.cert_id,
                conflict=conflict is not None,
            )  # fmt: skip
            if conflict is not None:
                await node_event(engine.publish, conflict, verb="discovery-conflict")
            return None
        row = await _upsert_discovered(conn, cert, claims)
        if row is None:
            engine.log.info("discovery_of_enrolled_node", node_id=cert.agent_id, cert_id=cert.cert_id)
            return None
        await queue.queue_now(conn, queue.owner_key(DISCOVERY_OWNER, row["id"]))
    engine.log.info("node_discovered", node_id=row["id"], site_id=row["site_id"], cert_id=cert.cert_id)
    await node_event(engine.publish, row, verb="discover")
    if engine.wake is not None:
        await engine.wake(queue.owner_key(DISCOVERY_OWNER, row["id"]))
    return row


async def _upsert_discovered(conn: Any, cert: CertificateInfo, claims: JoinClaims) -> Any:
    """The discovered node's row, named after its reported host name when the site has no other
    node of that name (two joins naming themselves alike at once: the second goes unnamed)."""
    args = (
        cert.agent_id,
        cert.tenant_id,
        cert.site_id,
        list(claims.macs),
        json.dumps(_hardware(claims, cert.cert_id)),
    )
    name = host_name(claims.hostname)
    if name is not None:
        try:
            async with conn.transaction():  # a savepoint: the unique index may refuse the name
                return await conn.fetchrow(_UPSERT_DISCOVERED, *args, name)
        except asyncpg.UniqueViolationError as exc:
            if exc.constraint_name != store.NODE_NAME_INDEX:
                raise
    return await conn.fetchrow(_UPSERT_DISCOVERED, *args, None)


async def _conflict(conn: Any, node: Any, claims: JoinClaims, cert: CertificateInfo) -> Any:
    """Record on ``node`` a discovery whose claims differ from its MACs or hardware (its row
    then), else None."""
    if node is None:
        return None
    hardware = node["hardware"]
    hardware = json.loads(hardware) if isinstance(hardware, str) else (hardware or {})
    differs = sorted(node["macs"]) != sorted(claims.macs) or any(
        hardware.get(k) not in (None, v)
        for k, v in (("productUuid", claims.product_uuid), ("serial", claims.serial))
    )
    if not differs:
        return None
    doc = {
        "certId": cert.cert_id,
        "agentId": cert.agent_id,
        "claims": {"macs": list(claims.macs), "productUuid": claims.product_uuid, "serial": claims.serial},
        "at": dt.datetime.now(dt.UTC).isoformat(),
    }
    return await conn.fetchrow(_SET_CONFLICT, node["id"], json.dumps(doc))


async def inventory_discovered(engine: MetalHost, node_id: str) -> None:
    """``metal-discovery:<node>``: the inventory of a discovered node, or, once it is enrolled,
    the revocation of its discovery certificates."""
    node = await engine.db.fetchrow(store.NODE, node_id)
    if node is None:
        return
    hardware = node["hardware"]
    hardware = json.loads(hardware) if isinstance(hardware, str) else hardware
    if not isinstance(hardware, dict) or not isinstance(hardware.get("certId"), str):
        return
    if node["state"] != "discovered":
        await _revoke_discovery_certs(engine, node_id)
        return
    view = await engine.cmdq.enqueue(
        EnqueueCommand(
            node_id=node_id,
            site_id=node["site_id"],
            kind="node.inventory",
            payload={},
            key=discovery_key(hardware["certId"]),
            target="node",
            timeout_ms=INVENTORY_TIMEOUT_S * 1000,
            tenant_id=node["tenant_id"],
        )
    )
    if view.state in LIVE_STATES:
        raise step_not_ready(INVENTORY_LOOK_MS)
    inventory = _inventory(view.result) if view.state == "succeeded" else None
    if inventory is not None:
        # its facts are known now: the first enrollment rule that matches enrolls it, the
        # inventory written with the enrolment (never seen discovered with it in between)
        if await enroll_by_rules(engine, node, DISCOVERY_OWNER, inventory) is not None:
            engine.log.info("discovered_node_inventoried", node_id=node_id, state=view.state)
            return
        row = await engine.db.fetchrow(_SET_INVENTORY, node_id, json.dumps(inventory))
    else:
        error = {
            "code": "DRIVER_ERROR",
            "reason": "discovery-inventory",
            "commandId": view.id,
            "message": f"node.inventory {view.state}"
            + (f": {view.reason}" if view.reason else "")
            + (": its result is not an inventory" if view.state == "succeeded" else ""),
        }
        row = await engine.db.fetchrow(_SET_LAST_ERROR, node_id, json.dumps(error))
    if row is not None:
        engine.log.info("discovered_node_inventoried", node_id=node_id, state=view.state)
        await node_event(engine.publish, row)


async def discovery_sweep(engine: MetalHost) -> None:
    """The safety net for lost ``join`` events (an engine away, a NATS hiccup): every
    ``SWEEP_S``, from the start, bc-pki's valid discovery certificates of the last hour whose node
    the engine lacks (or has, still discovered, from an older discovery) are recorded."""
    while True:
        try:
            await sweep_once(engine)
        except BcError as err:
            engine.log.warning("discovery_sweep_failed", code=err.code.value)
        await asyncio.sleep(SWEEP_S)


async def sweep_once(engine: MetalHost) -> int:
    """One look (see ``discovery_sweep``); returns how many nodes it recorded."""
    certs = await engine.pki.list_certificates(role="discovery", limit=SWEEP_LIMIT)
    since = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=SWEEP_WINDOW_S)
    newest: dict[str, CertificateInfo] = {}
    for cert in certs:  # newest first: the first of an agent is its latest discovery
        if cert.state == "valid" and cert.created_at >= since and cert.agent_id.startswith("node_"):
            newest.setdefault(cert.agent_id, cert)
    if not newest:
        return 0
    known = {r["id"]: r for r in await engine.db.fetch(_NODES_OF, list(newest))}
    recorded = 0
    for node_id, cert in newest.items():
        row = known.get(node_id)
        if row is None or (row["state"] == "discovered" and row["cert_id"] != cert.cert_id):
            recorded += await record_discovery(engine, cert) is not None
    return recorded


def _inventory(raw: bytes | None) -> dict[str, Any] | None:
    """bcd's ``node.inventory`` result, as the node signed it, when it decodes as its Struct
    (``NodeInventoryResult``); None when there is none or it does not fit."""
    try:
        found = json.loads(raw) if raw else None
    except (ValueError, RecursionError):
        return None
    if not isinstance(found, dict) or decode_result("node.inventory", found) is None:
        return None
    return found


async def _revoke_discovery_certs(engine: MetalHost, node_id: str) -> None:
    try:
        certs = await engine.pki.list_certificates(agent_id=node_id)
    except BcError as err:
        engine.log.warning("discovery_certs_not_listed", node_id=node_id, code=err.code.value)
        raise step_not_ready(INVENTORY_LOOK_MS) from None
    for cert in certs:
        if cert.role == "discovery" and cert.state == "valid":
            await engine.pki.revoke_certificate(cert_id=cert.cert_id, reason="node enrolled")
            engine.log.info("discovery_cert_revoked", node_id=node_id, cert_id=cert.cert_id)
