"""``nodes.*``: create, read, list, update, label and delete nodes (``metal.enroll`` enrolls them
through ``metal_api``)."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id, parse_id
from better_compute.service import ApiRequest, Database
from better_compute.service.audit import requester
from better_compute.wire import engine as m
from better_compute.wire.paging import decode_cursor, take_page

from . import store
from .documents import check_labels, node_doc
from .metal.api import bmc_json, check_macs, check_name, names_unique, refuse_inline_secret
from .metal.bmcs import check_bmc_free
from .metal.lifecycle import current_workflow
from .metal.node_events import Publish, node_event, node_removed

__all__ = ["NodesApi"]


class NodesApi:
    """The ``nodes.*`` routes; ``quorum`` (when approvers are configured) has the cmdq client a
    node's current workflow is read with."""

    def __init__(self, *, db: Database, publish: Publish, quorum: Any = None, pki: Any = None) -> None:
        self.pki = pki  # a deleted node's discovery certificates are revoked (issue 26)
        self.db = db
        self.publish = publish
        self.quorum = quorum

    async def nodes_create(self, req: ApiRequest) -> m.NodeView:
        """A node in ``enrolled`` (``metal.enroll`` also enrolls a discovered one)."""
        body = req.decode(m.CreateNode)
        refuse_inline_secret(req)
        check_labels(body.labels)
        node_id = parse_id(body.id, "node", path="id") if body.id else new_id("node")
        async with names_unique(), self.db.transaction() as conn:
            macs = await check_macs(conn, body.macs, node_id)
            await check_bmc_free(conn, _doc(bmc_json(body.bmc)), node_id)
            await check_name(conn, body.site_id, body.name, node_id)
            row = await conn.fetchrow(
                store.CREATE_NODE, node_id, body.tenant_id, body.site_id, json.dumps(body.labels),
                macs, bmc_json(body.bmc), body.name,
            )  # fmt: skip
        if row is None:
            raise BcError(ErrorCode.CONFLICT, f"node {node_id} exists", {"path": "id"})
        await node_event(self.publish, row, verb="create")
        return node_doc(row)

    async def nodes_get(self, req: ApiRequest) -> m.NodeView:
        """The node with its inventory, host section and the workflow moving it now."""
        body = req.decode(m.GetNode)
        parse_id(body.id, "node", path="id")  # a malformed id never reaches the store
        row = await self.db.fetchrow(store.NODE, body.id)
        if row is None:
            raise BcError(ErrorCode.NOT_FOUND, f"no node {body.id}", {"path": "id"})
        cmdq = self.quorum.cmdq if self.quorum is not None else None
        return node_doc(row, full=True, current_workflow=await current_workflow(self.db, row, cmdq))

    async def nodes_list(self, req: ApiRequest) -> m.NodeList:
        body = req.decode(m.ListNodes)
        after = decode_cursor(body.cursor, str)
        rows = await self.db.fetch(
            store.LIST_NODES,
            body.site_id, body.tenant_id, after[0] if after else None, body.limit + 1, body.state,
            json.dumps(body.labels) if body.labels else None, body.name,
        )  # fmt: skip
        docs, next_ = take_page(
            [node_doc(r) for r in rows], limit=body.limit, key=lambda d: (d.id,), budget=req.page_budget
        )
        return m.NodeList(nodes=docs, next=next_)

    async def _locked_node(self, conn: Any, node_id: str) -> Any:
        parse_id(node_id, "node", path="id")  # a malformed id never reaches the store
        row = await conn.fetchrow(store.NODE_FOR_UPDATE, node_id)
        if row is None:
            raise BcError(ErrorCode.NOT_FOUND, f"no node {node_id}", {"path": "id"})
        return row

    async def _refuse_busy(self, conn: Any, node_id: str, what: str) -> None:
        busy = await conn.fetchval(store.NODE_BUSY, node_id, None)
        if busy is not None:
            raise BcError(
                ErrorCode.INVALID_STATE,
                f"node {node_id} runs workflow {busy}: {what} once it has finished (or abort it)",
                {"path": "id", "reason": "node-busy", "workflowId": busy},
            )

    async def nodes_update(self, req: ApiRequest) -> m.NodeView:
        """Replace the node's site, all its labels, its MACs, BMC or name (the bounds of
        ``nodes.create``); the site only while no workflow runs on the node (its commands go to
        that site). A name stays unique in the node's site, the new one if it moves."""
        body = req.decode(m.UpdateNode)
        refuse_inline_secret(req)
        if body.labels is not None:
            check_labels(body.labels)
        if body.clear_name and body.name is not None:
            raise BcError(ErrorCode.INVALID_INPUT, "give name or clearName, not both", {"path": "clearName"})
        async with names_unique(), self.db.transaction() as conn:
            row = await self._locked_node(conn, body.id)
            if body.site_id is not None and body.site_id != row["site_id"]:
                await self._refuse_busy(conn, body.id, "change its site")
            labels = json.dumps(body.labels) if body.labels is not None else None
            macs = await check_macs(conn, body.macs, body.id) if body.macs is not None else None
            await check_bmc_free(conn, _doc(bmc_json(body.bmc)), body.id)
            site = body.site_id or row["site_id"]
            name = None if body.clear_name else (body.name or row["name"])
            await check_name(conn, site, name, body.id)
            row = await conn.fetchrow(
                store.UPDATE_NODE, body.id, body.site_id, labels, macs, bmc_json(body.bmc), body.name,
                body.clear_name,
            )  # fmt: skip
        await node_event(self.publish, row, verb="update")
        return node_doc(row)

    async def nodes_label(self, req: ApiRequest) -> m.NodeView:
        """Set some labels and remove others, in one step; the result has the bounds of create."""
        body = req.decode(m.LabelNode)
        check_labels(body.set, "set")
        async with self.db.transaction() as conn:
            row = await self._locked_node(conn, body.id)
            labels = row["labels"]
            labels = dict(json.loads(labels) if isinstance(labels, str) else labels)
            labels.update(body.set)
            for key in body.remove:
                labels.pop(key, None)
            check_labels(labels)
            row = await conn.fetchrow(
                store.UPDATE_NODE, body.id, None, json.dumps(labels), None, None, None, False
            )
        await node_event(self.publish, row, verb="label")
        return node_doc(row)

    async def nodes_maintenance(self, req: ApiRequest) -> m.NodeView:
        """Put a node in maintenance (``on``: {reason, by, at}) or take it out; a workflow
        running on it goes on (abort it if it must stop), none starts while it is on."""
        body = req.decode(m.SetMaintenance)
        parse_id(body.id, "node", path="id")
        doc = None
        if body.on:
            by = requester(req.headers).actor
            doc = json.dumps({"reason": body.reason, "by": by, "at": dt.datetime.now(dt.UTC).isoformat()})
        async with self.db.transaction() as conn:
            await self._locked_node(conn, body.id)
            row = await conn.fetchrow(_SET_MAINTENANCE, body.id, doc)
        await node_event(self.publish, row, verb="maintenance")
        return node_doc(row)

    async def nodes_delete(self, req: ApiRequest) -> m.NodeDeleted:
        """Forget a node; refused while a workflow runs on it. Finished workflows are kept.
        Its discovery certificates are revoked first: a discovery ramdisk's bcd still running
        with one would otherwise record the node again (the discovery sweep); only a new
        discovery boot brings it back."""
        body = req.decode(m.DeleteNode)
        row = await self.db.fetchrow(store.NODE, body.id)
        hardware = row["hardware"] if row is not None else None  # a discovered node's: its certId
        hardware = _doc(hardware) if isinstance(hardware, str) else hardware
        if isinstance(hardware, dict) and hardware.get("certId") and self.pki is not None:
            await self._refuse_busy(self.db, body.id, "delete it")  # refused before anything is revoked
            await self._revoke_discovery(body.id)
        async with self.db.transaction() as conn:
            await self._locked_node(conn, body.id)
            await self._refuse_busy(conn, body.id, "delete it")
            await conn.execute(store.DETACH_NODE_WORKFLOWS, body.id)
            await conn.execute(store.DELETE_NODE, body.id)
        await node_removed(self.publish, body.id)
        return m.NodeDeleted(deleted=body.id)

    async def _revoke_discovery(self, node_id: str) -> None:
        try:
            certs = await self.pki.list_certificates(agent_id=node_id)
            for cert in certs:
                if cert.role == "discovery" and cert.state == "valid":
                    await self.pki.revoke_certificate(cert_id=cert.cert_id, reason="node deleted")
        except BcError as err:
            raise BcError(
                err.code,
                f"node {node_id} is not deleted: its discovery certificate could not be revoked"
                f" ({err.message}); delete it again",
                {"path": "id", "reason": "discovery-cert-not-revoked"},
            ) from err


_SET_MAINTENANCE = "UPDATE nodes SET maintenance = $2::jsonb, updated_at = now() WHERE id = $1 RETURNING *"


def _doc(text: str | None) -> dict[str, Any] | None:
    return json.loads(text) if text is not None else None
