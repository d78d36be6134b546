"""``workflows.*``: start, read, list, and the operator's verbs (abort, retry, resume); and
``start_in``, which starts a workflow inside a caller's transaction (steps, metal)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import asyncpg

from better_compute.app import App
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id, parse_id
from better_compute.provision.profiles import MAX_PROFILE_STEPS
from better_compute.service import ApiRequest, Database
from better_compute.wire import engine as m
from better_compute.wire.paging import PAGE_BUDGET, decode_cursor, take_page

from . import metrics, store
from .core import queue
from .documents import workflow_doc
from .profiles import FoundProfile, ProfileStore
from .resolve import Resolution, resolve_profile
from .steps.hooks import EngineHooks, Publish

__all__ = ["WorkflowsApi"]

Verb = Literal["abort", "retry", "resume"]
_INSTEAD: dict[tuple[str, str], str] = {
    ("retry", "aborted"): "resume carries on an aborted workflow",
    ("resume", "failed"): "retry runs a failed workflow's failed step again",
}
"""The verb that does what the operator meant, for a verb refused in a state."""


class WorkflowsApi:
    """The ``workflows.*`` routes."""

    def __init__(
        self,
        *,
        app: App,
        db: Database,
        profiles: ProfileStore,
        wake: Callable[[str], Awaitable[None]],
        publish: Publish,
        hooks: EngineHooks | None = None,
        site_admission: Callable[[], int] = lambda: 0,
    ) -> None:
        self.hooks = hooks if hooks is not None else EngineHooks()
        self.site_admission = site_admission
        """``[engine] site_admission`` in force (read at each start: it changes with bc.toml)."""
        self.app = app
        self.db = db
        self.profiles = profiles
        self.wake = wake
        self.publish = publish

    @property
    def host_config_owner(self) -> str | None:
        """The owner of a workflow on a node started without one whose profile has a hostConfig
        (metal, which makes the hostConfig the node's host section when it succeeds)."""
        return self.hooks.host_config_owner

    async def workflows_start(self, req: ApiRequest) -> m.WorkflowView:
        body = req.decode(m.StartWorkflow)
        if body.node_id is not None:
            parse_id(body.node_id, "node", path="nodeId")
        if body.id is not None:
            parse_id(body.id, "wf", path="id")
        try:
            return await self._start(body)
        except (asyncpg.UniqueViolationError, BcError):
            # Asked before with this id (a retry after a lost answer, or the same start twice
            # at once)? Then the id is taken, or its node busy with it, or its profile gone
            # since: answer with the workflow it made. Looked up only on this error path, so a
            # first start costs no extra read.
            again = await self._started_before(body) if body.id is not None else None
            if again is None:
                raise
            return again

    async def _started_before(self, body: m.StartWorkflow) -> m.WorkflowView | None:
        """The workflow an earlier start with ``body.id`` made; CONFLICT when it was another
        start (other profile, node or tenant) that took the id."""
        assert body.id is not None
        if await self.db.fetchrow(store.WORKFLOW, body.id) is None:
            return None
        view = await self._get(body.id)
        same = (view.tenant_id, view.profile.id, view.node_id) == (
            body.tenant_id,
            body.profile_id,
            body.node_id,
        )
        if not same or body.profile_version not in (None, view.profile.version):
            raise BcError(
                ErrorCode.CONFLICT,
                f"workflow {body.id} exists, started with other fields",
                {"path": "id", "reason": "id-taken", "workflowId": body.id},
            )
        return view

    async def _start(self, body: m.StartWorkflow) -> m.WorkflowView:
        start: dict[str, Any] = {
            "tenant_id": body.tenant_id,
            "profile_id": body.profile_id,
            "profile_version": body.profile_version,
            "node_id": body.node_id,
            "owner": body.owner,
            "workflow_id": body.id,
        }
        async with self.db.pool.acquire() as conn:
            found = await self.profiles.find(
                conn, tenant_id=body.tenant_id, profile_id=body.profile_id, version=body.profile_version
            )
            if body.owner is None and body.node_id is not None and found.profile.host_config is not None:
                start["owner"] = self.host_config_owner
            if body.node_id is None and found.immutable:
                # Nothing to pin and no node to lock: the one statement that writes
                # (START_WORKFLOW) is atomic alone, and a BEGIN and a COMMIT are two round trips.
                wf = await self.start_in(conn, **start, found=found)
            else:
                async with conn.transaction():
                    wf = await self.start_in(conn, **start, found=found)
        if wf["admitted"]:  # else an admission pass queues it (docs/engine.md, "Admission")
            await self.wake(wf["rkey"])
        doc: m.WorkflowView = wf["doc"]
        return doc

    async def start_in(
        self,
        conn: Any,
        *,
        tenant_id: str,
        profile_id: str,
        profile_version: int | None,
        node_id: str | None,
        owner: str | None,
        workflow_id: str | None = None,
        batch_id: str | None = None,
        found: FoundProfile | None = None,
        admission: bool = True,
    ) -> dict[str, Any]:
        """Start a workflow inside the caller's transaction (steps start children this way).

        Metal gives the workflow's id and its destructive batch, made before the start (a bulk
        verb's batch names every workflow it starts). ``found``: the profile, when the caller
        looked it up already. A workflow on a node waits for its site's admission
        (``[engine] site_admission``) unless ``admission`` is false (a step's children: the
        parent holds its site's room already and may wait for them). The answer's ``admitted``
        says whether it may run now (wake its key) or waits for an admission pass.
        """
        if found is None:
            found = await self.profiles.find(
                conn, tenant_id=tenant_id, profile_id=profile_id, version=profile_version
            )
        found = await self.profiles.pin(conn, found)
        if node_id is not None:
            node = await conn.fetchrow(store.LOCK_NODE, node_id)
            if node is None:
                raise BcError(ErrorCode.NOT_FOUND, f"no node {node_id}", {"path": "nodeId"})
            for check in self.hooks.start_checks:  # metal's: discovered, maintenance, quarantine
                check(node, owner)
            busy = await conn.fetchval(store.NODE_BUSY, node_id, None)
            if busy:
                raise BcError(
                    ErrorCode.CONFLICT,
                    f"node {node_id} already runs workflow {busy}",
                    {"path": "nodeId", "reason": "node-busy", "workflowId": busy},
                )
        res: Resolution = resolve_profile(self.app, found.profile, has_node=node_id is not None)
        if res.problems:
            raise res.problems[0].to_error(problems=[p.to_document() for p in res.problems])
        wf_id = workflow_id or new_id("wf")
        rkey = node_id or wf_id
        steps = [
            {"workflow_id": wf_id, "idx": s.idx, "action": s.action, "runs_on": s.runs_on, "mode": s.mode,
             "command": s.command, "input": s.input, "timeout_ms": s.timeout_ms, "state": "pending",
             "attempt": 0, "started_at": None, "deadline": None, "finished_at": None, "result": None,
             "error": None, "command_id": None, "sends": list(s.sends), "retry": s.retry}
            for s in res.steps
        ]  # fmt: skip
        row = await conn.fetchrow(
            store.START_WORKFLOW,
            wf_id, tenant_id, node_id, rkey, found.tenant_id, found.profile.id, found.profile.version,
            owner, res.command_kinds,
            [st["idx"] for st in steps], [st["action"] for st in steps], [st["runs_on"] for st in steps],
            [st["mode"] for st in steps], [st["command"] for st in steps],
            [json.dumps(st["input"]) for st in steps], [st["timeout_ms"] for st in steps],
            [json.dumps(st["sends"]) for st in steps], queue.shard_of(rkey),
            [json.dumps(st["retry"]) for st in steps], self.site_admission(), admission,
        )  # fmt: skip
        admitted = bool(row["admitted"])
        if batch_id is not None:
            row = await conn.fetchrow(store.SET_BATCH_RETURNING, wf_id, batch_id)
        return {"id": wf_id, "rkey": rkey, "admitted": admitted, "doc": workflow_doc(row, steps)}

    async def _get(
        self,
        workflow_id: str,
        *,
        steps_cursor: str | None = None,
        budget: int | None = None,
        conn: Any = None,
    ) -> m.WorkflowView:
        """The workflow with as many of its steps (from ``steps_cursor`` on) as fit in
        ``budget`` bytes; ``stepsNext`` is the cursor of the rest, or None. Read on ``conn``
        when given (inside the caller's transaction)."""
        db = conn if conn is not None else self.db
        after = decode_cursor(steps_cursor, int, path="stepsCursor")
        row = await db.fetchrow(store.WORKFLOW, workflow_id)
        if row is None:
            raise BcError(ErrorCode.NOT_FOUND, f"no workflow {workflow_id}", {"path": "id"})
        # Sizes first, rows second: 512 steps with big results never sit in memory at once.
        sizes = await db.fetch(store.STEP_SIZES, workflow_id, after[0] if after else -1)
        page, next_ = take_page(
            list(sizes), limit=MAX_PROFILE_STEPS, key=lambda r: (r["idx"],),
            budget=budget or PAGE_BUDGET, size=lambda r: int(r["size"]),
        )  # fmt: skip
        steps: list[Any] = []
        if page:
            steps = await db.fetch(store.STEPS_BETWEEN, workflow_id, page[0]["idx"], page[-1]["idx"])
        return workflow_doc(row, list(steps), steps_next=next_)

    async def workflows_get(self, req: ApiRequest) -> m.WorkflowView:
        body = req.decode(m.GetWorkflow)
        parse_id(body.id, "wf", path="id")
        return await self._get(body.id, steps_cursor=body.steps_cursor, budget=req.page_budget)

    async def workflows_list(self, req: ApiRequest) -> m.WorkflowList:
        body = req.decode(m.ListWorkflows)
        after = decode_cursor(body.cursor, str)
        rows = await self.db.fetch(
            store.LIST_WORKFLOWS,
            body.node_id, body.state, body.profile_id, body.tenant_id,
            after[0] if after else body.before, body.limit + 1,
        )  # fmt: skip
        docs, next_ = take_page(
            [workflow_doc(r) for r in rows], limit=body.limit, key=lambda d: (d.id,),
            budget=req.page_budget,
        )  # fmt: skip
        return m.WorkflowList(workflows=docs, next=next_)

    async def _verb(
        self, workflow_id: str, *, allowed: tuple[str, ...], verb: Verb, apply: Any
    ) -> m.WorkflowView:
        async with self.db.transaction() as conn:
            wf = await conn.fetchrow(store.LOCK_WORKFLOW, workflow_id)
            if wf is None:
                raise BcError(ErrorCode.NOT_FOUND, f"no workflow {workflow_id}", {"path": "id"})
            if wf["state"] not in allowed:
                instead = _INSTEAD.get((verb, wf["state"]))
                raise BcError(
                    ErrorCode.INVALID_STATE,
                    f"cannot {verb} a workflow that is {wf['state']}"
                    + (f"; {instead} (bcx workflows {instead.split()[0]} {workflow_id})" if instead else ""),
                    {"reason": f"workflow-{wf['state']}", "path": "id"},
                )
            if verb != "abort" and wf["node_id"] is not None:
                node = await conn.fetchrow(store.NODE, wf["node_id"])
                if node is not None:
                    for check in self.hooks.rerun_checks:  # metal's: maintenance
                        check(node, verb)
                busy = await conn.fetchval(store.NODE_BUSY, wf["node_id"], workflow_id)
                if busy:
                    raise BcError(
                        ErrorCode.CONFLICT,
                        f"node {wf['node_id']} runs workflow {busy} now",
                        {"reason": "node-busy", "workflowId": busy},
                    )
            await apply(conn, wf)
            await queue.queue_now(conn, wf["rkey"])
            # The state the verb left it in, read before the engine can run it on: read after
            # the wake-up, a retried step that passes at once showed `succeeded`, not `running`.
            doc = await self._get(workflow_id, conn=conn)
        await self.wake(wf["rkey"])
        if verb == "abort" and wf["owner"]:  # it ended: its owner looks now (a metal node fails)
            await self.wake(queue.owner_key(wf["owner"], wf["id"]))
        if verb == "abort":
            metrics.WORKFLOWS_FINISHED.labels(doc.profile.id, "aborted").inc()
        await self.publish(
            m.EVENTS,
            workflow_id,
            m.VerbApplied(workflow_id=workflow_id, workflow_state=doc.state, verb=verb),
        )
        return doc

    async def workflows_abort(self, req: ApiRequest) -> m.WorkflowView:
        body = req.decode(m.WorkflowVerb)
        reason = f"aborted by an operator: {body.reason}" if body.reason else "aborted by an operator"

        async def apply(conn: Any, wf: Any) -> None:
            # commands to cancel, or tokens and secrets the cancelled attempt minted to revoke
            sent = await conn.fetchval(store.ABORT_LEAVES_WORK, wf["id"])
            error = json.dumps({"code": "INVALID_STATE", "message": reason, "details": {"reason": "aborted"}})
            await conn.execute(store.ABORT_STEP, wf["id"], error)
            await conn.execute(store.ABORT_WORKFLOW, wf["id"], bool(sent), error)
            if wf["owner"]:
                await queue.queue_now(conn, queue.owner_key(wf["owner"], wf["id"]))

        return await self._verb(body.id, allowed=("running",), verb="abort", apply=apply)

    async def _reopen(self, conn: Any, wf: Any, from_states: tuple[str, ...]) -> None:
        """The step that stopped the workflow goes back to pending; its next run is a new attempt.
        The hooks undo the rest (a metal workflow's node goes back from failed to the verb's
        running state, its closed batch opens again)."""
        await conn.execute(store.REOPEN_STEP, wf["id"], list(from_states))
        await conn.execute(store.REOPEN_WORKFLOW, wf["id"])
        for reopen in self.hooks.reopen:
            await reopen(conn, wf)

    async def workflows_retry(self, req: ApiRequest) -> m.WorkflowView:
        """A failed workflow runs its failed step again, as a new attempt."""
        body = req.decode(m.WorkflowVerb)

        async def apply(conn: Any, wf: Any) -> None:
            await self._reopen(conn, wf, ("failed",))

        return await self._verb(body.id, allowed=("failed",), verb="retry", apply=apply)

    async def workflows_resume(self, req: ApiRequest) -> m.WorkflowView:
        """An aborted workflow carries on from the step the abort cancelled, as a new attempt."""
        body = req.decode(m.WorkflowVerb)

        async def apply(conn: Any, wf: Any) -> None:
            await self._reopen(conn, wf, ("cancelled", "pending"))

        return await self._verb(body.id, allowed=("aborted",), verb="resume", apply=apply)
