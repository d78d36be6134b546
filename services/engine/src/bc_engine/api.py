"""``bc.api.engine.*``: nodes, profiles and workflows."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from better_compute.app import App
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id, parse_id
from better_compute.provision.profiles import MAX_PROFILE_STEPS
from better_compute.service import ApiRequest
from better_compute.wire import engine as m
from better_compute.wire.paging import PAGE_BUDGET, decode_cursor, take_page

from . import queue, store
from .discovery import refuse_discovered
from .documents import check_document, check_labels, node_doc, workflow_doc
from .images_api import ImagesApi
from .metal_api import MetalApi, bmc_json, check_macs, refuse_inline_secret
from .metal_lifecycle import current_workflow, reopen_node
from .node_events import node_event, node_removed
from .profiles import FoundProfile, ProfileStore, parse_document
from .resolve import Resolution, resolve_profile

__all__ = ["EngineApi"]

Verb = Literal["abort", "retry", "resume"]


class EngineApi:
    def __init__(
        self,
        *,
        app: App,
        db: Any,
        wake: Callable[[str], Awaitable[None]],
        publish: Callable[[str, str, Any], Awaitable[None]],
        quorum: Any = None,
    ) -> None:
        self.app = app
        self.db = db
        self.profiles = ProfileStore(app)
        self.wake = wake
        self.publish = publish
        self.metal = MetalApi(self, quorum)

    def routes(self) -> dict[str, Callable[[ApiRequest], Awaitable[Any]]]:
        return {
            "nodes.create": self.nodes_create,
            "nodes.get": self.nodes_get,
            "nodes.list": self.nodes_list,
            "nodes.update": self.nodes_update,
            "nodes.label": self.nodes_label,
            "nodes.delete": self.nodes_delete,
            "steps.list": self.steps_list,
            "profiles.create": self.profiles_create,
            "profiles.get": self.profiles_get,
            "profiles.list": self.profiles_list,
            "profiles.delete": self.profiles_delete,
            "profiles.validate": self.profiles_validate,
            "profiles.render": self.profiles_render,
            "workflows.start": self.workflows_start,
            "workflows.get": self.workflows_get,
            "workflows.list": self.workflows_list,
            "workflows.abort": self.workflows_abort,
            "workflows.retry": self.workflows_retry,
            "workflows.resume": self.workflows_resume,
            **ImagesApi(app=self.app, db=self.db).routes(),
            **self.metal.routes(),
        }

    # -- nodes ------------------------------------------------------------------

    async def nodes_create(self, req: ApiRequest) -> m.NodeView:
        """A node in ``enrolled`` (``metal.enroll`` also enrolls a discovered one)."""
        body = req.decode(m.CreateNode)
        refuse_inline_secret(req)
        check_labels(body.labels)
        node_id = parse_id(body.id, "node", path="id") if body.id else new_id("node")
        async with self.db.transaction() as conn:
            macs = await check_macs(conn, body.macs, node_id)
            row = await conn.fetchrow(
                store.CREATE_NODE, node_id, body.tenant_id, body.site_id, json.dumps(body.labels),
                macs, bmc_json(body.bmc),
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
        cmdq = self.metal.quorum.cmdq if self.metal.quorum is not None else None
        return node_doc(row, full=True, current_workflow=await current_workflow(self.db, row, cmdq))

    async def nodes_list(self, req: ApiRequest) -> m.NodeList:
        body = req.decode(m.ListNodes)
        after = decode_cursor(body.cursor, str)
        rows = await self.db.fetch(
            store.LIST_NODES,
            body.site_id, body.tenant_id, after[0] if after else None, body.limit + 1,
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
        """Replace the node's site and/or all its labels (the bounds of ``nodes.create``); the
        site only while no workflow runs on the node (its commands go to that site)."""
        body = req.decode(m.UpdateNode)
        refuse_inline_secret(req)
        if body.labels is not None:
            check_labels(body.labels)
        async with self.db.transaction() as conn:
            row = await self._locked_node(conn, body.id)
            if body.site_id is not None and body.site_id != row["site_id"]:
                await self._refuse_busy(conn, body.id, "change its site")
            labels = json.dumps(body.labels) if body.labels is not None else None
            macs = await check_macs(conn, body.macs, body.id) if body.macs is not None else None
            row = await conn.fetchrow(
                store.UPDATE_NODE, body.id, body.site_id, labels, macs, bmc_json(body.bmc)
            )
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
            row = await conn.fetchrow(store.UPDATE_NODE, body.id, None, json.dumps(labels), None, None)
        await node_event(self.publish, row, verb="label")
        return node_doc(row)

    async def nodes_delete(self, req: ApiRequest) -> m.NodeDeleted:
        """Forget a node; refused while a workflow runs on it. Finished workflows are kept."""
        body = req.decode(m.DeleteNode)
        async with self.db.transaction() as conn:
            await self._locked_node(conn, body.id)
            await self._refuse_busy(conn, body.id, "delete it")
            await conn.execute(store.DETACH_NODE_WORKFLOWS, body.id)
            await conn.execute(store.DELETE_NODE, body.id)
        await node_removed(self.publish, body.id)
        return m.NodeDeleted(deleted=body.id)

    # -- steps ----------------------------------------------------------------

    async def steps_list(self, req: ApiRequest) -> m.StepList:
        """The steps a profile's ``use`` resolves to and the driver operations, with their inputs."""
        req.decode(m.ListSteps)
        steps = [
            m.StepInfo(
                id=s.id,
                runs_on=s.runs_on,
                relays=list(s.relays),
                command=s.command,
                sends=list(s.sends),
                timeout_ms=s.timeout_ms,
                retry_safe=s.retry_safe,
                description=s.description,
                input=s.input.json_schema(),
            )
            for s in sorted(self.app.steps.values(), key=lambda s: s.id)
        ]
        operations = [
            m.DriverOperationInfo(name=o.name, description=o.description, input=o.input.json_schema())
            for o in sorted(self.app.driver_operations.values(), key=lambda o: o.name)
        ]
        return m.StepList(steps=steps, driver_operations=operations)

    # -- profiles -------------------------------------------------------------

    async def profiles_create(self, req: ApiRequest) -> m.ProfileView:
        body = req.decode(m.CreateProfile)
        check_document(body.document)
        try:
            # A profile that does not validate is refused, every problem listed (as validate does).
            res = resolve_profile(self.app, parse_document(body.document))
            if res.problems:
                raise res.problems[0].to_error(problems=[p.to_document() for p in res.problems])
            async with self.db.transaction() as conn:
                found = await self.profiles.create(
                    conn,
                    tenant_id=body.tenant_id,
                    document=body.document,
                    public=body.public,
                    replace=body.replace,
                )
        except BcError as err:
            if err.code is ErrorCode.INVALID_CONFIG:
                raise err.with_path_prefix("document") from err
            raise
        return found.view()

    async def profiles_get(self, req: ApiRequest) -> m.ProfileView:
        body = req.decode(m.GetProfile)
        async with self.db.transaction() as conn:
            found = await self.profiles.find(
                conn, tenant_id=body.tenant_id, profile_id=body.id, version=body.version
            )
        return found.view()

    async def profiles_list(self, req: ApiRequest) -> m.ProfileList:
        body = req.decode(m.ListProfiles)
        after = decode_cursor(body.cursor, str, int, str)
        async with self.db.transaction() as conn:
            found = await self.profiles.list(
                conn, tenant_id=body.tenant_id, after=after, limit=body.limit + 1
            )
        page, next_ = take_page(
            [f.summary() for f in found], limit=body.limit, key=lambda d: (d.id, d.version, d.tenant_id),
            budget=req.page_budget,
        )  # fmt: skip
        return m.ProfileList(profiles=page, next=next_)

    async def profiles_delete(self, req: ApiRequest) -> m.ProfileDeleted:
        body = req.decode(m.DeleteProfile)
        async with self.db.transaction() as conn:
            await self.profiles.delete(
                conn, tenant_id=body.tenant_id, profile_id=body.id, version=body.version
            )
        return m.ProfileDeleted(deleted=True)

    async def _profile_for(self, body: m.ProfileRef) -> FoundProfile:
        if body.document is not None:
            check_document(body.document)
            try:
                profile = parse_document(body.document)
            except BcError as err:
                raise err.with_path_prefix("document") from err
            return FoundProfile(profile, body.tenant_id, False, None)
        if body.id is None:
            raise BcError(ErrorCode.INVALID_INPUT, "give a profile id or a document", {"path": "id"})
        async with self.db.transaction() as conn:
            return await self.profiles.find(
                conn, tenant_id=body.tenant_id, profile_id=body.id, version=body.version
            )

    async def profiles_validate(self, req: ApiRequest) -> m.ProfileValidation:
        """Every unresolved ``use`` and rejected ``with``, each with its path."""
        body = req.decode(m.ProfileRef)
        try:
            found = await self._profile_for(body)
        except BcError as err:
            if err.code is not ErrorCode.INVALID_CONFIG:
                raise
            problem = m.Problem(path=err.path or "", code=err.code.value, message=err.message)
            return m.ProfileValidation(valid=False, problems=[problem])
        res = resolve_profile(self.app, found.profile)
        return m.ProfileValidation(
            valid=not res.problems,
            profile=m.ProfileKey(id=found.profile.id, version=found.profile.version),
            problems=[p.view() for p in res.problems],
            command_kinds=res.command_kinds,
        )

    async def profiles_render(self, req: ApiRequest) -> m.ProfileRendering:
        """The expanded steps, as a workflow would persist them."""
        body = req.decode(m.ProfileRef)
        found = await self._profile_for(body)
        res = resolve_profile(self.app, found.profile)
        if res.problems:
            raise res.problems[0].to_error(problems=[p.to_document() for p in res.problems])
        return m.ProfileRendering(
            profile=m.ProfileKey(id=found.profile.id, version=found.profile.version),
            steps=[s.view() for s in res.steps],
            command_kinds=res.command_kinds,
        )

    # -- workflows ----------------------------------------------------------------

    async def workflows_start(self, req: ApiRequest) -> m.WorkflowView:
        body = req.decode(m.StartWorkflow)
        if body.node_id is not None:
            parse_id(body.node_id, "node", path="nodeId")
        async with self.db.transaction() as conn:
            wf = await self.start_in(
                conn,
                tenant_id=body.tenant_id,
                profile_id=body.profile_id,
                profile_version=body.profile_version,
                node_id=body.node_id,
                owner=body.owner,
            )
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
    ) -> dict[str, Any]:
        """Start a workflow inside the caller's transaction (steps start children this way).

        Metal gives the workflow's id and its destructive batch, made before the start (a bulk
        verb's batch names every workflow it starts).
        """
        found = await self.profiles.find(
            conn, tenant_id=tenant_id, profile_id=profile_id, version=profile_version
        )
        found = await self.profiles.pin(conn, found)
        if node_id is not None:
            node = await conn.fetchrow(store.LOCK_NODE, node_id)
            if node is None:
                raise BcError(ErrorCode.NOT_FOUND, f"no node {node_id}", {"path": "nodeId"})
            refuse_discovered(node)
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
             "error": None, "command_id": None, "sends": list(s.sends)}
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
        )  # fmt: skip
        if batch_id is not None:
            row = await conn.fetchrow(store.SET_BATCH_RETURNING, wf_id, batch_id)
        return {"id": wf_id, "rkey": rkey, "doc": workflow_doc(row, steps)}

    async def _get(
        self, workflow_id: str, *, steps_cursor: str | None = None, budget: int | None = None
    ) -> m.WorkflowView:
        """The workflow with as many of its steps (from ``steps_cursor`` on) as fit in
        ``budget`` bytes; ``stepsNext`` is the cursor of the rest, or None."""
        after = decode_cursor(steps_cursor, int, path="stepsCursor")
        row = await self.db.fetchrow(store.WORKFLOW, workflow_id)
        if row is None:
            raise BcError(ErrorCode.NOT_FOUND, f"no workflow {workflow_id}", {"path": "id"})
        # Sizes first, rows second: 512 steps with big results never sit in memory at once.
        sizes = await self.db.fetch(store.STEP_SIZES, workflow_id, after[0] if after else -1)
        page, next_ = take_page(
            list(sizes), limit=MAX_PROFILE_STEPS, key=lambda r: (r["idx"],),
            budget=budget or PAGE_BUDGET, size=lambda r: int(r["size"]),
        )  # fmt: skip
        steps = []
        if page:
            steps = await self.db.fetch(store.STEPS_BETWEEN, workflow_id, page[0]["idx"], page[-1]["idx"])
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
                raise BcError(
                    ErrorCode.INVALID_STATE,
                    f"cannot {verb} a workflow that is {wf['state']}",
                    {"reason": f"workflow-{wf['state']}", "path": "id"},
                )
            if verb != "abort" and wf["node_id"] is not None:
                busy = await conn.fetchval(store.NODE_BUSY, wf["node_id"], workflow_id)
                if busy:
                    raise BcError(
                        ErrorCode.CONFLICT,
                        f"node {wf['node_id']} runs workflow {busy} now",
                        {"reason": "node-busy", "workflowId": busy},
                    )
            await apply(conn, wf)
            await queue.queue_now(conn, wf["rkey"])
        await self.wake(wf["rkey"])
        doc = await self._get(workflow_id)
        await self.publish(
            m.EVENTS,
            workflow_id,
            m.VerbApplied(workflow_id=workflow_id, workflow_state=doc.state, verb=verb),
        )
        return doc

    async def workflows_abort(self, req: ApiRequest) -> m.WorkflowView:
        body = req.decode(m.WorkflowVerb)
        reason = body.reason or "aborted by an operator"

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
        A metal workflow's node goes back from failed to the verb's running state."""
        await conn.execute(store.REOPEN_STEP, wf["id"], list(from_states))
        await conn.execute(store.REOPEN_WORKFLOW, wf["id"])
        node = await reopen_node(conn, wf)
        if node is not None:
            await node_event(self.publish, node, verb="retry")

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
