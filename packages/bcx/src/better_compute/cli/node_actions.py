"""``bcx nodes power on|off|cycle <node>`` and ``bcx nodes boot-device set <node> pxe|disk``.

Each is one audited request (``metal.power`` / ``metal.bootDevice``) that starts the node
action's shipped one-step profile as a workflow on the node, the way a lifecycle verb starts
its profile, but leaving the node's lifecycle state as it was. A node in maintenance, without a
BMC or running a workflow is refused with what to do. ``--wait`` follows the workflow to its end
quietly, ``--watch`` with a line per change that says what it waits for, as ``bcx why`` does;
both end with a summary, and exit 1 when it failed or ``--timeout`` passed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from typing import Any

from ..clients import EngineClient
from ..config import Settings
from ..core.errors import BcError, ErrorCode
from ..wire.engine import EVENTS, WorkflowView, decode_workflow_event
from ..wire.metal import NodeActionRun
from .common import engine_client, short, stop_if_interrupted
from .node_refs import NODE_HELP, node_ref
from .output import json_line, print_json, print_table
from .why_commands import why_reason

__all__ = ["follow_workflow", "register"]

_ENDS = ("succeeded", "failed", "aborted")


def _elapsed(seconds: float) -> str:
    return f"{seconds:.1f}s" if seconds < 120 else f"{int(seconds) // 60}m{int(seconds) % 60:02d}s"


def _step_text(wf: WorkflowView) -> str:
    steps = wf.steps if isinstance(wf.steps, list) else []
    running = [s for s in steps if s.state not in ("succeeded", "pending", "skipped")]
    step = running[0] if running else None
    return f"{step.index} {step.action}" if step is not None else ""


def _failed_step(wf: WorkflowView) -> str | None:
    steps = wf.steps if isinstance(wf.steps, list) else []
    for s in steps:
        if s.state in ("failed", "cancelled") or s.error:
            said = s.error if isinstance(s.error, dict) else {}
            return f"{s.index} {s.action}: {said.get('code')}: {said.get('message')}"
    err = wf.error if isinstance(wf.error, dict) else None
    return f"{err.get('code')}: {err.get('message')}" if err else None


async def follow_workflow(
    engine: EngineClient,
    workflow_id: str,
    *,
    label: str,
    live: bool,
    as_json: bool,
    timeout: float | None,
    started: float,
) -> int:
    """Follow one workflow on a node to its end: with ``live`` a line per change (elapsed, the
    node, the workflow's state, its step and what ``why`` says it waits for), then a summary.
    0 when it succeeded, 1 when it failed or was aborted; past ``timeout`` the summary shows
    where it stands, then ``TIMEOUT`` is raised."""
    woken = asyncio.Event()

    async def on_event(msg: Any) -> None:
        if decode_workflow_event(msg.data) is not None:
            woken.set()

    api = engine.api
    sub = await api.nc.subscribe(api.subjects.event(EVENTS, workflow_id), cb=on_event)
    deadline = None if timeout is None else time.monotonic() + timeout
    last = None
    try:
        while True:
            stop_if_interrupted()
            woken.clear()
            wf = await engine.workflow(id=workflow_id)
            reason = None
            if wf.state not in _ENDS:
                with contextlib.suppress(BcError):
                    reason = why_reason(await engine.why(id=workflow_id))
            step = _step_text(wf)
            shown = (wf.state, step, reason)
            if live and shown != last:
                seconds = round(time.time() - started, 1)
                if as_json:
                    doc = {"node": label, "workflowId": workflow_id, "state": wf.state, "step": step or None,
                           "waits": reason, "seconds": seconds}  # fmt: skip
                    print(json_line(doc), flush=True)
                else:
                    waits = f" (waits: {short(reason, 110)})" if reason else ""
                    print(f"{_elapsed(seconds):>7}  {label}  {wf.state:<10} {step or '-'}{waits}", flush=True)
            last = shown
            if wf.state in _ENDS:
                break
            if deadline is not None and time.monotonic() > deadline:
                break
            with contextlib.suppress(TimeoutError):
                wait = 2.0 if deadline is None else max(0.05, min(2.0, deadline - time.monotonic()))
                async with asyncio.timeout(wait):  # not wait_for: it can swallow a Ctrl-C (3.11)
                    await woken.wait()
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    seconds = round(time.time() - started, 1)
    failed = _failed_step(wf) if wf.state in ("failed", "aborted") else None
    summary = {"node": label, "workflowId": workflow_id, "state": wf.state, "seconds": seconds,
               "failed": failed, "waits": last[2] if last else None}  # fmt: skip
    if as_json:
        print(json_line({"summary": summary}), flush=True)
    else:
        print_table(
            [{**summary, "duration": _elapsed(seconds), "failed": short(failed, 90) if failed else "-"}],
            [("node", "NODE"), ("workflowId", "WORKFLOW"), ("state", "FINAL STATE"), ("duration", "DURATION"),
             ("failed", "FAILED STEP")],
        )  # fmt: skip
        sys.stdout.flush()
    if wf.state not in _ENDS:
        waits = f"; it waits: {last[2]}" if last and last[2] else ""
        raise BcError(
            ErrorCode.TIMEOUT,
            f"workflow {workflow_id} did not end in {timeout:.0f}s (still {wf.state}{waits})",
            {"path": "timeout", "workflowId": workflow_id},
        )
    return 0 if wf.state == "succeeded" else 1


async def _run(args: argparse.Namespace, settings: Settings) -> int:
    async with engine_client(settings) as engine:
        t0 = time.time()
        if args.nodes_command == "power":
            got: NodeActionRun = await engine.power(
                node_id=args.id, action=args.action, tenant_id=args.tenant
            )
        else:
            got = await engine.set_boot_device(node_id=args.id, device=args.device, tenant_id=args.tenant)
        label = got.name or got.node_id
        if not (args.watch or args.wait):
            if args.json:
                print_json(got)
            else:
                profile = f"{got.profile.id}@{got.profile.version}"
                print(f"{label} {got.action}: workflow {got.workflow_id} ({profile})")
            return 0
        if args.json:
            print(json_line(got), flush=True)
        else:
            print(f"{label} {got.action}: workflow {got.workflow_id}", flush=True)
        return await follow_workflow(
            engine, got.workflow_id, label=label, live=args.watch, as_json=args.json, timeout=args.timeout,
            started=t0,
        )  # fmt: skip


def _until_flags(p: argparse.ArgumentParser) -> None:
    until = p.add_mutually_exclusive_group()
    until.add_argument("--watch", action="store_true", help="a line per change until it ends, then a summary")
    until.add_argument("--wait", action="store_true", help="wait until it ends, then a summary")
    p.add_argument(
        "--timeout", type=float, help="with --watch or --wait: give up after this many seconds (exit 1)"
    )


def register(nodes: Any, common: argparse.ArgumentParser) -> None:
    """``bcx nodes power`` and ``bcx nodes boot-device``."""
    p = nodes.add_parser(
        "power", parents=[common], help="switch a node on or off, or power-cycle it, through its BMC"
    )
    p.add_argument("action", choices=["on", "off", "cycle"], help="on, off or cycle")
    p.add_argument("id", type=node_ref, metavar="NODE", help=NODE_HELP)
    p.add_argument("--tenant", help="the node's tenant (refuses others)")
    _until_flags(p)
    p.set_defaults(func=_run)
    boot = nodes.add_parser("boot-device", help="the device a node boots from next, through its BMC")
    bsub = boot.add_subparsers(dest="boot_command", required=True, metavar="COMMAND")
    p = bsub.add_parser(
        "set", parents=[common], help="pxe: from the network once; disk: from its disk from now on"
    )
    p.add_argument("id", type=node_ref, metavar="NODE", help=NODE_HELP)
    p.add_argument("device", choices=["pxe", "disk"], help="pxe or disk")
    p.add_argument("--tenant", help="the node's tenant (refuses others)")
    _until_flags(p)
    p.set_defaults(func=_run)
