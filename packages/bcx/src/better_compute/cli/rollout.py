"""Live rollout progress: ``bcx nodes watch`` and ``--watch`` on ``bcx bulk``.

One line per machine (node, lifecycle state, the step its workflow runs or what it waits for,
elapsed), a bar per state with its count, until every node is in a final state; then a summary
table (node, final state, duration, failed step). On a terminal it is a ``rich`` live view; into
a pipe or a file it prints one plain line per change (``--json``: one JSON object per change, then
the summary as one object).

It is driven by the engine's events: ``bc.events.node.<id>`` (a node moved: the event carries the
state it moved to, shown at once, then the node is read) and ``bc.events.workflow.<id>`` (a step
started, settled or waits: the event carries the step). A node that passes through ``inspecting``
faster than a read is shown passing through it, in the order the events came. The events are
wake-ups, not the truth, so every node is also read again every few seconds, which covers an event
lost or sent while the view was connecting.

Final states: for a verb, its resting state (``deploy`` → ``deployed``) and ``failed``; without
one, any state no workflow is moving (not ``…ing``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TextIO

from ..clients import EngineClient
from ..config import Settings
from ..core.errors import BcError, ErrorCode
from ..metal.lifecycle import NODE_STATES, SELECTOR_SITE, TRANSITIONS, parse_selector
from ..wire.engine import (
    EVENTS,
    NODE_EVENTS,
    NodeChanged,
    NodeRemoved,
    NodeView,
    StepChanged,
    WorkflowFinished,
    decode_node_event,
    decode_workflow_event,
)
from .common import engine_client, short, stop_if_interrupted
from .node_refs import node_ref
from .output import json_line, print_table
from .why_commands import why_line, why_reason

__all__ = ["RUNNING_STATES", "Progress", "final_states", "register", "select_nodes", "watch_nodes"]

RUNNING_STATES = frozenset(t.running for t in TRANSITIONS.values())
REREAD_SECONDS = 3.0
EXPLAINED = 10
"""A watch of this many nodes or fewer asks ``bcx why`` of each moving node on each read."""


def final_states(verb: str | None) -> frozenset[str]:
    """Where a node's part of the rollout ends: the verb's resting state or failed; without a
    verb, any state that is not a workflow's ``…ing``."""
    if verb is None:
        return frozenset(NODE_STATES) - RUNNING_STATES
    t = TRANSITIONS.get(verb)
    if t is None:
        raise BcError(ErrorCode.INVALID_INPUT, f"unknown verb {verb}", {"path": "verb"})
    return frozenset({t.done, "failed"})


async def select_nodes(
    engine: EngineClient, selector: dict[str, str] | None, node_ids: list[str] | None, tenant: str | None
) -> list[NodeView]:
    """The nodes a watch follows: by id, or every node the selector (``site`` and labels) matches."""
    if node_ids:
        return [await engine.get_node(id=i) for i in node_ids]
    selector = selector or {}
    site = selector.get(SELECTOR_SITE)
    labels = {k: v for k, v in selector.items() if k != SELECTOR_SITE}
    found: list[NodeView] = []
    cursor: str | None = None
    while True:
        page = await engine.list_nodes(site_id=site, tenant_id=tenant, cursor=cursor, limit=500)
        found += [n for n in page.nodes if all(n.labels.get(k) == v for k, v in labels.items())]
        cursor = page.next
        if not cursor:
            return found


def _epoch(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@dataclass
class Row:
    node: str
    state: str
    step: str = ""
    workflow: str | None = None
    since: float | None = None
    """When its workflow was created (epoch seconds), else when the watch first saw it move."""
    ended: float | None = None
    failed_step: str | None = None
    failure: str | None = None
    seen_running: bool = False
    name: str | None = None
    """The node's name, when it has one: shown instead of its id."""

    @property
    def label(self) -> str:
        return self.name or self.node

    def elapsed(self, now: float) -> float | None:
        if self.since is None:
            return None
        return max(0.0, (self.ended or now) - self.since)


def _step_text(node: NodeView, why: str | None = None) -> str:
    """The step the node's workflow runs, and what it waits for: ``why`` (``bcx why``'s reason,
    for a watch of a few nodes), else what the node's read says (approvals, a failing BMC)."""
    wf = node.current_workflow
    if not wf:
        return ""
    waits = wf.waiting_for if isinstance(wf.waiting_for, dict) else {}
    step = f"{wf.step.index} {wf.step.action}" if wf.step else ""
    if why:
        return f"{step} (waits: {short(why, 110)})".strip()
    reason = waits.get("reason")
    if reason == "batch-approval":
        return f"{step} (waits for approvals: {waits.get('approvals')} of {waits.get('threshold')})".strip()
    if reason:  # what the step waits for, as bcx why words it first
        said = waits.get("message") or str(reason).replace("-", " ")
        if reason == "command" and waits.get("kind"):
            said = f"its {waits['kind']} command"
        if reason == "service-unavailable" and waits.get("service"):
            said = f"{waits['service']} unavailable ({waits.get('tries', 1)} tries)"
        width = 110 if reason == "bmc-failing" else 70  # the BMC's address and tries stay whole
        return f"{step} (waits: {short(str(said), width)})".strip()
    return step


def _workflow_of(node: NodeView) -> str | None:
    """The workflow moving the node, or the one that failed it."""
    reason = node.state_reason if isinstance(node.state_reason, dict) else {}
    found = node.workflow_id or reason.get("workflowId")
    return str(found) if found else None


class Progress:
    """What the watch knows of each node, and how it shows it."""

    def __init__(self, nodes: list[NodeView], finals: frozenset[str], *, started: float) -> None:
        self.finals = finals
        self.started = started
        self.rows: dict[str, Row] = {}
        self.workflow_times: dict[str, tuple[float | None, float | None]] = {}
        for n in nodes:
            self.rows[n.id] = Row(node=n.id, state=n.state, name=n.name)

    @property
    def done(self) -> bool:
        return all(r.state in self.finals for r in self.rows.values())

    def counts(self) -> dict[str, int]:
        counts = Counter(r.state for r in self.rows.values())
        return {s: counts[s] for s in (*NODE_STATES, *sorted(set(counts) - set(NODE_STATES))) if counts[s]}

    def apply_node(
        self, node: NodeView, times: tuple[float | None, float | None], now: float, why: str | None = None
    ) -> bool:
        """Take a fresh read of ``node`` (``times``: its workflow's creation and end, epoch
        seconds; ``why``: what ``bcx why`` says it waits for); True when what a user sees of it
        changed."""
        row = self.rows[node.id]
        before = (row.state, row.step)
        created, finished = times
        row.state = node.state
        row.name = node.name
        reason = node.state_reason if isinstance(node.state_reason, dict) else {}
        workflow = _workflow_of(node)
        if workflow and workflow != row.workflow:
            row.workflow = workflow
            row.since = created if created is not None else now
            row.ended = None
        if row.since is None and node.state in RUNNING_STATES:
            row.since = now
        if node.state == "failed" and reason:
            row.failed_step = str(reason.get("step") or "-")
            row.failure = f"{reason.get('code')}: {reason.get('message')}"
        else:
            row.failed_step = row.failure = None
        if node.state in self.finals:
            # seen ending now, or ended before the watch began: its workflow says when
            row.ended = row.ended or (now if row.seen_running else finished or now)
            row.step = ""
        else:
            row.seen_running = True
            row.ended = None
            row.step = _step_text(node, why) or row.step
        return (row.state, row.step) != before

    def apply_passing(self, event: NodeChanged, now: float) -> bool:
        """Show a state the event says the node moved to, before the read that follows it: the
        read may already find the node past it. A late event never moves a node back from where
        a read put it for the same workflow. True when what a user sees of it changed."""
        row = self.rows.get(event.node_id)
        if row is None or event.state not in RUNNING_STATES or event.state == row.state:
            return False
        if row.state in self.finals and (event.workflow_id is None or event.workflow_id == row.workflow):
            return False
        if event.workflow_id and event.workflow_id != row.workflow:
            row.workflow = event.workflow_id
            row.since, row.ended = now, None
        row.since = row.since or now
        row.state, row.seen_running = event.state, True
        return True

    def apply_step(self, event: StepChanged) -> bool:
        row = self.rows.get(event.node_id or "")
        if row is None or row.state in self.finals or (row.workflow and row.workflow != event.workflow_id):
            return False
        s = event.step
        text = f"{s.index} {s.action}"
        if s.state not in ("running", "succeeded"):
            text += f" ({s.state})"
        if text == row.step or (s.state == "running" and row.step.startswith(f"{text} (waits")):
            return False  # the same step: what a read said it waits for stays shown
        row.step = text
        return True

    def summary(self, now: float) -> list[dict[str, Any]]:
        out = []
        for r in self.rows.values():
            elapsed = r.elapsed(now)
            out.append({
                "node": r.node, "name": r.name, "state": r.state, "workflowId": r.workflow,
                "seconds": round(elapsed, 1) if elapsed is not None else None,
                "failedStep": r.failed_step, "error": r.failure,
            })  # fmt: skip
        return out


def _fmt_elapsed(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    return f"{int(seconds) // 60}m{int(seconds) % 60:02d}s"


class _Plain:
    """One line per change (a pipe, a log file)."""

    def __init__(self, out: TextIO, *, as_json: bool) -> None:
        self.out = out
        self.as_json = as_json
        self._counts: dict[str, int] = {}

    def __enter__(self) -> _Plain:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def show(self, progress: Progress, changed: Iterable[str], now: float) -> None:
        for node in changed:
            r = progress.rows[node]
            elapsed = r.elapsed(now)
            if self.as_json:
                self.out.write(json_line({
                    "node": r.node, "name": r.name, "state": r.state, "step": r.step or None,
                    "seconds": round(elapsed, 1) if elapsed is not None else None,
                }) + "\n")  # fmt: skip
            else:
                self.out.write(
                    f"{_fmt_elapsed(now - progress.started):>7}  {r.label}  {r.state:<13} {r.step or '-'}\n"
                )
        counts = progress.counts()
        if counts != self._counts and not self.as_json:
            self.out.write("        " + ", ".join(f"{s} {n}" for s, n in counts.items()) + "\n")
        self._counts = counts
        self.out.flush()


class _Quiet:
    """No line per change (``--wait``): only the summary at the end."""

    def __enter__(self) -> _Quiet:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def show(self, progress: Progress, changed: Iterable[str], now: float) -> None:
        pass


class _Live:
    """A ``rich`` live view on a terminal: the machines, then a bar per state."""

    def __init__(self, out: TextIO, title: str) -> None:
        from rich.console import Console
        from rich.live import Live

        self.console = Console(file=out)
        self.title = title
        self.live = Live(console=self.console, refresh_per_second=4, transient=True)
        self._progress: Progress | None = None

    def __enter__(self) -> _Live:
        self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.__exit__(None, None, None)

    def show(self, progress: Progress, changed: Iterable[str], now: float) -> None:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        table = Table(title=f"{self.title} · {_fmt_elapsed(now - progress.started)}", title_justify="left")
        for col in ("NODE", "STATE", "STEP", "ELAPSED"):
            table.add_column(col)
        style = {"failed": "red", "deployed": "green", "ready": "green", "inspected": "green"}
        rows = list(progress.rows.values())
        room = max(5, self.console.height - 8 - len(progress.counts()))
        if len(rows) > room:  # a big fleet: the machines still moving, the bars count the rest
            moving = [r for r in rows if r.state not in progress.finals]
            table.caption = f"{len(rows) - min(len(moving), room)} more not shown"
            rows = moving[:room]
        for r in rows:
            table.add_row(
                r.label,
                Text(r.state, style=style.get(r.state, "yellow" if r.state in RUNNING_STATES else "")),
                r.step or "-", _fmt_elapsed(r.elapsed(now)),
            )  # fmt: skip
        total = max(1, len(progress.rows))
        bars = []
        for state, n in progress.counts().items():
            width = 30
            filled = round(width * n / total)
            bar = Text(f"{state:<14}", style=style.get(state, ""))
            bar.append("█" * filled + "░" * (width - filled))
            bar.append(f" {n}/{total}")
            bars.append(bar)
        self.live.update(Group(table, *bars), refresh=True)


async def watch_nodes(
    engine: EngineClient,
    nodes: list[NodeView],
    *,
    verb: str | None,
    as_json: bool,
    out: TextIO | None = None,
    started: float | None = None,
    timeout: float | None = None,
    title: str = "rollout",
    live: bool = True,
    explain: bool | None = None,
) -> int:
    """Follow ``nodes`` until each is in a final state (``live=False``: without a line per
    change); print the summary. 0 when none failed. Past ``timeout`` the summary shows where each
    stands, then ``TIMEOUT`` is raised. ``explain`` (default: for at most ``EXPLAINED`` nodes)
    asks ``workflows.why`` on each read of a moving node, so its line says what ``bcx why``
    says it waits for."""
    explain = len(nodes) <= EXPLAINED if explain is None else explain
    out = out or sys.stdout
    finals = final_states(verb)
    progress = Progress(nodes, finals, started=started or time.time())
    wanted = set(progress.rows)
    dirty: set[str] = set(wanted)  # everyone is read once at the start
    step_events: list[StepChanged] = []
    node_events: list[NodeChanged] = []
    woken = asyncio.Event()

    async def on_node(msg: Any) -> None:
        match decode_node_event(msg.data):
            case NodeChanged(node_id=node_id) as event if node_id in wanted:
                node_events.append(event)
                dirty.add(node_id)
                woken.set()
            case NodeRemoved(node_id=node_id) if node_id in wanted:
                dirty.add(node_id)
                woken.set()
            case _:
                pass

    async def on_workflow(msg: Any) -> None:
        match decode_workflow_event(msg.data):
            case StepChanged(node_id=node_id) as event if node_id in wanted:
                step_events.append(event)
                if explain:  # what it waits for now: bcx why's answer, on the read
                    dirty.add(node_id)
                woken.set()
            case WorkflowFinished(node_id=node_id) if node_id in wanted:
                dirty.add(node_id)
                woken.set()
            case _:
                pass

    api = engine.api
    subs = [
        await api.nc.subscribe(api.subjects.events_all(NODE_EVENTS), cb=on_node),
        await api.nc.subscribe(api.subjects.events_all(EVENTS), cb=on_workflow),
    ]
    interactive = out.isatty() and not as_json and live
    view: _Live | _Plain | _Quiet = (
        _Live(out, title) if interactive else _Plain(out, as_json=as_json) if live else _Quiet()
    )
    deadline = None if timeout is None else time.monotonic() + timeout
    timed_out = False
    last_read = time.monotonic()
    first = True
    try:
        with view:
            while True:
                stop_if_interrupted()
                now = time.time()
                changed: list[str] = []
                if not first:
                    # states the events say each node passed through, each shown before the reads
                    for node_event in node_events:
                        if progress.apply_passing(node_event, now):
                            view.show(progress, [node_event.node_id], now)
                node_events.clear()
                for event in step_events:
                    if progress.apply_step(event):
                        changed.append(str(event.node_id))
                step_events.clear()
                if time.monotonic() - last_read >= REREAD_SECONDS:
                    dirty |= {n for n, r in progress.rows.items() if r.state not in finals}
                    last_read = time.monotonic()
                reads, dirty = dirty, set()
                for node_id in sorted(reads):
                    with contextlib.suppress(BcError):
                        node = await engine.get_node(id=node_id)
                        times = await _times(engine, progress, node)
                        why = None
                        if explain and node.state not in finals and node.current_workflow:
                            why = why_reason(await why_line(engine, node_id))
                        if progress.apply_node(node, times, time.time(), why):
                            changed.append(node_id)
                if first:
                    changed, first = list(progress.rows), False  # where each one stands
                view.show(progress, dict.fromkeys(changed), time.time())
                if progress.done:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    timed_out = True
                    break
                woken.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0 if interactive else REREAD_SECONDS):  # not wait_for
                        await woken.wait()
    finally:
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
    now = time.time()
    rows = progress.summary(now)
    failed = sum(1 for r in rows if r["state"] == "failed")
    if as_json:
        out.write(
            json_line(
                {"summary": rows, "counts": progress.counts(), "seconds": round(now - progress.started, 1)}
            )
            + "\n"
        )
    else:
        table = [
            {**r, "duration": _fmt_elapsed(r["seconds"]), "node": r["name"] or r["node"],
             "failed": short(f"{r['failedStep']}: {r['error']}", 90) if r["failedStep"] else "-"}
            for r in rows
        ]  # fmt: skip
        print_table(
            table,
            [("node", "NODE"), ("state", "FINAL STATE"), ("duration", "DURATION"), ("failed", "FAILED STEP")],
            out=out,
        )  # fmt: skip
        counts = ", ".join(f"{n} {s}" for s, n in progress.counts().items())
        out.write(f"{len(rows)} nodes in {_fmt_elapsed(now - progress.started)}: {counts}\n")
    out.flush()
    if timed_out:
        moving = sum(1 for r in rows if r["state"] not in finals)
        raise BcError(
            ErrorCode.TIMEOUT,
            f"the rollout did not end in {timeout:.0f}s: {moving} of {len(rows)} still moving",
            {"path": "timeout"},
        )
    return 1 if failed else 0


async def _times(
    engine: EngineClient, progress: Progress, node: NodeView
) -> tuple[float | None, float | None]:
    """When the node's current workflow was created and ended (read once per workflow, and
    once more when the node rests while its end is not known yet)."""
    wf = _workflow_of(node)
    if not wf:
        return None, None
    known = progress.workflow_times.get(wf)
    if known is None or (known[1] is None and node.state in progress.finals):
        try:
            view = await engine.get_workflow(id=wf)
            known = (_epoch(view.created_at), _epoch(view.finished_at))
        except BcError:
            known = (None, None)
        progress.workflow_times[wf] = known
    return known


async def nodes_watch(args: argparse.Namespace, settings: Settings) -> int:
    if args.selector is not None and args.node:
        raise BcError(ErrorCode.INVALID_INPUT, "give --selector or --node (not both)", {"path": "selector"})
    selector = parse_selector(args.selector) if args.selector is not None else None
    async with engine_client(settings) as engine:
        nodes = await select_nodes(engine, selector, args.node, args.tenant)
        if not nodes:
            raise BcError(
                ErrorCode.NOT_FOUND, "no node matches", {"path": "selector" if selector else "node"}
            )
        return await watch_nodes(
            engine, nodes, verb=args.verb, as_json=args.json, timeout=args.timeout,
            title=f"{len(nodes)} nodes" + (f" · {args.verb}" if args.verb else ""),
        )  # fmt: skip


def register(nodes: Any, common: argparse.ArgumentParser) -> None:
    """``bcx nodes watch``."""
    p = nodes.add_parser("watch", parents=[common], help="live progress of nodes until each rests")
    p.add_argument("--selector", help="site=lab1,rack=r12 (default: every node)")
    p.add_argument(
        "--node", action="append", type=node_ref, help="node id or name, repeatable (instead of --selector)"
    )
    p.add_argument("--tenant", help="only this tenant's nodes")
    p.add_argument(
        "--verb", choices=list(TRANSITIONS), help="end when each is in this verb's state or failed"
    )
    p.add_argument("--timeout", type=float, help="give up after this many seconds (exit 1)")
    p.set_defaults(func=nodes_watch)
