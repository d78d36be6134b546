"""Destructive-command batches and the approvers' quorum.

A batch names the kinds and nodes its destructive commands may touch; under a quorum the
configured approvers sign its document, and only then are its commands dispatched. Approvals
always count under the approvers configured now: at start every unexpired batch is counted
again, and one no longer approved takes its dispatched, unclaimed commands back to pending.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from better_compute.app import App
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id, parse_id
from better_compute.crypto import batch_document
from better_compute.service import ApiRequest, Database
from better_compute.wire.cmdq import (
    BATCH_EVENTS,
    ApprovalView,
    ApproveBatch,
    ApproverView,
    BatchEvent,
    BatchIdRequest,
    BatchList,
    BatchState,
    BatchView,
    CloseBatch,
    CreateBatch,
    ListBatches,
    QuorumView,
)
from better_compute.wire.paging import decode_cursor, take_page

from . import store
from .config import CmdqConfig
from .delivery import Changed
from .sweeper import DispatchPending

__all__ = ["Batches"]


class Batches:
    """The ``batches.*`` and ``quorum.get`` routes, and the recount at start."""

    def __init__(
        self,
        *,
        db: Database,
        config: CmdqConfig,
        app: App,
        changed: Changed,
        dispatch_pending: DispatchPending,
        log: Any,
        publish: Callable[[str, str, Any], Awaitable[None]] | None = None,
    ) -> None:
        self.db = db
        self.config = config
        self.app = app
        self.changed = changed
        self.dispatch_pending = dispatch_pending
        self.log = log
        self.publish = publish

    async def publish_expiries(self) -> int:
        """``expired`` on ``bc.events.batch.<id>``, once for each batch whose time ran out (a
        sweeper's duty). Published, then marked, in one transaction that holds the rows: two
        instances never both publish one, and a crash before the mark publishes it again."""
        if self.publish is None:
            return 0
        async with self.db.transaction() as conn:
            rows = await conn.fetch(store.BATCHES_EXPIRY_DUE)
            for row in rows:
                await self._event(await self._view_of(row, conn=conn))
                self.log.info("batch_expired", batch_id=row["id"])
            if rows:
                await conn.execute(store.BATCHES_EXPIRY_PUBLISHED, [r["id"] for r in rows])
        return len(rows)

    async def _event(self, view: BatchView, *, approver_id: str | None = None) -> None:
        """``bc.events.batch.<id>``: created, an approval, approved, expired (docs/events.md)."""
        if self.publish is None:
            return
        event = BatchEvent(
            id=view.id,
            state=view.state,
            approvals=sum(1 for a in view.approvals if a.counted),
            threshold=view.threshold,
            workflow_id=view.workflow_id,
            approver_id=approver_id,
            at=time.time(),
        )
        await self.publish(BATCH_EVENTS, view.id, event)

    def view(self, row: Any, approvals: Sequence[Any], *, created: bool = False) -> BatchView:
        """A ``batches`` row and its approvals as the wire's ``BatchView``."""
        quorum = self.config.quorum
        document = bytes(row["document"])
        views = []
        for a in approvals:
            approver = quorum.approvers.get(a["approver_id"])
            counted = approver is not None and approver.verifies(bytes(a["signature"]), document)
            views.append(
                ApprovalView(approver_id=a["approver_id"], at=a["created_at"].timestamp(), counted=counted)
            )
        state: BatchState
        if row["closed_at"] is not None:
            state = "closed"
        elif row["expired"]:
            state = "expired"
        elif row["approved_at"] is not None:
            state = "approved"
        else:
            state = "open"
        return BatchView(
            id=row["id"],
            tenant_id=row["tenant_id"],
            kinds=list(row["kinds"]),
            nodes=list(row["nodes"]),
            workflow_id=row["workflow_id"],
            workflow_ids=list(row["workflow_ids"]),
            note=row["note"],
            state=state,
            threshold=quorum.threshold,
            approvals=views,
            created_at=row["created_at"].timestamp(),
            expires_at_ms=row["expires_at_ms"],
            document=document,
            created=created,
            closed_reason=row["closed_reason"],
        )

    async def _view_of(self, row: Any, *, created: bool = False, conn: Any = None) -> BatchView:
        return self.view(row, await (conn or self.db).fetch(store.APPROVALS_OF, row["id"]), created=created)

    async def create(self, req: ApiRequest) -> BatchView:
        body = req.decode(CreateBatch)
        for index, kind in enumerate(body.kinds):
            self.app.command_kind(kind, path=f"kinds[{index}]")
        for index, node in enumerate(body.nodes):
            parse_id(node, "node", path=f"nodes[{index}]")
        if body.workflow_id is not None:
            parse_id(body.workflow_id, "wf", path="workflowId")
        for index, wf in enumerate(body.workflow_ids):
            parse_id(wf, "wf", path=f"workflowIds[{index}]")
        if body.workflow_id is not None and body.workflow_ids:
            raise BcError(
                ErrorCode.INVALID_INPUT,
                "a batch admits one workflow (workflowId) or a bulk verb's set (workflowIds), not both",
                {"path": "workflowIds"},
            )
        kinds, nodes = sorted(set(body.kinds)), sorted(set(body.nodes))
        if body.idempotency_key is not None:
            found = await self.db.fetchrow(store.BATCH_BY_KEY, body.idempotency_key)
            if found is not None:
                return await self._same_batch(found, body, kinds, nodes)
        batch_id = new_id("batch")
        expires_at_ms = time.time_ns() // 1_000_000 + body.ttl_seconds * 1000
        document = batch_document(
            batch_id=batch_id,
            tenant_id=body.tenant_id,
            kinds=kinds,
            nodes=nodes,
            expires_at_ms=expires_at_ms,
            workflow_id=body.workflow_id,
            workflow_ids=body.workflow_ids,
        )
        row = await self.db.fetchrow(
            store.BATCH_INSERT,
            batch_id,
            body.tenant_id,
            kinds,
            nodes,
            body.workflow_id,
            body.note,
            body.idempotency_key,
            document,
            self.config.quorum.threshold,
            expires_at_ms,
            sorted(set(body.workflow_ids)),
        )
        if row is None:  # another request with the same idempotency key won the race
            found = await self.db.fetchrow(store.BATCH_BY_KEY, body.idempotency_key)
            return await self._same_batch(found, body, kinds, nodes)
        self.log.info(
            "batch_created",
            batch_id=batch_id,
            kinds=kinds,
            nodes=len(nodes),
            workflow_id=body.workflow_id,
        )
        view = self.view(row, [], created=True)
        await self._event(view)
        return view

    async def _same_batch(
        self, found: Any, body: CreateBatch, kinds: list[str], nodes: list[str]
    ) -> BatchView:
        first = (found["tenant_id"], list(found["kinds"]), list(found["nodes"]))
        same_workflows = (found["workflow_id"], sorted(found["workflow_ids"])) == (
            body.workflow_id,
            sorted(set(body.workflow_ids)),
        )
        if first != (body.tenant_id, kinds, nodes) or not same_workflows:
            raise BcError(
                ErrorCode.CONFLICT,
                "idempotency key already used for a batch with another scope",
                {"path": "idempotencyKey", "batchId": found["id"]},
            )
        return await self._view_of(found)

    async def get(self, req: ApiRequest) -> BatchView:
        ident = parse_id(req.decode(BatchIdRequest).id, "batch", path="id")
        row = await self.db.fetchrow(store.BATCH_BY_ID, ident)
        if row is None:
            raise BcError(ErrorCode.NOT_FOUND, "no such batch", {"path": "id"})
        return await self._view_of(row)

    async def list_batches(self, req: ApiRequest) -> BatchList:
        body = req.decode(ListBatches)
        (before,) = decode_cursor(body.cursor, str) or (None,)
        sizes = await self.db.fetch(store.BATCHES_LIST, body.workflow_id, body.state, before, body.limit + 1)
        # A view carries the node list and the signed document (base64): about 2.5 times
        # the document's size.
        page, next_ = take_page(
            list(sizes), limit=body.limit, key=lambda r: (r["id"],), budget=req.page_budget,
            size=lambda r: 1024 + 3 * int(r["size"]),
        )  # fmt: skip
        if not page:
            return BatchList(batches=[], next=next_)
        ids = [r["id"] for r in page]
        rows = await self.db.fetch(store.BATCHES_BY_IDS, ids)
        approvals: dict[str, list[Any]] = {ident: [] for ident in ids}
        for a in await self.db.fetch(store.APPROVALS_OF_BATCHES, ids):  # one query for the page
            approvals[a["batch_id"]].append(a)
        return BatchList(batches=[self.view(r, approvals[r["id"]]) for r in rows], next=next_)

    async def approve(self, req: ApiRequest) -> BatchView:
        body = req.decode(ApproveBatch)
        ident = parse_id(body.batch_id, "batch", path="batchId")
        quorum = self.config.quorum
        newly_approved = False
        async with self.db.transaction() as conn:
            # Locked, so two approvals counted at once never both miss the threshold.
            row = await conn.fetchrow(store.BATCH_BY_ID_FOR_UPDATE, ident)
            if row is None:
                raise BcError(ErrorCode.NOT_FOUND, "no such batch", {"path": "batchId"})
            if not quorum.enabled:
                raise BcError(
                    ErrorCode.INVALID_STATE,
                    "no approvers are configured: batches need no approval",
                    {"reason": "quorum-off"},
                )
            approver = quorum.approvers.get(body.approver_id)
            if approver is None:
                raise BcError(
                    ErrorCode.PERMISSION_DENIED,
                    "not a configured approver",
                    {"path": "approverId", "reason": "unknown-approver"},
                )
            if row["closed_at"] is not None:
                raise BcError(
                    ErrorCode.INVALID_STATE,
                    f"the batch is closed: {row['closed_reason'] or 'its workflow ended'}",
                    {"path": "batchId", "reason": "batch-closed"},
                )
            if row["expired"]:
                raise BcError(
                    ErrorCode.INVALID_STATE,
                    "the batch has expired",
                    {"path": "batchId", "reason": "batch-expired"},
                )
            if not approver.verifies(body.signature, bytes(row["document"])):
                self.log.warning("approval_refused", batch_id=ident, approver_id=body.approver_id)
                raise BcError(
                    ErrorCode.UNAUTHENTICATED,
                    "the signature is not this approver's over this batch's document",
                    {"path": "signature", "reason": "bad-signature"},
                )
            inserted = await conn.fetchval(store.APPROVAL_INSERT, ident, body.approver_id, body.signature)
            was_approved = row["approved_at"] is not None
            approved = await self._recount(conn, row)
            newly_approved = approved and not was_approved
            view = await self._view_of(await conn.fetchrow(store.BATCH_BY_ID, ident), conn=conn)
        self.log.info(
            "batch_approval",
            batch_id=ident,
            approver_id=body.approver_id,
            duplicate=inserted is None,
            approved=approved,
        )
        if inserted is not None or newly_approved:
            await self._event(view, approver_id=body.approver_id)
        if newly_approved:
            await self.dispatch_pending(batch_id=ident)
        return view

    async def close(self, req: ApiRequest) -> BatchView:
        """Close a batch whose workflow failed or was aborted: no more approvals, not open."""
        body = req.decode(CloseBatch)
        ident = parse_id(body.id, "batch", path="id")
        row = await self.db.fetchrow(store.BATCH_BY_ID, ident)
        if row is None:
            raise BcError(ErrorCode.NOT_FOUND, "no such batch", {"path": "id"})
        if row["closed_at"] is not None:
            return await self._view_of(row)
        row = await self.db.fetchrow(store.BATCH_CLOSE, ident, body.reason)
        self.log.info("batch_closed", batch_id=ident, reason=body.reason)
        view = await self._view_of(row)
        await self._event(view)
        return view

    async def reopen(self, req: ApiRequest) -> BatchView:
        """A closed batch's workflow runs again (retried or resumed): the batch is open again,
        its approvals as they were."""
        ident = parse_id(req.decode(BatchIdRequest).id, "batch", path="id")
        row = await self.db.fetchrow(store.BATCH_REOPEN, ident)
        if row is None:
            raise BcError(ErrorCode.NOT_FOUND, "no such batch", {"path": "id"})
        self.log.info("batch_reopened", batch_id=ident)
        view = await self._view_of(row)
        await self._event(view)
        return view

    async def _recount(self, conn: Any, row: Any) -> bool:
        """Count the valid approvals under the configured approvers; record the outcome."""
        quorum = self.config.quorum
        document = bytes(row["document"])
        counted = 0
        for a in await conn.fetch(store.APPROVALS_OF, row["id"]):
            approver = quorum.approvers.get(a["approver_id"])
            if approver is not None and approver.verifies(bytes(a["signature"]), document):
                counted += 1
        approved = quorum.enabled and counted >= quorum.threshold
        await conn.execute(store.BATCH_SET_APPROVED, row["id"], approved)
        return approved

    async def recount_all(self) -> None:
        """At start: approvals count under the approvers configured now (one may be gone). The
        dispatched, unclaimed commands of a batch no longer approved go back to pending."""
        withdrawn: list[Any] = []
        for ident in [r["id"] for r in await self.db.fetch(store.BATCHES_UNEXPIRED)]:
            async with self.db.transaction() as conn:
                row = await conn.fetchrow(store.BATCH_BY_ID_FOR_UPDATE, ident)
                if row is not None and not await self._recount(conn, row) and self.config.quorum.enabled:
                    withdrawn += await conn.fetch(store.BATCH_UNDISPATCH, ident)
        for row in withdrawn:
            self.log.info("command_undispatched", command_id=row["id"], reason=row["reason"])
        await self.changed(withdrawn)

    async def quorum(self, _req: ApiRequest) -> QuorumView:
        quorum = self.config.quorum
        return QuorumView(
            enabled=quorum.enabled,
            threshold=quorum.threshold,
            approvers=[ApproverView(id=a.id, public_key=a.public_key_b64) for a in quorum.approvers.values()],
        )
