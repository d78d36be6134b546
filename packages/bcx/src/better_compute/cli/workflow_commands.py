"""``bcx workflows``: start, show, list, abort, retry, resume and watch workflows, through
``EngineClient``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from typing import Any

from ..clients import EngineClient
from ..config import Settings
from ..wire.engine import (
    EVENTS,
    BatchCreated,
    StepChanged,
    VerbApplied,
    WorkflowFinished,
    WorkflowView,
    decode_workflow_event,
)
from .common import add_tenant_flag, as_rows, engine_client, short, stop_if_interrupted
from .node_refs import node_names, node_ref
from .output import iso, json_line, print_json, print_table
from .paging import add_paging, collect_pages, show_page
from .why_commands import why_line

__all__ = ["register"]

FINISHED = ("succeeded", "failed", "aborted")


def _error_text(error: Any) -> str:
    details = error.get("details") if isinstance(error.get("details"), dict) else {}
    if details.get("reason") == "aborted":  # an operator's abort is no error code to decode
        return str(error.get("message"))
    return f"{error.get('code')}: {error.get('message')}"


_BY_OPERATOR = "aborted by an operator"


def _stopped_step(wf: WorkflowView) -> str | None:
    """``step N (action)``: the first step that did not succeed (the one the abort cancelled,
    or the one that failed)."""
    for s in wf.steps or []:
        if s.state != "succeeded":
            return f"step {s.index} ({s.action})"
    return None


def _aborted(wf: WorkflowView) -> tuple[str, str]:
    """Who aborted ``wf`` (``aborted by an operator``) and the rest of the sentence: where it
    stopped, why, and the way on (``resume``)."""
    error = wf.error if isinstance(wf.error, dict) else {}
    message = str(error.get("message") or _BY_OPERATOR)
    if message.startswith(_BY_OPERATOR):
        who, _, why = message.partition(": ")
    else:
        who, why = "aborted", message
    at = _stopped_step(wf)
    tail = (f" at {at}" if at else "") + (f": {why}" if why else "")
    return who, f"{tail}; to carry on from that step: bcx workflows resume {wf.id}"


def _print_steps(wf: WorkflowView) -> None:
    steps = wf.steps or []
    rows = [
        {
            **row,
            "started": iso(s.started_at),
            "outcome": _error_text(s.error) if s.error else short(s.result, 50),
        }
        for s, row in zip(steps, as_rows(steps), strict=True)
    ]
    print_table(
        rows,
        [("index", "#"), ("action", "ACTION"), ("state", "STATE"), ("attempt", "ATTEMPT"),
         ("started", "STARTED"), ("outcome", "RESULT / ERROR")],
    )  # fmt: skip


async def workflows_start(args: argparse.Namespace, settings: Settings) -> int:
    async with engine_client(settings) as engine:
        wf = await engine.start_workflow(
            tenant_id=args.tenant,
            profile_id=args.profile,
            profile_version=args.version,
            node_id=args.node,
            owner=args.owner,
        )
        if args.wait:
            # the id first: a reader (or `| head -1`) has it before the first step ends
            print(json_line(wf) if args.json else wf.id, flush=True)
            return await _watch(engine, wf.id, as_json=args.json)
    if args.json:
        print_json(wf)
    else:
        print(wf.id)
    return 0


async def workflows_get(args: argparse.Namespace, settings: Settings) -> int:
    async with engine_client(settings) as engine:
        wf = await engine.workflow(id=args.id)
        why = await why_line(engine, wf.id) if wf.state == "running" else None
    if args.json:
        print_json({**as_rows([wf])[0], "why": why} if why is not None else wf)
        return 0
    p = wf.profile
    where = f"profile {p.id}@{p.version} ({p.tenant_id})  node {wf.node_id or '-'}"
    print(f"{wf.id}  {wf.state}  {where}")
    if wf.state == "aborted":
        print("".join(_aborted(wf)))
    elif wf.error:
        print(f"error: {_error_text(wf.error)}")
        if wf.state == "failed":
            print(f"to run that step again: bcx workflows retry {wf.id}")
    if why is not None:
        print(f"why: {why.answer}")
    _print_steps(wf)
    _print_attempts(wf)
    return 0


def _print_attempts(wf: WorkflowView) -> None:
    """Each step's earlier failed attempts and its retry policy, under the steps' table."""
    for s in wf.steps or []:
        if not s.attempts and not s.retry:
            continue
        policy = s.retry or {}
        head = f"step {s.index} {s.action}"
        if policy:
            head += (
                f"  retry: {policy.get('attempts')} attempts, backoff {policy.get('backoff')}"
                f" to {policy.get('maxBackoff')}, on {','.join(policy.get('on') or [])}"
            )
        print(head)
        for a in s.attempts:
            line = f"  attempt {a.get('attempt')}  {iso(a.get('startedAt')) or '-'}  failed"
            line += f" {iso(a.get('finishedAt')) or '-'}  {_error_text(a.get('error') or {})}"
            if a.get("retryAt"):
                line += f"  retried {iso(a['retryAt'])}"
            print(line)
        if s.state == "pending" and s.retry_at:
            print(f"  attempt {s.attempt + 1} not before {iso(s.retry_at)}")


async def workflows_list(args: argparse.Namespace, settings: Settings) -> int:
    async with engine_client(settings) as engine:
        workflows, next_ = await collect_pages(
            engine.list_workflows, "workflows", args,
            node_id=args.node, state=args.state, profile_id=args.profile,
        )  # fmt: skip
        seen = list(dict.fromkeys(w.node_id for w in workflows if w.node_id))
        names = {} if args.json else await node_names(engine, seen)
    rows = [
        {**row, "profileRef": f"{w.profile.id}@{w.profile.version}", "created": iso(w.created_at),
         "nodeId": f"{w.node_id} ({names[w.node_id]})" if w.node_id in names else w.node_id}
        for w, row in zip(workflows, as_rows(workflows), strict=True)
    ]  # fmt: skip
    return show_page(
        args, next_, key="workflows", found=workflows, rows=rows,
        columns=[("id", "WORKFLOW"), ("state", "STATE"), ("profileRef", "PROFILE"),
                 ("nodeId", "NODE"), ("created", "CREATED")],
        empty="no workflows",
    )  # fmt: skip


async def _verb(args: argparse.Namespace, settings: Settings, verb: str) -> int:
    async with engine_client(settings) as engine:
        call = {
            "abort": engine.abort_workflow,
            "retry": engine.retry_workflow,
            "resume": engine.resume_workflow,
        }[verb]
        wf = await call(id=args.id, reason=getattr(args, "reason", None))
        if getattr(args, "wait", False):
            print(json_line(wf) if args.json else f"{wf.id} is {wf.state}", flush=True)
            return await _watch(engine, wf.id, as_json=args.json)
    if args.json:
        print_json(wf)
    elif verb == "abort" and wf.state == "aborted":
        print(f"{wf.id} aborted{_aborted(wf)[1]}")
    else:
        print(f"{wf.id} is {wf.state}")
    return 0


async def workflows_abort(args: argparse.Namespace, settings: Settings) -> int:
    return await _verb(args, settings, "abort")


async def workflows_retry(args: argparse.Namespace, settings: Settings) -> int:
    return await _verb(args, settings, "retry")


async def workflows_resume(args: argparse.Namespace, settings: Settings) -> int:
    return await _verb(args, settings, "resume")


async def workflows_watch(args: argparse.Namespace, settings: Settings) -> int:
    async with engine_client(settings) as engine:
        return await _watch(engine, args.id, as_json=args.json)


async def _watch(engine: EngineClient, workflow_id: str, *, as_json: bool) -> int:
    """Print each step change as it happens; exit 0 when the workflow succeeds, 1 otherwise."""
    changed = asyncio.Event()

    async def on_event(msg: Any) -> None:
        match decode_workflow_event(msg.data):
            case StepChanged() | WorkflowFinished() | VerbApplied() | BatchCreated():
                changed.set()  # the workflow moved: read it (its steps' results are not in events)
            case None:
                pass  # not an event; the poll below is the safety net

    api = engine.api
    sub = await api.nc.subscribe(api.subjects.event(EVENTS, workflow_id), cb=on_event)
    seen: dict[int, tuple[str, int]] = {}
    state = ""
    try:
        while True:
            stop_if_interrupted()
            changed.clear()
            wf = await engine.workflow(id=workflow_id)
            for s in wf.steps or []:
                now = (s.state, s.attempt)
                retrying = s.state == "pending" and s.retry_at is not None and s.error
                if seen.get(s.index) == now or (s.state == "pending" and not retrying):
                    continue
                seen[s.index] = now
                if as_json:
                    print(json_line({"workflowId": workflow_id, "workflowState": wf.state, "step": s}))
                else:
                    tail = ""
                    if s.error:
                        tail = f"  {_error_text(s.error)}"
                        if retrying:
                            tail += f"; retried at {iso(s.retry_at)}"
                    elif s.state == "succeeded":
                        tail = f"  {short(s.result, 50)}"
                    at = iso(s.finished_at or s.started_at) or "-"
                    print(
                        f"{at}  step {s.index:>3} {s.action:<28} {s.state:<10} attempt {s.attempt}{tail}",
                        flush=True,
                    )
            if wf.state != state:
                state = wf.state
                if as_json:
                    print(json_line({"workflowId": workflow_id, "workflowState": state}), flush=True)
                elif state == "aborted":
                    print(f"workflow {workflow_id} {''.join(_aborted(wf))}")
                elif state in FINISHED:
                    err = wf.error
                    print(f"workflow {workflow_id} {state}" + (f": {_error_text(err)}" if err else ""))
            sys.stdout.flush()
            if state in FINISHED:
                return 0 if state == "succeeded" else 1
            # events wake us at once; the timeout is the safety net for a lost event
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2.0):  # not wait_for: it can swallow a Ctrl-C (3.11)
                    await changed.wait()
    finally:
        await sub.unsubscribe()


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    tenant = argparse.ArgumentParser(add_help=False)
    add_tenant_flag(tenant)

    wfs = sub.add_parser("workflows", help="profiles running for nodes").add_subparsers(
        dest="workflows_command", required=True, metavar="COMMAND"
    )
    p = wfs.add_parser("start", parents=[common, tenant], help="start a workflow")
    p.add_argument("--profile", required=True, help="profile id")
    p.add_argument("--version", type=int, help="profile version (default: the newest)")
    p.add_argument("--node", type=node_ref, help="the node it runs for (id or name)")
    p.add_argument("--owner", help="reconciler that hears when it ends")
    p.add_argument("--wait", action="store_true", help="watch it until it ends")
    p.set_defaults(func=workflows_start)
    p = wfs.add_parser("get", parents=[common], help="one workflow and its steps")
    p.add_argument("id", help="workflow id (wf_…)")
    p.set_defaults(func=workflows_get)
    p = wfs.add_parser("list", parents=[common], help="list workflows, newest first")
    p.add_argument("--node", type=node_ref, help="only this node's (id or name)")
    p.add_argument("--state", choices=["running", "succeeded", "failed", "aborted"], help="only this state")
    p.add_argument("--profile", help="only of this profile")
    add_paging(p, default_limit=50)
    p.set_defaults(func=workflows_list)
    for name, fn, what in (
        ("abort", workflows_abort, "stop a running workflow, cancelling its live commands"),
        ("retry", workflows_retry, "run a failed workflow's failed step again"),
        ("resume", workflows_resume, "carry on an aborted workflow"),
    ):
        p = wfs.add_parser(name, parents=[common], help=what)
        p.add_argument("id", help="workflow id (wf_…)")
        if name == "abort":
            p.add_argument("--reason", help="recorded with the abort")
        else:
            p.add_argument("--wait", action="store_true", help="watch it until it ends")
        p.set_defaults(func=fn)
    p = wfs.add_parser("watch", parents=[common], help="show each step live until the workflow ends")
    p.add_argument("id", help="workflow id (wf_…)")
    p.set_defaults(func=workflows_watch)
