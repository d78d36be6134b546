"""``bc.api.engine.*``: nodes, profiles and workflows."""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

from better_compute.app import App
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id, parse_id
from better_compute.provision.profiles import MAX_PROFILE_STEPS
from better_compute.service import ApiRequest
from better_compute.wire.codec import encode
from better_compute.wire.paging import PAGE_BUDGET, decode_cursor, take_page

from . import messages as m
from . import queue
from .profiles import FoundProfile, ProfileStore, parse_document
from .resolve import Resolution, resolve_profile

__all__ = ["EngineApi", "check_document", "check_labels"]

_LABEL_KEY_RE: Final = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?$")
_CONTROL_RE: Final = re.compile(r"[\x00-\x1f\x7f]")


def _too_big(path: str, message: str) -> BcError:
    return BcError(ErrorCode.INVALID_INPUT, message, {"path": path})


def check_labels(labels: Mapping[str, str], path: str = "labels") -> None:
    """Refuse labels beyond their bounds, naming the label (``labels.rack``).

    At most ``MAX_LABELS``; keys of letters, digits and ``._/-`` (starting and ending with a
    letter or digit, at most ``MAX_LABEL_KEY``); values of at most ``MAX_LABEL_VALUE``
    characters without control characters.
    """
    if len(labels) > m.MAX_LABELS:
        raise _too_big(path, f"a node has at most {m.MAX_LABELS} labels, got {len(labels)}")
    for key, value in labels.items():
        if not _LABEL_KEY_RE.match(key):
            raise _too_big(
                path,
                f"label key {key[:80]!r} is not 1 to {m.MAX_LABEL_KEY} letters, digits and ._/-"
                " (starting and ending with a letter or digit)",
            )
        if len(value) > m.MAX_LABEL_VALUE or _CONTROL_RE.search(value):
            raise _too_big(
                f"{path}.{key}",
                f"label {key} must be at most {m.MAX_LABEL_VALUE} characters without control"
                f" characters (got {len(value)})",
            )


def check_document(document: Mapping[str, Any], path: str = "document") -> None:
    """Refuse a profile document beyond ``MAX_DOCUMENT_BYTES``, or a step whose ``with``
    is beyond ``MAX_STEP_INPUT_BYTES`` (as JSON), before it is parsed or stored."""
    size = len(encode(document))
    if size > m.MAX_DOCUMENT_BYTES:
        raise _too_big(path, f"a profile document is at most {m.MAX_DOCUMENT_BYTES} bytes, got {size}")
    steps = document.get("steps")
    if not isinstance(steps, list):
        return
    for i, step in enumerate(steps):
        if isinstance(step, Mapping) and step.get("with") is not None:
            size = len(encode(step["with"]))
            if size > m.MAX_STEP_INPUT_BYTES:
                raise _too_big(
                    f"{path}.steps[{i}].with",
                    f"a step's with is at most {m.MAX_STEP_INPUT_BYTES} bytes, got {size}",
                )


# A workflow, its steps and its work-queue entry in one statement.
START_WORKFLOW = """
WITH wf AS (
    INSERT INTO workflows (id, tenant_id, node_id, rkey, profile_tenant, profile_id, profile_version,
                           state, owner, command_kinds)
    VALUES ($1, $2, $3, $4, $5, $6, $7, 'running', $8, $9)
    RETURNING *
), steps AS (
    INSERT INTO workflow_steps (workflow_id, idx, action, runs_on, mode, command, input, timeout_ms,
                                state, sends)
    SELECT $1, s.idx, s.action, s.runs_on, s.mode, s.command, s.input, s.timeout_ms, 'pending',
           ARRAY(SELECT jsonb_array_elements_text(s.sends))
    FROM unnest($10::int[], $11::text[], $12::text[], $13::text[], $14::text[], $15::jsonb[],
                $16::bigint[], $17::jsonb[])
         AS s(idx, action, runs_on, mode, command, input, timeout_ms, sends)
    RETURNING 1
), queued AS (
    INSERT INTO work_queue (rkey, shard, not_before) VALUES ($4, $18, now())
    ON CONFLICT (rkey) DO UPDATE SET not_before = now(), seq = nextval('work_seq')
    RETURNING 1
)
SELECT wf.*, (SELECT count(*) FROM steps) AS step_count FROM wf
"""


def _iso(value: Any) -> str | None:
    return value.isoformat() if value is not None else None


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def node_doc(row: Any) -> dict[str, Any]:
    return {
        "id": row["id"],
        "tenantId": row["tenant_id"],
        "siteId": row["site_id"],
        "labels": _json(row["labels"]),
        "generation": row["generation"],
        "observedGeneration": row["observed_generation"],
        "createdAt": _iso(row["created_at"]),
    }


def workflow_doc(row: Any, steps: list[Any] | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "id": row["id"],
        "tenantId": row["tenant_id"],
        "nodeId": row["node_id"],
        "profile": {
            "tenantId": row["profile_tenant"],
            "id": row["profile_id"],
            "version": row["profile_version"],
        },
        "state": row["state"],
        "owner": row["owner"],
        "commandKinds": list(row["command_kinds"]),
        "batchId": row["batch_id"],
        "error": _json(row["error"]),
        "createdAt": _iso(row["created_at"]),
        "finishedAt": _iso(row["finished_at"]),
    }
    if steps is not None:
        doc["steps"] = [
            {
                "index": s["idx"],
                "action": s["action"],
                "runsOn": s["runs_on"],
                "mode": s["mode"],
                "command": s["command"],
                "state": s["state"],
                "attempt": s["attempt"],
                "startedAt": _iso(s["started_at"]),
                "deadline": _iso(s["deadline"]),
                "finishedAt": _iso(s["finished_at"]),
                "result": _json(s["result"]),
                "error": _json(s["error"]),
                "commandId": s["command_id"],
                "waitingFor": _json(s.get("waiting_for")) if s["state"] in ("pending", "running") else None,
            }
            for s in steps
        ]
    return doc


class EngineApi:
    def __init__(
        self,
        *,
        app: App,
        db: Any,
        wake: Callable[[str], Awaitable[None]],
        publish: Callable[[str, str, Any], Awaitable[None]],
    ) -> None:
        self.app = app
        self.db = db
        self.profiles = ProfileStore(app)
        self.wake = wake
        self.publish = publish

    def routes(self) -> dict[str, Callable[[ApiRequest], Awaitable[Any]]]:
        return {
            "nodes.create": self.nodes_create,
            "nodes.get": self.nodes_get,
            "nodes.list": self.nodes_list,
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
        }

    # -- nodes ------------------------------------------------------------------

    async def nodes_create(self, req: ApiRequest) -> dict[str, Any]:
        body = req.decode(m.CreateNode)
        check_labels(body.labels)
        node_id = parse_id(body.id, "node", path="id") if body.id else new_id("node")
        row = await self.db.fetchrow(
            "INSERT INTO nodes (id, tenant_id, site_id, labels) VALUES ($1, $2, $3, $4)"
            " ON CONFLICT (id) DO NOTHING RETURNING *",
            node_id, body.tenant_id, body.site_id, json.dumps(body.labels),
        )  # fmt: skip
        if row is None:
            raise BcError(ErrorCode.CONFLICT, f"node {node_id} exists", {"path": "id"})
        return node_doc(row)

    async def nodes_get(self, req: ApiRequest) -> dict[str, Any]:
        body = req.decode(m.GetNode)
        row = await self.db.fetchrow("SELECT * FROM nodes WHERE id = $1", body.id)
        if row is None:
            raise BcError(ErrorCode.NOT_FOUND, f"no node {body.id}", {"path": "id"})
        return node_doc(row)

    async def nodes_list(self, req: ApiRequest) -> dict[str, Any]:
        body = req.decode(m.ListNodes)
        after = decode_cursor(body.cursor, str)
        rows = await self.db.fetch(
            "SELECT * FROM nodes WHERE ($1::text IS NULL OR site_id = $1)"
            " AND ($2::text IS NULL OR tenant_id = $2) AND ($3::text IS NULL OR id > $3)"
            " ORDER BY id LIMIT $4",
            body.site_id, body.tenant_id, after[0] if after else None, body.limit + 1,
        )  # fmt: skip
        docs, next_ = take_page(
            [node_doc(r) for r in rows], limit=body.limit, key=lambda d: (d["id"],), budget=req.page_budget
        )
        return {"nodes": docs, "next": next_}

    # -- profiles -------------------------------------------------------------

    async def profiles_create(self, req: ApiRequest) -> dict[str, Any]:
        body = req.decode(m.CreateProfile)
        check_document(body.document)
        try:
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
        return found.to_document()

    async def profiles_get(self, req: ApiRequest) -> dict[str, Any]:
        body = req.decode(m.GetProfile)
        async with self.db.transaction() as conn:
            found = await self.profiles.find(
                conn, tenant_id=body.tenant_id, profile_id=body.id, version=body.version
            )
        return found.to_document()

    async def profiles_list(self, req: ApiRequest) -> dict[str, Any]:
        body = req.decode(m.ListProfiles)
        after = decode_cursor(body.cursor, str, int, str)
        async with self.db.transaction() as conn:
            found = await self.profiles.list(
                conn, tenant_id=body.tenant_id, after=after, limit=body.limit + 1
            )
        docs = []
        for f in found:
            d = f.to_document()
            d.pop("document")
            d["steps"] = len(f.profile.steps)
            d["target"] = f.profile.target
            docs.append(d)
        page, next_ = take_page(
            docs, limit=body.limit, key=lambda d: (d["id"], d["version"], d["tenantId"]),
            budget=req.page_budget,
        )  # fmt: skip
        return {"profiles": page, "next": next_}

    async def profiles_delete(self, req: ApiRequest) -> dict[str, Any]:
        body = req.decode(m.DeleteProfile)
        async with self.db.transaction() as conn:
            await self.profiles.delete(
                conn, tenant_id=body.tenant_id, profile_id=body.id, version=body.version
            )
        return {"deleted": True}

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

    async def profiles_validate(self, req: ApiRequest) -> dict[str, Any]:
        """Every unresolved ``use`` and rejected ``with``, each with its path."""
        body = req.decode(m.ProfileRef)
        try:
            found = await self._profile_for(body)
        except BcError as err:
            if err.code is not ErrorCode.INVALID_CONFIG:
                raise
            problem = {"path": err.path or "", "code": err.code.value, "message": err.message}
            return {"valid": False, "problems": [problem]}
        res = resolve_profile(self.app, found.profile)
        return {
            "valid": not res.problems,
            "profile": {"id": found.profile.id, "version": found.profile.version},
            "problems": [p.to_document() for p in res.problems],
            "commandKinds": res.command_kinds,
        }

    async def profiles_render(self, req: ApiRequest) -> dict[str, Any]:
        """The expanded steps, as a workflow would persist them."""
        body = req.decode(m.ProfileRef)
        found = await self._profile_for(body)
        res = resolve_profile(self.app, found.profile)
        if res.problems:
            raise res.problems[0].to_error(problems=[p.to_document() for p in res.problems])
        return {
            "profile": {"id": found.profile.id, "version": found.profile.version},
            "steps": [s.to_document() for s in res.steps],
            "commandKinds": res.command_kinds,
        }

    # -- workflows ----------------------------------------------------------------

    async def workflows_start(self, req: ApiRequest) -> dict[str, Any]:
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
        doc: dict[str, Any] = wf["doc"]
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
    ) -> dict[str, Any]:
        """Start a workflow inside the caller's transaction (steps start children this way)."""
        found = await self.profiles.find(
            conn, tenant_id=tenant_id, profile_id=profile_id, version=profile_version
        )
        found = await self.profiles.pin(conn, found)
        if node_id is not None:
            node = await conn.fetchrow("SELECT id FROM nodes WHERE id = $1 FOR UPDATE", node_id)
            if node is None:
                raise BcError(ErrorCode.NOT_FOUND, f"no node {node_id}", {"path": "nodeId"})
            busy = await conn.fetchval(
                "SELECT id FROM workflows WHERE node_id = $1 AND state = 'running'", node_id
            )
            if busy:
                raise BcError(
                    ErrorCode.CONFLICT,
                    f"node {node_id} already runs workflow {busy}",
                    {"path": "nodeId", "reason": "node-busy", "workflowId": busy},
                )
        res: Resolution = resolve_profile(self.app, found.profile, has_node=node_id is not None)
        if res.problems:
            raise res.problems[0].to_error(problems=[p.to_document() for p in res.problems])
        wf_id = new_id("wf")
        rkey = node_id or wf_id
        steps = [
            {"workflow_id": wf_id, "idx": s.idx, "action": s.action, "runs_on": s.runs_on, "mode": s.mode,
             "command": s.command, "input": s.input, "timeout_ms": s.timeout_ms, "state": "pending",
             "attempt": 0, "started_at": None, "deadline": None, "finished_at": None, "result": None,
             "error": None, "command_id": None, "sends": list(s.sends)}
            for s in res.steps
        ]  # fmt: skip
        row = await conn.fetchrow(
            START_WORKFLOW,
            wf_id, tenant_id, node_id, rkey, found.tenant_id, found.profile.id, found.profile.version,
            owner, res.command_kinds,
            [st["idx"] for st in steps], [st["action"] for st in steps], [st["runs_on"] for st in steps],
            [st["mode"] for st in steps], [st["command"] for st in steps],
            [json.dumps(st["input"]) for st in steps], [st["timeout_ms"] for st in steps],
            [json.dumps(st["sends"]) for st in steps], queue.shard_of(rkey),
        )  # fmt: skip
        return {"id": wf_id, "rkey": rkey, "doc": workflow_doc(row, steps)}

    async def _get(
        self, workflow_id: str, *, steps_cursor: str | None = None, budget: int | None = None
    ) -> dict[str, Any]:
        """The workflow with as many of its steps (from ``steps_cursor`` on) as fit in
        ``budget`` bytes; ``stepsNext`` is the cursor of the rest, or None."""
        after = decode_cursor(steps_cursor, int, path="stepsCursor")
        row = await self.db.fetchrow("SELECT * FROM workflows WHERE id = $1", workflow_id)
        if row is None:
            raise BcError(ErrorCode.NOT_FOUND, f"no workflow {workflow_id}", {"path": "id"})
        # Sizes first, rows second: 512 steps with big results never sit in memory at once.
        sizes = await self.db.fetch(
            "SELECT idx, 512 + coalesce(octet_length(result::text), 0)"
            " + coalesce(octet_length(error::text), 0) AS size"
            " FROM workflow_steps WHERE workflow_id = $1 AND idx > $2 ORDER BY idx",
            workflow_id, after[0] if after else -1,
        )  # fmt: skip
        page, next_ = take_page(
            list(sizes), limit=MAX_PROFILE_STEPS, key=lambda r: (r["idx"],),
            budget=budget or PAGE_BUDGET, size=lambda r: int(r["size"]),
        )  # fmt: skip
        steps = []
        if page:
            steps = await self.db.fetch(
                "SELECT * FROM workflow_steps WHERE workflow_id = $1 AND idx BETWEEN $2 AND $3"
                " ORDER BY idx",
                workflow_id, page[0]["idx"], page[-1]["idx"],
            )  # fmt: skip
        doc = workflow_doc(row, list(steps))
        doc["stepsNext"] = next_
        return doc

    async def workflows_get(self, req: ApiRequest) -> dict[str, Any]:
        body = req.decode(m.GetWorkflow)
        return await self._get(body.id, steps_cursor=body.steps_cursor, budget=req.page_budget)

    async def workflows_list(self, req: ApiRequest) -> dict[str, Any]:
        body = req.decode(m.ListWorkflows)
        after = decode_cursor(body.cursor, str)
        rows = await self.db.fetch(
            "SELECT * FROM workflows WHERE ($1::text IS NULL OR node_id = $1)"
            " AND ($2::text IS NULL OR state = $2) AND ($3::text IS NULL OR profile_id = $3)"
            " AND ($4::text IS NULL OR tenant_id = $4) AND ($5::text IS NULL OR id < $5)"
            " ORDER BY id DESC LIMIT $6",
            body.node_id, body.state, body.profile_id, body.tenant_id,
            after[0] if after else body.before, body.limit + 1,
        )  # fmt: skip
        docs, next_ = take_page(
            [workflow_doc(r) for r in rows], limit=body.limit, key=lambda d: (d["id"],),
            budget=req.page_budget,
        )  # fmt: skip
        return {"workflows": docs, "next": next_}

    async def _verb(
        self, workflow_id: str, *, allowed: tuple[str, ...], verb: str, apply: Any
    ) -> dict[str, Any]:
        async with self.db.transaction() as conn:
            wf = await conn.fetchrow("SELECT * FROM workflows WHERE id = $1 FOR UPDATE", workflow_id)
            if wf is None:
                raise BcError(ErrorCode.NOT_FOUND, f"no workflow {workflow_id}", {"path": "id"})
            if wf["state"] not in allowed:
                raise BcError(
                    ErrorCode.INVALID_STATE,
                    f"cannot {verb} a workflow that is {wf['state']}",
                    {"reason": f"workflow-{wf['state']}", "path": "id"},
                )
            if verb != "abort" and wf["node_id"] is not None:
                busy = await conn.fetchval(
                    "SELECT id FROM workflows WHERE node_id = $1 AND state = 'running' AND id <> $2",
                    wf["node_id"], workflow_id,
                )  # fmt: skip
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
            "workflow",
            workflow_id,
            {"workflowId": workflow_id, "workflowState": doc["state"], "verb": verb},
        )
        return doc

    async def workflows_abort(self, req: ApiRequest) -> dict[str, Any]:
        body = req.decode(m.WorkflowVerb)
        reason = body.reason or "aborted by an operator"

        async def apply(conn: Any, wf: Any) -> None:
            # commands to cancel, or tokens and secrets the cancelled attempt minted to revoke
            sent = await conn.fetchval(
                "SELECT bool_or(sent_commands OR (state IN ('pending', 'running')"
                " AND cardinality(minted) > 0)) FROM workflow_steps WHERE workflow_id = $1",
                wf["id"],
            )
            error = json.dumps({"code": "INVALID_STATE", "message": reason, "details": {"reason": "aborted"}})
            await conn.execute(
                "UPDATE workflow_steps SET state = 'cancelled', finished_at = now(),"
                " error = $2 WHERE workflow_id = $1 AND state IN ('pending', 'running')"
                " AND idx = (SELECT min(idx) FROM workflow_steps WHERE workflow_id = $1"
                "   AND state IN ('pending', 'running'))",
                wf["id"],
                json.dumps({"code": "INVALID_STATE", "message": reason, "details": {"reason": "aborted"}}),
            )
            await conn.execute(
                "UPDATE workflows SET state = 'aborted', finished_at = now(), updated_at = now(),"
                " cancel_commands = $2, error = $3 WHERE id = $1",
                wf["id"], bool(sent), error,
            )  # fmt: skip
            if wf["owner"]:
                await queue.queue_now(conn, queue.owner_key(wf["owner"], wf["id"]))

        return await self._verb(body.id, allowed=("running",), verb="abort", apply=apply)

    async def _reopen(self, conn: Any, wf: Any, from_states: tuple[str, ...]) -> None:
        """The step that stopped the workflow goes back to pending; its next run is a new attempt."""
        await conn.execute(
            "UPDATE workflow_steps SET state = 'pending', finished_at = NULL"
            " WHERE workflow_id = $1 AND idx = (SELECT min(idx) FROM workflow_steps"
            "   WHERE workflow_id = $1 AND state = ANY($2::text[]))",
            wf["id"], list(from_states),
        )  # fmt: skip
        await conn.execute(
            "UPDATE workflows SET state = 'running', finished_at = NULL, error = NULL,"
            " cancel_commands = false, updated_at = now() WHERE id = $1",
            wf["id"],
        )

    async def workflows_retry(self, req: ApiRequest) -> dict[str, Any]:
        """A failed workflow runs its failed step again, as a new attempt."""
        body = req.decode(m.WorkflowVerb)

        async def apply(conn: Any, wf: Any) -> None:
            await self._reopen(conn, wf, ("failed",))

        return await self._verb(body.id, allowed=("failed",), verb="retry", apply=apply)

    async def workflows_resume(self, req: ApiRequest) -> dict[str, Any]:
        """An aborted workflow carries on from the step the abort cancelled, as a new attempt."""
        body = req.decode(m.WorkflowVerb)

        async def apply(conn: Any, wf: Any) -> None:
            await self._reopen(conn, wf, ("cancelled", "pending"))

        return await self._verb(body.id, allowed=("aborted",), verb="resume", apply=apply)
