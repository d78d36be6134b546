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
from better_compute.service import ApiRequest
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

from .config import CmdqConfig, QuorumSource
from .delivery import Changed
from .rows import ApprovalRow, BatchRow, CommandRow
from .storage import NewBatch, Store
from .sweeper import DispatchPending

__all__ = ["Batches"]


class Batches:
    """The ``batches.*`` and ``quorum.get`` routes, and the recount at start."""

    def __init__(
        self,
        *,
        store: Store,
        config: CmdqConfig,
        app: App,
        changed: Changed,
        dispatch_pending: DispatchPending,
        log: Any,
        publish: Callable[[str, str, Any], Awaitable[None]] | None = None,
    ) -> None:
        self.store = store
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
        async with self.store.transaction() as tx:
            rows = await tx.batches_expiry_due()
            for row in rows:
                await self._event(await self._view_of(row, tx=tx))
                self.log.info("batch_expired", batch_id=row.id)
            if rows:
                await tx.mark_expiry_published([r.id for r in rows])
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

    def view(self, row: BatchRow, approvals: Sequence[ApprovalRow], *, created: bool = False) -> BatchView:
        """A ``batches`` row and its approvals as the wire's ``BatchView``."""
        quorum = self.config.quorum
        document = row.document
        views = []
        for a in approvals:
            approver = quorum.approvers.get(a.approver_id)
            counted = approver is not None and approver.verifies(a.signature, document)
            views.append(ApprovalView(approver_id=a.approver_id, at=a.created_at, counted=counted))
        state: BatchState
        if row.closed_at is not None:
            state = "closed"
        elif row.expired:
            state = "expired"
        elif row.approved_at is not None:
            state = "approved"
        else:
            state = "open"
        return BatchView(
            id=row.id,
            tenant_id=row.tenant_id,
            kinds=list(row.kinds),
            nodes=list(row.nodes),
            workflow_id=row.workflow_id,
            workflow_ids=list(row.workflow_ids),
            note=row.note,
            state=state,
            threshold=quorum.threshold,
            approvals=views,
            created_at=row.created_at,
            expires_at_ms=row.expires_at_ms,
            document=document,
            created=created,
            closed_reason=row.closed_reason,
        )

    async def _view_of(self, row: BatchRow, *, created: bool = False, tx: Store | None = None) -> BatchView:
        return self.view(row, await (tx or self.store).approvals_of([row.id]), created=created)

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
            found = await self.store.batch_by_key(body.idempotency_key)
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
        row = await self.store.insert_batch(
            NewBatch(
                id=batch_id,
                tenant_id=body.tenant_id,
                kinds=kinds,
                nodes=nodes,
                workflow_id=body.workflow_id,
                note=body.note,
                idempotency_key=body.idempotency_key,
                document=document,
                threshold=self.config.quorum.threshold,
                expires_at_ms=expires_at_ms,
                workflow_ids=sorted(set(body.workflow_ids)),
            )
        )
        if row is None:  # another request with the same idempotency key won the race
            assert body.idempotency_key is not None
            found = await self.store.batch_by_key(body.idempotency_key)
            assert found is not None  # batches are never deleted
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
        self, found: BatchRow, body: CreateBatch, kinds: list[str], nodes: list[str]
    ) -> BatchView:
        first = (found.tenant_id, found.kinds, found.nodes)
        same_workflows = (found.workflow_id, sorted(found.workflow_ids)) == (
            body.workflow_id,
            sorted(set(body.workflow_ids)),
        )
        if first != (body.tenant_id, kinds, nodes) or not same_workflows:
            raise BcError(
                ErrorCode.CONFLICT,
                "idempotency key already used for a batch with another scope",
                {"path": "idempotencyKey", "batchId": found.id},
            )
        return await self._view_of(found)

    async def get(self, req: ApiRequest) -> BatchView:
        ident = parse_id(req.decode(BatchIdRequest).id, "batch", path="id")
        row = await self.store.batch_by_id(ident)
        if row is None:
            raise BcError(ErrorCode.NOT_FOUND, "no such batch", {"path": "id"})
        return await self._view_of(row)

    async def list_batches(self, req: ApiRequest) -> BatchList:
        body = req.decode(ListBatches)
        (before,) = decode_cursor(body.cursor, str) or (None,)
        sizes = await self.store.batch_sizes(
            workflow_id=body.workflow_id, state=body.state, before=before, limit=body.limit + 1
        )
        # A view carries the node list and the signed document (base64): about 2.5 times
        # the document's size.
        page, next_ = take_page(
            sizes, limit=body.limit, key=lambda r: (r.id,), budget=req.page_budget,
            size=lambda r: 1024 + 3 * r.size,
        )  # fmt: skip
        if not page:
            return BatchList(batches=[], next=next_)
        ids = [r.id for r in page]
        rows = await self.store.batches_by_ids(ids)
        approvals: dict[str, list[ApprovalRow]] = {ident: [] for ident in ids}
        for a in await self.store.approvals_of(ids):  # one query for the page
            approvals[a.batch_id].append(a)
        return BatchList(batches=[self.view(r, approvals[r.id]) for r in rows], next=next_)

    async def approve(self, req: ApiRequest) -> BatchView:
        body = req.decode(ApproveBatch)
        ident = parse_id(body.batch_id, "batch", path="batchId")
        quorum = self.config.quorum
        newly_approved = False
        async with self.store.transaction() as tx:
            # Locked, so two approvals counted at once never both miss the threshold.
            row = await tx.batch_by_id(ident, lock=True)
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
            if row.closed_at is not None:
                raise BcError(
                    ErrorCode.INVALID_STATE,
                    f"the batch is closed: {row.closed_reason or 'its workflow ended'}",
                    {"path": "batchId", "reason": "batch-closed"},
                )
            if row.expired:
                raise BcError(
                    ErrorCode.INVALID_STATE,
                    "the batch has expired",
                    {"path": "batchId", "reason": "batch-expired"},
                )
            if not approver.verifies(body.signature, row.document):
                self.log.warning("approval_refused", batch_id=ident, approver_id=body.approver_id)
                raise BcError(
                    ErrorCode.UNAUTHENTICATED,
                    "the signature is not this approver's over this batch's document",
                    {"path": "signature", "reason": "bad-signature"},
                )
            inserted = await tx.insert_approval(ident, body.approver_id, body.signature)
            was_approved = row.approved_at is not None
            approved = await self._recount(tx, row)
            newly_approved = approved and not was_approved
            after = await tx.batch_by_id(ident)
            assert after is not None  # held by this transaction
            view = await self._view_of(after, tx=tx)
        self.log.info(
            "batch_approval",
            batch_id=ident,
            approver_id=body.approver_id,
            duplicate=not inserted,
            approved=approved,
        )
        if inserted or newly_approved:
            await self._event(view, approver_id=body.approver_id)
        if newly_approved:
            await self.dispatch_pending(batch_id=ident)
        return view

    async def close(self, req: ApiRequest) -> BatchView:
        """Close a batch whose workflow failed or was aborted: no more approvals, not open."""
        body = req.decode(CloseBatch)
        ident = parse_id(body.id, "batch", path="id")
        row = await self.store.batch_by_id(ident)
        if row is None:
            raise BcError(ErrorCode.NOT_FOUND, "no such batch", {"path": "id"})
        if row.closed_at is not None:
            return await self._view_of(row)
        row = await self.store.close_batch(ident, body.reason)
        assert row is not None  # batches are never deleted
        self.log.info("batch_closed", batch_id=ident, reason=body.reason)
        view = await self._view_of(row)
        await self._event(view)
        return view

    async def reopen(self, req: ApiRequest) -> BatchView:
        """A closed batch's workflow runs again (retried or resumed): the batch is open again,
        its approvals as they were."""
        ident = parse_id(req.decode(BatchIdRequest).id, "batch", path="id")
        row = await self.store.reopen_batch(ident)
        if row is None:
            raise BcError(ErrorCode.NOT_FOUND, "no such batch", {"path": "id"})
        self.log.info("batch_reopened", batch_id=ident)
        view = await self._view_of(row)
        await self._event(view)
        return view

    async def _recount(self, tx: Store, row: BatchRow) -> bool:
        """Count the valid approvals under the configured approvers; record the outcome."""
        quorum = self.config.quorum
        counted = 0
        for a in await tx.approvals_of([row.id]):
            approver = quorum.approvers.get(a.approver_id)
            if approver is not None and approver.verifies(a.signature, row.document):
                counted += 1
        approved = quorum.enabled and counted >= quorum.threshold
        await tx.set_batch_approved(row.id, approved)
        return approved

    async def recount_all(self) -> None:
        """At start: approvals count under the approvers configured now (one may be gone). The
        dispatched, unclaimed commands of a batch no longer approved go back to pending."""
        withdrawn: list[CommandRow] = []
        for ident in await self.store.unexpired_batch_ids():
            async with self.store.transaction() as tx:
                row = await tx.batch_by_id(ident, lock=True)
                if row is not None and not await self._recount(tx, row) and self.config.quorum.enabled:
                    withdrawn += await tx.undispatch_batch(ident)
        for undone in withdrawn:
            self.log.info("command_undispatched", command_id=undone.id, reason=undone.reason)
        await self.changed(withdrawn)

    async def reload_quorum(self) -> None:
        """The sweeper's duty: the approvers file read again when it changed (``QuorumSource``);
        a new quorum counts every open batch's approvals again, as at start. A file that cannot
        be read or is wrong is logged once and the quorum in force stays."""
        source = self.config.quorum_source
        try:
            changed = source.reload()
        except BcError as err:
            self.log.error(
                "quorum_file_invalid", file=str(source.path), code=err.code.value,
                path=err.details.get("path"), reason=err.message, kept=sorted(self.config.quorum.approvers),
            )  # fmt: skip
            return
        if changed:
            await self._quorum_changed("approvers-file")

    async def adopt_quorum(self, source: QuorumSource) -> None:
        """A new ``[cmdq.quorum]`` (the config file changed): in force at once, every open
        batch's approvals counted again."""
        if self.config.quorum_source.adopt(source):
            await self._quorum_changed("config-file")

    async def _quorum_changed(self, source: str) -> None:
        quorum = self.config.quorum
        self.log.info(
            "quorum_reloaded", source=source, threshold=quorum.threshold, approvers=sorted(quorum.approvers)
        )
        await self.recount_all()

    async def quorum(self, _req: ApiRequest) -> QuorumView:
        quorum = self.config.quorum
        return QuorumView(
            enabled=quorum.enabled,
            threshold=quorum.threshold,
            approvers=[ApproverView(id=a.id, public_key=a.public_key_b64) for a in quorum.approvers.values()],
        )
