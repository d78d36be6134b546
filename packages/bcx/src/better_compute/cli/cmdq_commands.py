"""``bcx commands list|get|cancel``, ``bcx agents list``,
``bcx batches create|list|get|approve|keygen`` and ``bcx quorum show``.

``batches approve`` signs on this machine with the approver's key file (``batches keygen`` makes
one): the batch's document is rebuilt from the scope shown, checked against what the service
sent, signed here, and only the signature is sent. The private key never leaves the file.
"""

from __future__ import annotations

import argparse
import base64
import sys
from pathlib import Path
from typing import Any

import msgspec
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from ..clients.cmdq import CommandQueueClient
from ..clients.engine import EngineClient
from ..clients.pki import PkiClient
from ..config import Settings
from ..core.errors import BcError, ErrorCode
from ..crypto import sign_batch
from ..files import atomic_write
from ..service.client import ApiClient
from ..wire.cmdq import AgentView, BatchView, CommandView
from ..wire.paging import MAX_LIMIT
from .common import add_tenant_flag, api_client
from .node_refs import node_names, node_ref
from .output import iso, print_json, print_table
from .paging import add_paging, collect_pages, show_page
from .pki_commands import parse_seconds
from .plan import SCOPE_SHOWN, print_batch_scope

__all__ = ["load_approver_key", "register"]

_STATES = [
    "pending",
    "dispatched",
    "acked",
    "running",
    "cancelling",
    "succeeded",
    "failed",
    "rejected",
    "expired",
    "cancelled",
]


def _at(seconds: float | None) -> str | None:
    return iso(seconds)


def _json(value: Any) -> Any:
    return msgspec.to_builtins(value)


def _command_row(c: CommandView) -> dict[str, Any]:
    return {
        "id": c.id,
        "node": c.node_id,
        "kind": c.kind,
        "state": c.state,
        "agent": c.agent_id,
        "reason": c.reason,
        "updated": _at(c.updated_at),
    }


def _agent_row(a: AgentView, cert_state: str | None) -> dict[str, Any]:
    return {
        "id": a.id,
        "site": a.site_id,
        "role": a.role,
        "cert": cert_state,
        "connected": a.connected,
        "bootLease": a.boot_lease,
        "live": a.live_commands,
        "version": a.version,
        "drivers": ",".join(a.status.drivers) if a.status and a.status.drivers else None,
        "cache": _cache_use(a),
        "lastError": _last_error(a),
        "lastSeen": _at(a.last_seen),
    }


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _cache_use(a: AgentView) -> str | None:
    s = a.status
    if s is None or s.cache_used_bytes is None:
        return None
    used = _size(s.cache_used_bytes)
    text = f"{used} of {_size(s.cache_max_bytes)}" if s.cache_max_bytes else used
    if s.cache_objects is not None:
        text += f", {s.cache_objects} objects ({s.cache_pinned or 0} pinned)"
    return text


def _last_error(a: AgentView) -> str | None:
    s = a.status
    if s is None or not s.last_error:
        return None
    at = f" ({iso(s.last_error_at_ms / 1000)})" if s.last_error_at_ms else ""
    return f"{s.last_error[:100]}{at}"


def _batch_row(b: BatchView) -> dict[str, Any]:
    counted = sum(1 for a in b.approvals if a.counted)
    return {
        "id": b.id,
        "state": b.state,
        "approvals": f"{counted}/{b.threshold}",
        "kinds": ",".join(b.kinds),
        "nodes": len(b.nodes),
        "workflow": b.workflow_id,
        "expires": _at(b.expires_at_ms / 1000),
    }


def _show_result(result: bytes | None) -> str | None:
    if result is None:
        return None
    try:
        return result.decode()
    except UnicodeDecodeError:
        return "base64:" + base64.b64encode(result).decode()


# -- commands -------------------------------------------------------------------------


async def cmd_commands_list(args: argparse.Namespace, settings: Settings) -> int:
    async with api_client(settings) as api:
        commands, next_ = await collect_pages(
            CommandQueueClient(api).list_commands, "commands", args, cursor_param="before",
            node_id=args.node, workflow_id=args.workflow, state=args.state, kind=args.kind,
            site_id=args.site, agent_id=args.agent, batch_id=args.batch,
        )  # fmt: skip
        seen = list(dict.fromkeys(c.node_id for c in commands if c.node_id))
        names = {} if args.json else await node_names(EngineClient(api), seen)
    rows = [_command_row(c) for c in commands]
    for c, row in zip(commands, rows, strict=True):
        if c.node_id in names:
            row["node"] = f"{c.node_id} ({names[c.node_id]})"
    return show_page(
        args, next_, key="commands", found=_json(commands),
        rows=rows,
        columns=[("id", "ID"), ("node", "NODE"), ("kind", "KIND"), ("state", "STATE"),
                 ("agent", "AGENT"), ("reason", "REASON"), ("updated", "UPDATED")],
        empty="no commands",
    )  # fmt: skip


async def cmd_commands_get(args: argparse.Namespace, settings: Settings) -> int:
    async with api_client(settings) as api:
        view = await CommandQueueClient(api).get(id=args.id)
    if args.json:
        print_json(_json(view))
        return 0
    rows = [
        ("id", view.id), ("kind", view.kind), ("state", view.state), ("reason", view.reason),
        ("node", view.node_id), ("site", view.site_id), ("target", view.target),
        ("agent", view.agent_id), ("key", view.key), ("workflow", view.workflow_id),
        ("step", view.step), ("destructive", view.destructive), ("batch", view.batch_id),
        ("progress", view.progress), ("attested", view.attested),
        ("created", _at(view.created_at)), ("updated", _at(view.updated_at)),
        ("notAfter", _at(view.not_after)), ("payload", msgspec.json.encode(view.payload).decode()),
        ("result", _show_result(view.result)),
    ]  # fmt: skip
    print_table([{"field": k, "value": v} for k, v in rows], [("field", "FIELD"), ("value", "VALUE")])
    return 0


async def cmd_commands_cancel(args: argparse.Namespace, settings: Settings) -> int:
    if (args.id is None) == (args.key_prefix is None):
        raise BcError(ErrorCode.INVALID_INPUT, "give a command id, or --key-prefix", {"path": "id"})
    async with api_client(settings) as api:
        cancelled = await CommandQueueClient(api).cancel(
            id=args.id, node_id=args.node, key_prefix=args.key_prefix, reason=args.reason
        )
    if args.json:
        print_json({"cancelled": cancelled})
    elif cancelled:
        for ident in cancelled:
            print(f"cancelled {ident}")
    else:
        print("nothing live to cancel")
    return 0


# -- agents -----------------------------------------------------------------------------


async def cmd_agents_list(args: argparse.Namespace, settings: Settings) -> int:
    async with api_client(settings) as api:
        agents, next_ = await collect_pages(
            CommandQueueClient(api).agents_page, "agents", args,
            site_id=args.site, role=args.role, connected=args.connected,
        )  # fmt: skip
        states = await _cert_states(api, agents)
        # a node agent's id is its node's: the table shows the node's name beside it
        node_agents = [a.id for a in agents if a.id.startswith("node_")]
        names = {} if args.json or not node_agents else await node_names(EngineClient(api), node_agents)
    rows = [_agent_row(a, states.get(a.cert_id)) for a in agents]
    for row in rows:
        row["name"] = names.get(row["id"])
    return show_page(
        args, next_, key="agents",
        found=[{**_json(a), "certState": states.get(a.cert_id)} for a in agents],
        rows=rows,
        columns=[("id", "ID"), ("name", "NAME"), ("site", "SITE"), ("role", "ROLE"), ("cert", "CERT"),
                 ("connected", "CONNECTED"), ("bootLease", "BOOT LEASE"), ("live", "LIVE"),
                 ("version", "VERSION"), ("drivers", "DRIVERS"), ("cache", "CACHE"),
                 ("lastError", "LAST ERROR"), ("lastSeen", "LAST SEEN")],
        empty="no agents",
    )  # fmt: skip


async def _cert_states(api: ApiClient, agents: list[AgentView]) -> dict[str, str]:
    """Each agent certificate's state as bc-pki has it (``valid``, ``revoked``, ``expired``): the
    command queue lists an agent by presence, and a revoked one may still look connected. One
    ``certs.list`` call for the page of agents (more only if its reply is cut by size). When
    bc-pki cannot tell now, the states are left out (shown as ``-``)."""
    cert_ids = sorted({a.cert_id for a in agents})
    pki = PkiClient(api, timeout=3.0)
    states: dict[str, str] = {}
    try:
        for at in range(0, len(cert_ids), MAX_LIMIT):  # --all-pages may list more agents
            chunk = cert_ids[at : at + MAX_LIMIT]
            cursor: str | None = None
            while True:
                page = await pki.certificates_page(
                    cert_ids=chunk, include_revoked=True, limit=len(chunk), cursor=cursor
                )
                states.update((c.cert_id, c.state) for c in page.certificates)
                if (cursor := page.next) is None:
                    break
    except BcError:
        pass  # bc-pki cannot tell now: what it told stays, the rest shows as -
    return states


# -- batches ----------------------------------------------------------------------------


def _print_batch(batch: BatchView, *, as_json: bool, names: dict[str, str] | None = None) -> None:
    if as_json:
        print_json(_json(batch))
        return
    print_table([_batch_row(batch)], [(k, k.upper()) for k in _batch_row(batch)])
    print(f"kinds: {', '.join(batch.kinds)}")
    named = names or {}
    print(f"nodes: {', '.join(f'{n} ({named[n]})' if n in named else n for n in batch.nodes)}")
    if batch.note:
        print(f"note:  {batch.note}")
    for a in batch.approvals:
        counted = "" if a.counted else " (not counted: approver no longer configured)"
        print(f"approved by {a.approver_id} at {_at(a.at)}{counted}")


async def cmd_batches_create(args: argparse.Namespace, settings: Settings) -> int:
    async with api_client(settings) as api:
        batch = await CommandQueueClient(api).create_batch(
            kinds=args.kind,
            nodes=args.node,
            tenant_id=args.tenant,
            ttl_seconds=args.ttl,
            workflow_id=args.workflow,
            note=args.note,
            idempotency_key=args.idempotency_key,
        )
    _print_batch(batch, as_json=args.json)
    return 0


async def cmd_batches_list(args: argparse.Namespace, settings: Settings) -> int:
    async with api_client(settings) as api:
        batches, next_ = await collect_pages(
            CommandQueueClient(api).batches_page, "batches", args, workflow_id=args.workflow, state=args.state
        )
    return show_page(
        args, next_, key="batches", found=_json(batches),
        rows=[_batch_row(b) for b in batches],
        columns=[("id", "ID"), ("state", "STATE"), ("approvals", "APPROVALS"), ("kinds", "KINDS"),
                 ("nodes", "NODES"), ("workflow", "WORKFLOW"), ("expires", "EXPIRES")],
        empty="no batches",
    )  # fmt: skip


async def cmd_batches_get(args: argparse.Namespace, settings: Settings) -> int:
    async with api_client(settings) as api:
        batch = await CommandQueueClient(api).get_batch(id=args.id)
        names = {} if args.json else await node_names(EngineClient(api), batch.nodes)
    _print_batch(batch, as_json=args.json, names=names)
    return 0


def load_approver_key(path: str) -> ed25519.Ed25519PrivateKey:
    """An approver's Ed25519 private key from a PEM (PKCS#8) file.

    Raises:
        BcError: ``INVALID_INPUT`` at ``--key-file`` when it cannot be read or is not one.
    """
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except OSError as exc:
        raise BcError(
            ErrorCode.INVALID_INPUT, f"cannot read the key file: {exc.strerror}", {"path": "--key-file"}
        ) from exc
    except (ValueError, TypeError) as exc:
        raise BcError(
            ErrorCode.INVALID_INPUT, "the key file holds no unencrypted PEM key", {"path": "--key-file"}
        ) from exc
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise BcError(ErrorCode.INVALID_INPUT, "an approver key is Ed25519", {"path": "--key-file"})
    return key


async def _workflow_lines(api: ApiClient, batch: BatchView) -> dict[str, str]:
    """``profile@version on node`` of the batch's first workflows, as the engine tells them;
    nothing for those it cannot tell now (the signature covers the ids either way)."""
    ids = [batch.workflow_id] if batch.workflow_id else batch.workflow_ids[:SCOPE_SHOWN]
    engine = EngineClient(api)
    lines: dict[str, str] = {}
    for wf_id in ids:
        try:
            wf = await engine.get_workflow(id=wf_id)
        except BcError:
            continue  # no engine here, or not its workflow: the id alone is shown
        lines[wf_id] = f"{wf.profile.id}@{wf.profile.version} on {wf.node_id or '-'}"
    return lines


def _confirmed(batch: BatchView) -> bool:
    """At a terminal, the approver says yes to the scope just shown (asked on stderr, so a
    redirected stdout never hides the question)."""
    sys.stderr.write(f"sign batch {batch.id}? [y/N] ")
    sys.stderr.flush()
    return sys.stdin.readline().strip().lower() in ("y", "yes")


async def cmd_batches_approve(args: argparse.Namespace, settings: Settings) -> int:
    """Show what each batch named would approve, then sign it; one refused does not stop the
    others (exit 1 if any was). At a terminal each signature is asked for, unless ``--yes``;
    a script (stdin or stderr not a terminal) signs what it named without a question. With ``--json``
    the scope goes to stderr, stdout stays one document."""
    key = load_approver_key(args.key_file)
    ask = not args.yes and sys.stdin.isatty() and sys.stderr.isatty()
    approved: list[BatchView] = []
    errors: list[dict[str, Any]] = []
    async with api_client(settings) as api:
        cq = CommandQueueClient(api)
        for batch_id in args.id:
            try:
                batch = await cq.get_batch(id=batch_id)
                signature = sign_batch(batch, key)  # refuses a document that is not the scope shown
                print_batch_scope(
                    batch, workflows=await _workflow_lines(api, batch), out=sys.stderr if args.json else None
                )
                if ask and not _confirmed(batch):
                    raise BcError(
                        ErrorCode.INVALID_STATE,
                        f"batch {batch.id} not signed: the approver said no",
                        {"path": "id", "reason": "not-confirmed"},
                    )
                approved.append(
                    await cq.approve_batch(batch_id=batch.id, approver_id=args.approver, signature=signature)
                )
            except BcError as err:
                if err.code is ErrorCode.UNAVAILABLE or len(args.id) == 1:
                    raise  # one batch: the usual error line, with its path and hint
                errors.append({"id": batch_id, "code": err.code.value, "message": err.message})
    if len(args.id) == 1:
        _print_batch(approved[0], as_json=args.json)
    elif args.json:
        print_json({"batches": _json(approved), "errors": errors})
    else:
        for b in approved:
            _print_batch(b, as_json=False)
        for e in errors:
            print(f"error: {e['id']}: {e['code']}: {e['message']}", file=sys.stderr)
    return 1 if errors else 0


async def cmd_quorum_show(args: argparse.Namespace, settings: Settings) -> int:
    """The quorum the command queue enforces now (not what some file says)."""
    async with api_client(settings) as api:
        view = await CommandQueueClient(api).quorum()
    if args.json:
        print_json(_json(view))
        return 0
    if not view.enabled:
        print("quorum: off: destructive commands run without approval")
        print("set [cmdq.quorum] in bc.toml (threshold and approvers) and restart bc-command-queue")
        return 0
    print(f"quorum: on: threshold {view.threshold} of {len(view.approvers)}")
    print_table(
        [{"id": a.id, "publicKey": a.public_key} for a in view.approvers],
        [("id", "APPROVER"), ("publicKey", "PUBLIC KEY")],
    )
    return 0


async def cmd_batches_keygen(args: argparse.Namespace, _settings: Settings) -> int:
    key = ed25519.Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    try:
        atomic_write(args.key_file, pem, exclusive=True)
    except FileExistsError:
        raise BcError(ErrorCode.CONFLICT, "the key file already exists", {"path": "--key-file"}) from None
    public = base64.b64encode(
        key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    ).decode()
    if args.json:
        print_json({"keyFile": args.key_file, "publicKey": public})
    else:
        print(f"wrote {args.key_file} (keep it on this machine)")
        print("add to the command queue's approvers file:")
        print(f'[[approvers]]\nid = "{args.approver or "<your-name>"}"\npublicKey = "{public}"')
    return 0


# -- the parser -----------------------------------------------------------------------


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``commands``, ``agents`` and ``batches`` to bcx."""
    commands = sub.add_parser("commands", help="commands sent to agents")
    csub = commands.add_subparsers(dest="commands_command", required=True, metavar="COMMAND")
    p = csub.add_parser("list", parents=[common], help="commands, newest first")
    p.add_argument("--node", type=node_ref, help="node id or name")
    p.add_argument("--workflow", help="workflow id")
    p.add_argument("--state", choices=_STATES, help="only commands in this state")
    p.add_argument("--kind", help="command kind (power.setPower)")
    p.add_argument("--site", help="site id")
    p.add_argument("--agent", help="agent id")
    p.add_argument("--batch", help="batch id")
    add_paging(p, default_limit=50)
    p.add_argument("--before", dest="cursor", help=argparse.SUPPRESS)  # the name before --cursor
    p.set_defaults(func=cmd_commands_list)
    p = csub.add_parser("get", parents=[common], help="one command, with payload and result")
    p.add_argument("id", help="command id (cmd_…)")
    p.set_defaults(func=cmd_commands_get)
    p = csub.add_parser("cancel", parents=[common], help="cancel a live command, or those under a key")
    p.add_argument("id", nargs="?", help="command id")
    p.add_argument("--key-prefix", help="every live command whose key starts so (wf:<id>:<step>)")
    p.add_argument("--node", type=node_ref, help="with --key-prefix: only this node's (id or name)")
    p.add_argument("--reason", default="cancelled by an operator", help="recorded with the cancel")
    p.set_defaults(func=cmd_commands_cancel)

    agents = sub.add_parser("agents", help="site agents and node agents")
    asub = agents.add_subparsers(dest="agents_command", required=True, metavar="COMMAND")
    p = asub.add_parser("list", parents=[common], help="agents, with presence and boot leases")
    p.add_argument("--site", help="site id")
    p.add_argument("--role", choices=["site", "node", "provisioned", "discovery"], help="only this role")
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--connected", action="store_const", const=True, dest="connected", help="only agents connected now"
    )
    group.add_argument(
        "--silent", action="store_const", const=False, dest="connected", help="only agents not heard from"
    )
    add_paging(p, default_limit=100)
    p.set_defaults(func=cmd_agents_list, connected=None)

    batches = sub.add_parser("batches", help="destructive batches and their approvals")
    bsub = batches.add_subparsers(dest="batches_command", required=True, metavar="COMMAND")
    p = bsub.add_parser("create", parents=[common], help="a batch: command kinds and nodes, until expiry")
    p.add_argument("--kind", action="append", required=True, help="a destructive kind (repeat)")
    p.add_argument("--node", action="append", required=True, type=node_ref, help="a node id or name (repeat)")
    p.add_argument("--ttl", type=parse_seconds, default=24 * 3600, help="lifetime (90m, 24h, 7d)")
    add_tenant_flag(p)
    p.add_argument("--workflow", help="the workflow the batch is for")
    p.add_argument("--note", help="why, for the approvers")
    p.add_argument("--idempotency-key", help="asking again with it returns the same batch")
    p.set_defaults(func=cmd_batches_create)
    p = bsub.add_parser("list", parents=[common], help="batches, newest first")
    p.add_argument("--workflow", help="only the batch of this workflow")
    p.add_argument(
        "--state", choices=["open", "approved", "expired", "closed"], help="only batches in this state"
    )
    add_paging(p, default_limit=50)
    p.set_defaults(func=cmd_batches_list)
    p = bsub.add_parser("get", parents=[common], help="one batch with its approvals")
    p.add_argument("id", help="batch id (batch_…)")
    p.set_defaults(func=cmd_batches_get)
    p = bsub.add_parser(
        "approve", parents=[common], help="show what a batch approves, then sign it here with your key file"
    )
    p.add_argument("id", nargs="+", help="one or more batch ids")
    p.add_argument("--approver", required=True, help="your approver id, as configured")
    p.add_argument("--key-file", required=True, help="your Ed25519 private key (PEM)")
    p.add_argument(
        "--yes", action="store_true", help="sign without asking at a terminal (a script is never asked)"
    )
    p.set_defaults(func=cmd_batches_approve)
    p = bsub.add_parser("keygen", parents=[common], help="make an approver key file (0600)")
    p.add_argument("--key-file", required=True, help="where to write the new private key")
    p.add_argument("--approver", help="your approver id, for the snippet printed")
    p.set_defaults(func=cmd_batches_keygen)

    quorum = sub.add_parser("quorum", help="the destructive-batch quorum in force")
    qsub = quorum.add_subparsers(dest="quorum_command", required=True, metavar="COMMAND")
    p = qsub.add_parser("show", parents=[common], help="whether the quorum is on, threshold and approvers")
    p.set_defaults(func=cmd_quorum_show)
