"""Plans shown before anything changes: ``bcx bulk <verb> … --plan`` and ``bcx <verb> NODE --plan``
(both the engine's ``metal.plan``) and, in ``bcx batches approve``, the scope a signature
approves.

A plan is read, never acted on: the engine starts no workflow, the command queue makes no batch
and no command, and neither writes an audit entry for it.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TextIO, cast

from ..core.errors import BcError, ErrorCode
from ..wire.cmdq import BatchView
from ..wire.metal import BulkPlan, VerbName
from .output import iso, named, print_json, print_table

if TYPE_CHECKING:
    from ..clients import EngineClient

__all__ = ["SCOPE_SHOWN", "bulk_plan", "print_batch_scope", "print_plan", "verb_plan"]

SCOPE_SHOWN = 20
"""Nodes and workflows a batch's scope lists by name (the rest are counted)."""


async def bulk_plan(
    engine: EngineClient,
    args: argparse.Namespace,
    *,
    node_ids: list[str] | None,
    selector: Mapping[str, str] | None,
) -> int:
    """``bcx bulk <verb> … --plan``: the engine's plan, shown; nothing is started."""
    if args.watch:
        raise BcError(
            ErrorCode.INVALID_INPUT, "--plan starts nothing to watch: drop --watch", {"path": "--plan"}
        )
    plan = await engine.plan_bulk(
        cast(VerbName, args.verb), node_ids=node_ids, selector=selector, tenant_id=args.tenant,
        image=args.image, profile=args.profile,
    )  # fmt: skip
    print_plan(plan, as_json=args.json, run_again=_run_again(args))
    return 0


async def verb_plan(engine: EngineClient, args: argparse.Namespace) -> int:
    """``bcx <verb> NODE --plan``: the bulk plan of that one node, shown; nothing is started.
    Exit 1 when the verb would refuse the node (it would fail now)."""
    if args.watch or args.wait:
        flag = "--watch" if args.watch else "--wait"
        raise BcError(
            ErrorCode.INVALID_INPUT, f"--plan starts nothing to watch: drop {flag}", {"path": "--plan"}
        )
    plan = await engine.plan_bulk(
        cast(VerbName, args.verb), node_ids=[args.node], selector=None, tenant_id=args.tenant,
        image=getattr(args, "image", None), profile=args.profile,
    )  # fmt: skip
    words = ["bcx", args.verb, args.node]
    for flag in ("tenant", "profile", "image"):
        if getattr(args, flag, None):
            words += [f"--{flag}", getattr(args, flag)]
    print_plan(plan, as_json=args.json, run_again=shlex.join(words))
    return 0 if plan.nodes else 1


def _run_again(args: argparse.Namespace) -> str:
    """The same ``bcx bulk`` without ``--plan``."""
    words = ["bcx", "bulk", args.verb]
    if args.selector is not None:
        words += ["--selector", args.selector]
    for node in args.node or []:
        words += ["--node", node]
    for flag in ("tenant", "profile", "image"):
        if getattr(args, flag, None):
            words += [f"--{flag}", getattr(args, flag)]
    return shlex.join(words)


def _kinds(kinds: list[str]) -> str:
    return ", ".join(kinds) if kinds else "-"


def print_plan(plan: BulkPlan, *, as_json: bool, run_again: str) -> None:
    """The plan as ``--json`` (the ``BulkPlan`` as the engine answered it) or as tables: per
    node its state, the state it would move to and its profile; the profile's steps with the
    commands each can send and which are destructive; the approvals; the refused nodes."""
    if as_json:
        print_json(plan)
        return
    n = len(plan.nodes)
    if plan.profile is None:
        print(f"plan: {plan.verb} would start on no node; nothing was started")
    else:
        image = f", image {plan.image}" if plan.image else ""
        profile = f"{plan.profile.id}@{plan.profile.version}"
        print(f"plan: {plan.verb} of {n} node{'s' if n != 1 else ''} ({profile}{image}); nothing was started")
        sends = len(plan.commands)
        print_table(
            [
                {
                    "node": p.node_id, "name": named(p.name), "state": p.state, "becomes": p.becomes,
                    "profile": f"{p.profile.id}@{p.profile.version}",
                    "steps": len(plan.steps), "commands": sends, "destructive": _kinds(plan.destructive),
                }
                for p in plan.nodes
            ],
            [("node", "NODE"), ("name", "NAME"), ("state", "STATE"), ("becomes", "BECOMES"),
             ("profile", "PROFILE"), ("steps", "STEPS"), ("commands", "KINDS"),
             ("destructive", "DESTRUCTIVE")],
        )  # fmt: skip
        print()
        print(f"steps each node runs ({profile}):")
        print_table(
            [
                {"index": s.index, "action": s.action, "on": s.runs_on, "commands": _kinds(s.commands),
                 "destructive": _kinds(s.destructive)}
                for s in plan.steps
            ],
            [("index", "#"), ("action", "ACTION"), ("on", "ON"), ("commands", "COMMANDS"),
             ("destructive", "DESTRUCTIVE")],
        )  # fmt: skip
        print()
        _print_approvals(plan, n)
    if plan.refused:
        print()
        print(f"would refuse {len(plan.refused)}:")
        print_table(
            [
                {
                    "node": r.node_id,
                    "name": named(r.name),
                    "code": r.code,
                    "why": r.message,
                }
                for r in plan.refused
            ],
            [("node", "NODE"), ("name", "NAME"), ("code", "CODE"), ("why", "WHY")],
        )
    if plan.nodes:
        print()
        print(f"to run it: {run_again}")


def _print_approvals(plan: BulkPlan, n: int) -> None:
    if not plan.destructive:
        print("approvals: none (nothing destructive is sent)")
    elif plan.approvals is None:
        print(f"approvals: none (the quorum is off): {_kinds(plan.destructive)} run without a batch")
    else:
        a = plan.approvals
        print(
            f"approvals: one batch for the {n} node{'s' if n != 1 else ''} covering "
            f"{_kinds(plan.destructive)}; it needs {a.threshold} of {len(a.approvers)} "
            f"({', '.join(a.approvers)}) before any of them is sent"
        )


def print_batch_scope(batch: BatchView, *, workflows: dict[str, str], out: TextIO | None = None) -> None:
    """What a signature approves: the fields of the batch's signed document (tenant, kinds,
    nodes, workflows, expiry) and, for each workflow, the profile and node the engine names
    (``workflows``: id to ``profile@version on node``; empty when the engine was not asked)."""
    stream = out or sys.stdout
    lines: list[str] = [
        f"you sign batch {batch.id} ({batch.state}, {len(batch.approvals)}/{batch.threshold}):"
    ]
    lines.append(f"  tenant     {batch.tenant_id}")
    lines.append(f"  kinds      {_kinds(batch.kinds)}")
    lines.append(f"  nodes      {len(batch.nodes)}: {_list(batch.nodes)}")
    wf_ids = [batch.workflow_id] if batch.workflow_id else list(batch.workflow_ids)
    if wf_ids:
        lines.append(f"  workflows  {len(wf_ids)}")
        lines += [f"    {w}  {workflows.get(w, '')}".rstrip() for w in wf_ids[:SCOPE_SHOWN]]
        if len(wf_ids) > SCOPE_SHOWN:
            lines.append(f"    … and {len(wf_ids) - SCOPE_SHOWN} more (bcx batches get {batch.id} --json)")
    lines.append(f"  expires    {iso(batch.expires_at_ms / 1000)}")
    if batch.note:
        lines.append(f"  note       {batch.note}")
    stream.write("\n".join(lines) + "\n")


def _list(items: list[Any]) -> str:
    shown = ", ".join(str(i) for i in items[:SCOPE_SHOWN])
    return shown + (f", … ({len(items) - SCOPE_SHOWN} more)" if len(items) > SCOPE_SHOWN else "")
