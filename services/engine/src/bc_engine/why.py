"""``workflows.why``: what a node's or a workflow's current step waits for, in one answer.

Everything is read from the stores, nothing is guessed: the step row (``waiting_for``: the step's
own ``step_not_ready`` reason, a service that does not answer, an earlier attempt's commands;
``retry_at``: its retry policy's backoff; its deadline), and from the command-queue the step
attempt's live commands (pending with no connected agent at the site, or dispatched/running on
an agent since when), their batch's approvals (M of N, from whom), the node's last failed
command (the BMC error its site agent reported), and, once the workflow ended, its commands still
``cancelling`` (cancelled after their agent claimed them, not yet confirmed stopped there: they
may still reach the machine) with the agent's last try.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

import msgspec

from better_compute.clients.cmdq import CommandQueueClient
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import parse_id
from better_compute.core.keys import attempt_key
from better_compute.service import ApiRequest, Database
from better_compute.wire import engine as m
from better_compute.wire.agent import is_call_failure
from better_compute.wire.cmdq import LIVE_STATES, CommandView

from . import store

__all__ = ["WhyApi"]

_MAX_COMMANDS = 3  # live commands of one attempt named in the answer
SITE_HEARD_S = 15.0
"""An agent heard this recently means its site is reachable (cmdq.silent_after's default)."""
# The node's running workflow, else its latest.
NODE_WORKFLOW = (
    "SELECT * FROM workflows WHERE node_id = $1 ORDER BY (state = 'running') DESC, created_at DESC LIMIT 1"
)


def _at(epoch: float | None) -> str:
    if not epoch:
        return "-"
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _in(seconds: float) -> str:
    s = max(0, round(seconds))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        return f"{error.get('code')}: {error.get('message')}"
    return str(error)


def _reason(kind: str, text: str, /, **facts: Any) -> m.WhyReason:
    return m.WhyReason(kind=kind, text=text, facts={k: v for k, v in facts.items() if v is not None})


def _running_at(where: dict[str, Any]) -> str:
    """``cmd_… on journal J of agent A``: a previous attempt's command and the journal whose
    end (or loss) the next attempt waits for."""
    text = str(where.get("commandId"))
    if where.get("journalId"):
        text += f" on journal {where['journalId']}"
    if where.get("agentId"):
        text += f" of agent {where['agentId']}"
    return text


class WhyApi:
    """The ``workflows.why`` route."""

    def __init__(self, *, db: Database, cmdq: CommandQueueClient) -> None:
        self.db = db
        self.cmdq = cmdq

    async def workflows_why(self, req: ApiRequest) -> m.WhyAnswer:
        body = req.decode(m.Why)
        node, wf = await self._find(body.id)
        return await self.explain(node, wf)

    async def _find(self, id: str) -> tuple[Any, Any]:
        if id.startswith("wf_"):
            parse_id(id, "wf", path="id")
            wf = await self.db.fetchrow(store.WORKFLOW, id)
            if wf is None:
                raise BcError(ErrorCode.NOT_FOUND, f"no workflow {id}", {"path": "id"})
            node = await self.db.fetchrow(store.NODE, wf["node_id"]) if wf["node_id"] else None
            return node, wf
        if not id.startswith("node_"):
            raise BcError(
                ErrorCode.INVALID_INPUT, f"give a node id (node_…) or a workflow id (wf_…), got {id[:80]!r}",
                {"path": "id"},
            )  # fmt: skip
        parse_id(id, "node", path="id")
        node = await self.db.fetchrow(store.NODE, id)
        if node is None:
            raise BcError(ErrorCode.NOT_FOUND, f"no node {id}", {"path": "id"})
        return node, await self.db.fetchrow(NODE_WORKFLOW, id)

    async def explain(self, node: Any, wf: Any) -> m.WhyAnswer:
        answer = await self._explain(node, wf)
        if node is not None and node.get("name"):
            answer = msgspec.structs.replace(answer, node_name=node["name"])
        cut = await self._site_unreachable(node["site_id"]) if node is not None else None
        if cut is not None:
            text = cut.text + ("; " + answer.answer if answer.answer else "")
            answer = msgspec.structs.replace(answer, reasons=[cut, *answer.reasons], answer=text)
        quarantine = _json(node["quarantine"]) if node is not None else None
        if not isinstance(quarantine, dict):
            return answer
        first = _reason(
            "quarantined",
            f"node {node['id']} is quarantined: {quarantine.get('message')}"
            f" (token {quarantine.get('joinTokenId')}); inspect or retire it once you looked",
            **{k: quarantine.get(k) for k in ("reason", "joinTokenId", "mac")},
        )
        reasons = [first, *answer.reasons]
        text = first.text + ("; " + answer.answer if answer.answer else "")
        return msgspec.structs.replace(answer, reasons=reasons, answer=text)

    async def _site_unreachable(self, site_id: str | None) -> m.WhyReason | None:
        """The node's site when nothing of it is heard: it has site agents, none is connected,
        and no machine of it is busy or was heard within ``SITE_HEARD_S``. Since: the last time
        one of its site agents was heard (they heartbeat while they run), so a site cut off from
        the hub (its leaf's link down) reads as such; a site whose every agent stopped reads the
        same, and cannot be told apart from here."""
        if not site_id:
            return None
        try:
            # An idle machine heartbeats every cmdq.idle_heartbeat (30 s) and counts as connected
            # for three of those: a cut site's idle machines would hide the cut for 90 s. The site
            # is heard when a site agent or a busy machine (both heartbeat every 5 s) is connected,
            # or any agent of it was heard within SITE_HEARD_S.
            now = time.time()
            connected = await self.cmdq.agents(site_id=site_id, connected=True, limit=100)
            if any(
                a.role == "site" or a.live_commands or now - a.last_seen < SITE_HEARD_S for a in connected
            ):
                return None
            site_agents = await self.cmdq.agents(site_id=site_id, role="site", limit=100)
        except BcError:
            return None  # the command-queue's own silence is said where its answers are used
        if not site_agents:
            return None  # a site that never had a site agent is not unreachable, just empty
        last = max(site_agents, key=lambda a: a.last_seen)
        since = _at(last.last_seen)
        return _reason(
            "site-unreachable",
            f"site {site_id} unreachable since {since}: no agent of the site is connected"
            f" (the last heard: its site agent {last.id})",
            siteId=site_id, since=since, agentId=last.id,
        )  # fmt: skip

    async def _explain(self, node: Any, wf: Any) -> m.WhyAnswer:
        node_id = node["id"] if node is not None else None
        bmc = await self._bmc_error(node_id) if node_id else None
        if wf is None:
            reasons = [_reason("idle", f"node {node_id} runs no workflow (state {node['state']})")]
            return self._answer(node_id, None, reasons + ([bmc] if bmc else []), waiting=False)
        if wf["state"] != "running":
            text = f"workflow {wf['id']} {wf['state']}"
            error = _json(wf["error"])
            if error:
                text += f": {_error_text(error)}"
            reasons = [_reason("finished", text, state=wf["state"]), *await self._cancelling(wf["id"])]
            left = _json(node["state_reason"]) if node is not None and node["state"] == "failed" else None
            if isinstance(left, dict) and left.get("left") and left.get("workflowId") == wf["id"]:
                reasons.append(_reason("left", str(left["left"]), verb=left.get("verb")))
            return self._answer(node_id, wf, reasons + ([bmc] if bmc else []), waiting=False)
        if not wf.get("admitted", True):
            return self._answer(node_id, wf, [await self._queued(wf)] + ([bmc] if bmc else []), waiting=True)
        row = await self.db.fetchrow(store.NEXT_STEP, wf["id"])
        if row is None:
            reasons = [_reason("finished", f"workflow {wf['id']} has run every step and is finishing")]
            return self._answer(node_id, wf, reasons, waiting=False)
        step = store.step_row(row)
        reasons = await self._step_reasons(wf, step)
        deadline = self._deadline(step)
        tail = [r for r in (deadline, bmc) if r is not None]
        return self._answer(node_id, wf, reasons + tail, waiting=True, step=step)

    async def _queued(self, wf: Any) -> m.WhyReason:
        """A workflow waiting for its site's admission (core/admission.py): where it stands."""
        site = wf["site_id"]
        counts = await self.db.fetchrow(store.QUEUED_AHEAD, site, wf["created_at"], wf["id"])
        running, ahead = int(counts["running"]), int(counts["ahead"])
        return _reason(
            "queued",
            f"workflow {wf['id']} is queued at site {site}: {running} of the site's workflows run"
            f" (engine.site_admission) and {ahead} queued before it; no step has started, so no"
            " deadline runs",
            siteId=site, running=running, ahead=ahead,
        )  # fmt: skip

    async def _step_reasons(self, wf: Any, step: store.StepRow) -> list[m.WhyReason]:
        reasons: list[m.WhyReason] = []
        what = step.waiting_for if isinstance(step.waiting_for, dict) else None
        if what is not None:
            reasons.append(self._waiting_for(what))
        waited = what.get("commandId") if what is not None and what.get("reason") == "command" else None
        now = time.time()
        if step.state == "pending" and step.retry_at is not None and step.retry_at.timestamp() > now:
            last = (step.attempts or [{}])[-1]
            at = step.retry_at.timestamp()
            reasons.append(
                _reason(
                    "retry-backoff",
                    f"attempt {step.attempt} failed ({_error_text(last.get('error'))}); its retry"
                    f" policy starts attempt {step.attempt + 1} in {_in(at - now)} ({_at(at)})",
                    attempt=step.attempt,
                    retryAt=_at(at),
                )
            )
        if step.attempt > 0 and (step.sent_commands or step.command_id):
            found = await self._commands(wf, step)
            if any(r.facts.get("commandId") == waited or r.kind == "batch-approval" for r in found):
                # the command the step waits on, said in full by its own reason, or by its
                # batch's approvals (what the operator must do: make demo waits for those words)
                reasons = [r for r in reasons if r.kind != "command-wait"]
            reasons.extend(found)
        if not reasons:
            if step.state == "running" and step.mode == "control-plane":
                reasons.append(
                    _reason("running", f"it runs in the engine since {self._iso(step.started_at)}")
                )
            elif step.state == "running":
                reasons.append(_reason("running", "its command is being sent to the command-queue"))
            else:
                reasons.append(_reason("running", "it waits for the engine to start it"))
        return reasons

    @staticmethod
    def _iso(value: datetime | None) -> str:
        return _at(value.timestamp()) if value is not None else "-"

    @staticmethod
    def _waiting_for(what: dict[str, Any]) -> m.WhyReason:
        kind = str(what.get("reason"))
        if kind == "step-not-ready":
            return _reason(kind, f"the step says: {what.get('message')}", message=what.get("message"))
        if kind == "service-unavailable":
            service = what.get("service") or "a service"
            tries = what.get("tries")
            text = f"{service} does not answer ({what.get('code')}" + (f", {tries} tries)" if tries else ")")
            return _reason(kind, text, service=what.get("service"), code=what.get("code"))
        if kind == "previous-attempt-running":
            where = what.get("journals") or [{"commandId": c} for c in what.get("commands") or []]
            commands = ", ".join(_running_at(r) for r in where if isinstance(r, dict))
            return _reason(
                kind,
                f"attempt {what.get('attempt')}'s commands still run at their agent ({commands})",
                attempt=what.get("attempt"), commands=what.get("commands"), journals=what.get("journals"),
            )  # fmt: skip
        if kind == "command":
            # a control-plane step waiting on its command (await_command): the command's own
            # reason follows while it is live; this one stays when it ended (the step runs now)
            return _reason(
                "command-wait",
                f"the step waits for its command {what.get('kind')} {what.get('commandId')} to end",
                commandId=what.get("commandId"), kind=what.get("kind"),
            )  # fmt: skip
        if kind == "batch-approval":
            return _reason(kind, f"batch {what.get('batchId')} awaits approvals", batchId=what.get("batchId"))
        return _reason(kind, json.dumps(what, separators=(",", ":"))[:300])

    async def _commands(self, wf: Any, step: store.StepRow) -> list[m.WhyReason]:
        prefix = attempt_key(wf["id"], step.idx, step.attempt)
        try:
            listed = (await self.cmdq.list_commands(workflow_id=wf["id"], limit=100)).commands
        except BcError as err:
            return [_reason("service-unavailable", f"the command-queue does not answer ({err.code.value})")]
        live = [
            c for c in listed
            if c.state in LIVE_STATES and (c.key == prefix or c.key.startswith(prefix + ":"))
        ]  # fmt: skip
        out: list[m.WhyReason] = []
        for cmd in live[:_MAX_COMMANDS]:
            out.append(await self._command(cmd))
        return out

    async def _cancelling(self, workflow_id: str) -> list[m.WhyReason]:
        """The workflow's commands cancelled after their agent claimed them, not yet confirmed
        stopped there, each with the agent's last try."""
        try:
            listed = await self.cmdq.list_commands(
                workflow_id=workflow_id, state="cancelling", limit=_MAX_COMMANDS
            )
        except BcError as err:
            return [_reason("service-unavailable", f"the command-queue does not answer ({err.code.value})")]
        out: list[m.WhyReason] = []
        for cmd in listed.commands:
            since = _at(cmd.updated_at)
            text = (
                f"command {cmd.kind} {cmd.id} cancelling since {since}: agent {cmd.agent_id or '-'}"
                " has not yet confirmed that it stopped it"
            )
            text += f" (its last try: {cmd.progress})" if cmd.progress else " (no try reported)"
            facts = {"commandId": cmd.id, "kind": cmd.kind, "state": cmd.state, "since": since}
            out.append(_reason("cancelling", text, agentId=cmd.agent_id, lastTry=cmd.progress, **facts))
        return out

    async def _command(self, cmd: CommandView) -> m.WhyReason:
        facts: dict[str, Any] = {"commandId": cmd.id, "kind": cmd.kind, "state": cmd.state}
        if cmd.state != "pending" and is_call_failure(cmd.progress):
            # the agent's tries of the BMC fail: that first, where the command runs after it
            text = f"{cmd.progress} (command {cmd.kind} {cmd.id} {cmd.state} on agent {cmd.agent_id or '-'})"
            return _reason("bmc-failing", text, agentId=cmd.agent_id, progress=cmd.progress, **facts)
        if cmd.state != "pending":
            since = _at(cmd.updated_at)
            text = f"command {cmd.kind} {cmd.id} {cmd.state} since {since} on agent {cmd.agent_id or '-'}"
            if cmd.progress:
                text += f" ({cmd.progress})"
            away = await self._node_agent_away(cmd)
            if away is not None:
                # a bcd that took the command and went (its machine powered off or rebooting):
                # "dispatched on agent X" alone read as if X were working on it
                text += f"; that agent is not connected (last seen {_at(away.last_seen)}): its"
                text += " machine may be off or booting; the command waits for it until its deadline"
                seen = _at(away.last_seen)
                return _reason("agent-away", text, agentId=cmd.agent_id, since=since, lastSeen=seen, **facts)
            return _reason("command", text, agentId=cmd.agent_id, since=since, **facts)
        if cmd.batch_id is not None:
            batch = await self._batch(cmd.batch_id)
            if batch is not None:
                return batch
        if cmd.target == "site":
            try:
                listed = await self.cmdq.agents(site_id=cmd.site_id, limit=1000)
                agents = [a for a in listed if a.role == "site"]
            except BcError:
                agents = []
            connected = [a for a in agents if a.connected]
            if not connected:
                last = max(agents, key=lambda a: a.last_seen, default=None)
                seen = (
                    f"last seen {_at(last.last_seen)}: {last.id}" if last is not None
                    else "no agent of the site ever joined"
                )  # fmt: skip
                return _reason(
                    "no-agent",
                    f"no connected agent at site {cmd.site_id} ({seen}); command {cmd.kind} {cmd.id}"
                    f" pending since {_at(cmd.created_at)}",
                    siteId=cmd.site_id, lastSeen=_at(last.last_seen) if last else None,
                    agentId=last.id if last else None, **facts,
                )  # fmt: skip
            names = ", ".join(a.id for a in connected[:3])
            return _reason(
                "command",
                f"command {cmd.kind} {cmd.id} pending since {_at(cmd.created_at)}"
                f" (connected at site {cmd.site_id}: {names})",
                since=_at(cmd.created_at), siteId=cmd.site_id, **facts,
            )  # fmt: skip
        # a node's own agent (bcd) has the node's id
        try:
            own = [a for a in await self.cmdq.agents(site_id=cmd.site_id, limit=1000) if a.id == cmd.node_id]
        except BcError:
            own = []
        if not any(a.connected for a in own):
            seen = f"last seen {_at(own[0].last_seen)}" if own else "it never joined"
            return _reason(
                "no-agent",
                f"node {cmd.node_id}'s own agent is not connected ({seen}); command {cmd.kind}"
                f" {cmd.id} pending since {_at(cmd.created_at)}",
                siteId=cmd.site_id, lastSeen=_at(own[0].last_seen) if own else None, **facts,
            )  # fmt: skip
        return _reason(
            "command",
            f"command {cmd.kind} {cmd.id} pending since {_at(cmd.created_at)} for node {cmd.node_id}'s"
            " own agent (connected)",
            since=_at(cmd.created_at), **facts,
        )  # fmt: skip

    async def _node_agent_away(self, cmd: CommandView) -> Any:
        """The node's own agent a dispatched command waits on, when it is not connected."""
        if cmd.target == "site" or cmd.agent_id is None:
            return None
        if cmd.state not in ("dispatched", "acked", "running"):
            return None
        try:
            listed = await self.cmdq.agents(site_id=cmd.site_id, limit=1000)
        except BcError:
            return None
        return next((a for a in listed if a.id == cmd.agent_id and not a.connected), None)

    async def _batch(self, batch_id: str) -> m.WhyReason | None:
        try:
            batch = await self.cmdq.get_batch(id=batch_id)
        except BcError:
            return None
        if batch.state != "open":
            return None
        signed = [a.approver_id for a in batch.approvals if a.counted]
        text = f"batch {batch.id} awaiting approvals (have {len(signed)} of {batch.threshold}"
        text += f": {', '.join(signed)})" if signed else ")"
        try:
            quorum = await self.cmdq.quorum()
            missing = [a.id for a in quorum.approvers if a.id not in signed]
        except BcError:
            missing = []
        if missing:
            text += f"; not yet signed by {', '.join(missing)}"
        return _reason(
            "batch-approval", text, batchId=batch.id, approvals=len(signed), threshold=batch.threshold,
            approvers=signed,
        )  # fmt: skip

    @staticmethod
    def _deadline(step: store.StepRow) -> m.WhyReason | None:
        if step.state != "running" or step.deadline is None:
            return None
        at = step.deadline.timestamp()
        return _reason("deadline", f"deadline in {_in(at - time.time())} ({_at(at)})", deadline=_at(at))

    async def _bmc_error(self, node_id: str) -> m.WhyReason | None:
        """The node's last failed command: the driver error its agent reported."""
        try:
            failed = (await self.cmdq.list_commands(node_id=node_id, state="failed", limit=1)).commands
        except BcError:
            return None
        if not failed:
            return None
        cmd = failed[0]
        # a site command went to the BMC; a node command to the machine's own bcd, whose BMC may
        # be fine (node.imageWrite failed agent-lost: the machine lost power mid-write)
        whose = "the node's last BMC error" if cmd.target == "site" else "the last error of the node's bcd"
        return _reason(
            "bmc-error",
            f"{whose}: {cmd.kind} failed at {_at(cmd.updated_at)}: {cmd.reason or '-'}",
            commandId=cmd.id, kind=cmd.kind, at=_at(cmd.updated_at), reason=cmd.reason,
        )  # fmt: skip

    @staticmethod
    def _answer(
        node_id: str | None,
        wf: Any,
        reasons: list[m.WhyReason],
        *,
        waiting: bool,
        step: store.StepRow | None = None,
    ) -> m.WhyAnswer:
        texts = [r.text for r in reasons]
        if step is not None:
            head = f"step {step.idx} {step.action} (attempt {step.attempt}) waits: "
            answer = head + "; ".join(texts)
        else:
            answer = "; ".join(texts)
        return m.WhyAnswer(
            node_id=node_id,
            workflow_id=wf["id"] if wf is not None else None,
            workflow_state=wf["state"] if wf is not None else None,
            step=m.CurrentStep(index=step.idx, action=step.action) if step is not None else None,
            attempt=step.attempt if step is not None else None,
            waiting=waiting,
            answer=answer,
            reasons=reasons,
        )
