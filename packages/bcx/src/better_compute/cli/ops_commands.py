"""``bcx events tail`` (the ``BC_EVENTS`` feed, docs/events.md) and ``bcx audit`` (docs/audit.md)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ..clients.audit import AuditClient
from ..config import Settings
from ..core.errors import BcError, ErrorCode
from ..core.manifest import parse_duration
from ..wire import Subjects
from ..wire.cmdq import BatchEvent, CommandEvent
from ..wire.engine import (
    BatchCreated,
    NodeChanged,
    NodeRemoved,
    StepChanged,
    VerbApplied,
    WorkflowFinished,
)
from ..wire.events import FEED_KINDS, decode_feed_event, event_node, event_workflow
from ..wire.pki import CertRevoked, JoinAccepted, JoinRefused
from .common import api_client, as_rows, connect_bus, short, stop_if_interrupted
from .node_refs import node_ref
from .output import iso, json_line, print_json, print_table

if TYPE_CHECKING:
    from nats.aio.client import Client as Nats

__all__ = ["describe_event", "parse_since", "register"]


def parse_since(text: str | None, *, now: float | None = None) -> datetime | None:
    """``--since``: a duration back from now (``10m``, ``2h``, ``7d``), an ISO 8601 time
    (``2026-12-01T06:30:00Z``), or ``all``; None when not given. ``INVALID_INPUT`` at ``since``."""
    if text is None:
        return None
    if text == "all":
        return datetime.fromtimestamp(0, UTC)
    try:
        ms = parse_duration(text)
    except BcError:
        pass
    else:
        return datetime.fromtimestamp((now if now is not None else time.time()) - ms / 1000, UTC)
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise BcError(
            ErrorCode.INVALID_INPUT,
            f"--since takes a duration (10m, 2h), an ISO 8601 time or 'all', got {text!r}",
            {"path": "since"},
        ) from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def describe_event(event: Any) -> str:
    """One event in words, after its time, kind and id."""
    match event:
        case StepChanged(step=s, workflow_state=wf_state):
            tail = f"  {s.error.get('code')}" if isinstance(s.error, dict) else ""
            return f"step {s.index} {s.action} {s.state} attempt {s.attempt} (workflow {wf_state}){tail}"
        case WorkflowFinished(workflow_state=state):
            return f"workflow {state}"
        case BatchCreated(batch_id=batch_id):
            return f"waits for the approval of {batch_id}"
        case VerbApplied(verb=verb, workflow_state=state):
            return f"{verb} (workflow {state})"
        case NodeChanged(state=state, generation=gen, observed_generation=seen, verb=verb):
            by = f" by {verb}" if isinstance(verb, str) else ""
            return f"node {state} generation {gen}/{seen}{by}"
        case NodeRemoved():
            return "node deleted"
        case CommandEvent(kind=kind, state=state, reason=reason, node_id=node):
            why = f" ({reason})" if reason else ""
            return f"{kind or 'command'} {state}{why} node {node}"
        case BatchEvent(state=state, approvals=have, threshold=need, approver_id=approver):
            by = f" approval of {approver}" if approver else ""
            return f"batch {state} {have}/{need}{by}"
        case JoinAccepted(agent_id=agent, role=role, site_id=site):
            return f"joined: {role} agent {agent}" + (f" at site {site}" if site else "")
        case JoinRefused(reason=reason, code=code):
            return f"join refused: {reason} ({code})"
        case CertRevoked(cert_id=cert):
            return f"certificate {cert} revoked"
    return "event"


@dataclass(frozen=True)
class _Stored:
    """One event as the stream keeps it."""

    subject: str
    data: bytes
    seq: int
    time: str  # nats-server's RFC 3339 time of storing


_BATCH = 256  # events per direct read
_WAIT_S = 1.0  # following: read again after this long even without a wake-up
_END_OF_BATCH = ("204", "404")  # nats-server: batch done / nothing (more) to read


async def _read_batch(nc: Nats, stream: str, request: dict[str, Any]) -> list[_Stored]:
    """Up to ``_BATCH`` stored events from one batched direct get (nats-server 2.11+): a read
    that creates nothing on the server, answered on this bcx's own inbox."""
    from nats.js import api as js_api  # loaded with the connection: `bcx --help` does not pay for it

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    got: list[_Stored] = []
    try:
        body = json.dumps({**request, "batch": _BATCH}).encode()
        await nc.publish(f"$JS.API.DIRECT.GET.{stream}", body, reply=inbox)
        while True:
            try:
                # asyncio.timeout: nats-py's own timeout waits with wait_for (stop_if_interrupted)
                async with asyncio.timeout(5.0):
                    msg = await sub.next_msg(timeout=None)
            except TimeoutError:
                raise BcError(
                    ErrorCode.TIMEOUT, f"no answer reading the event stream {stream}", {"stream": stream}
                ) from None
            headers = msg.headers or {}
            status = headers.get(js_api.Header.STATUS)
            if status in _END_OF_BATCH:
                return got
            if status:
                said = headers.get(js_api.Header.DESCRIPTION, "")
                raise BcError(
                    ErrorCode.UNAVAILABLE,
                    f"the event stream {stream} refused a read: {status} {said}".rstrip(),
                    {"stream": stream, "status": status},
                )
            got.append(
                _Stored(
                    subject=headers.get("Nats-Subject", msg.subject),
                    data=msg.data,
                    seq=int(headers.get("Nats-Sequence", "0")),
                    time=headers.get("Nats-Time-Stamp", ""),
                )
            )
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def events_tail(args: argparse.Namespace, settings: Settings) -> int:
    """Print the feed's events, oldest first, as they arrive (``--no-follow``: what is stored).

    bcx reads the stream with batched direct gets, never a consumer: an operator's NATS user may
    create no consumer on the control plane's JetStream (a push consumer's deliveries could be
    pointed at any subject of the services, deploy/nats/accounts.conf). Following, a plain
    subscription to the feed only wakes the next read; the stream's sequence keeps the order.
    """
    kinds = _kinds(args.kind)
    since = parse_since(args.since)
    follow = not args.no_follow
    if since is None and not follow:
        since = datetime.fromtimestamp(0, UTC)  # what is stored: all of it
    subjects = Subjects(root=settings.subject_root)
    nc = await connect_bus(settings)
    import nats.errors  # loaded with the connection: `bcx --help` does not pay for nats-py
    import nats.js.errors

    try:
        stream = subjects.events_stream()
        try:
            info = await nc.jetstream(timeout=5.0).stream_info(stream)
        except nats.js.errors.NotFoundError:
            raise BcError(
                ErrorCode.UNAVAILABLE,
                f"no event stream {stream} on this NATS: bc-command-queue creates it at start",
                {"stream": stream},
            ) from None
        if not info.config.allow_direct:
            raise BcError(
                ErrorCode.UNAVAILABLE,
                f"the event stream {stream} does not allow direct reads yet: bc-command-queue"
                " turns them on at its start (restart it after upgrading)",
                {"stream": stream},
            )
        only = f"{subjects.root}.events.{kinds[0]}.*" if len(kinds) == 1 else subjects.events_feed()
        request: dict[str, Any] = {"next_by_subj": only}
        if since is None:
            request["seq"] = info.state.last_seq + 1
        else:
            request["start_time"] = since.astimezone(UTC).isoformat().replace("+00:00", "Z")
        wake = asyncio.Event()
        if follow:

            async def woken(_msg: Any) -> None:
                wake.set()

            await nc.subscribe(only, cb=woken)
        shown = 0
        while True:
            stop_if_interrupted()
            wake.clear()
            batch = await _read_batch(nc, stream, request)
            for event in batch:
                if _show(event, subjects, kinds, args, as_json=args.json):
                    shown += 1
                    if args.limit and shown >= args.limit:
                        return 0
            if batch:
                request = {"next_by_subj": only, "seq": batch[-1].seq + 1}
            if len(batch) == _BATCH:
                continue
            if not follow:
                return 0
            with contextlib.suppress(TimeoutError):
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that
                # arrives as its wait completes, so a Ctrl-C while events flow went unheard
                async with asyncio.timeout(_WAIT_S):
                    await wake.wait()
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


def _kinds(given: list[str] | None) -> list[str]:
    kinds: list[str] = []
    for item in given or []:
        for kind in item.split(","):
            if kind not in FEED_KINDS:
                raise BcError(
                    ErrorCode.INVALID_INPUT,
                    f"no event kind {kind!r}: one of {', '.join(FEED_KINDS)}",
                    {"path": "kind"},
                )
            kinds.append(kind)
    return kinds or list(FEED_KINDS)


def _show(
    msg: _Stored, subjects: Subjects, kinds: list[str], args: argparse.Namespace, *, as_json: bool
) -> bool:
    parts = msg.subject[len(subjects.root) + 1 :].split(".")
    if len(parts) != 3 or parts[0] != "events":
        return False
    _, kind, ident = parts
    if kind not in kinds:
        return False
    event = decode_feed_event(kind, msg.data)
    node = ident if kind == "node" else event_node(event)
    if args.node and node not in args.node:
        return False
    if args.workflow and (ident if kind == "workflow" else event_workflow(event)) not in args.workflow:
        return False
    at = getattr(event, "at", None)
    when = iso(at) if isinstance(at, (int, float)) else iso(msg.time)
    if as_json:
        try:
            raw = json.loads(msg.data)
        except ValueError:
            raw = None
        line = {"seq": msg.seq, "time": when, "kind": kind, "id": ident, "event": raw}
        print(json_line(line), flush=True)
    else:
        text = describe_event(event) if event is not None else f"({len(msg.data)} bytes this bcx cannot read)"
        print(f"{when}  {kind:<8} {ident}  {text}", flush=True)
    return True


async def audit_list(args: argparse.Namespace, settings: Settings) -> int:
    """Operator actions of every service, newest first."""
    since = parse_since(args.since)
    if args.limit < 1 or args.limit > 1000:
        raise BcError(ErrorCode.INVALID_INPUT, "--limit is 1 to 1000", {"path": "limit"})
    async with api_client(settings) as api:
        entries, failed = await AuditClient(api).merged(
            since=since.timestamp() if since is not None else None, who=args.who, limit=args.limit
        )
    for service, err in failed.items():
        sys.stderr.write(f"warning: the audit of {service} is missing: {err.code.value}: {err.message}\n")
    if args.json:
        print_json({"entries": as_rows(entries), "missing": sorted(failed)})
        return 0
    rows = [
        {
            "at": iso(e.at),
            "who": e.actor or "(not said)",
            # yes: the NATS user nats-server named; no: what the request said (docs/audit.md)
            "proven": "yes" if e.verified else "no",
            "service": e.service,
            "action": e.action,
            "target": e.target or "-",
            "detail": short(e.detail, 70) if e.detail else "",
        }
        for e in entries
    ]
    print_table(
        rows,
        [("at", "AT"), ("who", "WHO"), ("proven", "PROVEN"), ("service", "SERVICE"), ("action", "ACTION"),
         ("target", "TARGET"), ("detail", "DETAIL")],
        empty="no audited actions",
    )  # fmt: skip
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    events = sub.add_parser("events", help="the event feed (stream BC_EVENTS)").add_subparsers(
        dest="events_command", required=True, metavar="COMMAND"
    )
    p = events.add_parser("tail", parents=[common], help="print events as they happen")
    p.add_argument(
        "--kind", action="append", help=f"only these kinds ({', '.join(FEED_KINDS)}); repeat or a,b"
    )
    p.add_argument(
        "--node", action="append", type=node_ref, help="only events about this node (id or name; repeatable)"
    )
    p.add_argument("--workflow", action="append", help="only events about this workflow (repeatable)")
    p.add_argument("--since", help="from this long ago (10m, 2h), an ISO 8601 time, or 'all' (default: new)")
    p.add_argument("--no-follow", action="store_true", help="print what is stored and exit")
    p.add_argument("--limit", type=int, default=0, help="exit after this many events")
    p.set_defaults(func=events_tail)

    p = sub.add_parser("audit", parents=[common], help="operator actions that changed state, newest first")
    p.add_argument("--since", help="from this long ago (10m, 2h), an ISO 8601 time, or 'all' (default all)")
    p.add_argument(
        "--who", help="only this actor (as bcx sends it: $BC_ACTOR or login@host); a* for a prefix"
    )
    p.add_argument("--limit", type=int, default=100, help="at most this many (1 to 1000, default 100)")
    p.set_defaults(func=audit_list)
