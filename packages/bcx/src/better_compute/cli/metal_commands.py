"""``bcx nodes enroll|show`` and the lifecycle verbs: ``bcx inspect|commission|deploy|release|
retire|adopt <node>`` and ``bcx bulk <verb> --selector site=lab1,rack=r12``.

The BMC credential is read from a file (``--bmc-credentials-file``) or asked for at the terminal,
never taken as an argument value (argument values end up in shell history and ``ps``); it is
stored through bc-secrets as the node's standing secret and the node names it by reference only.
Nothing here prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import sys
import time
from pathlib import Path
from typing import Any, cast

from ..clients import CommandQueueClient, EngineClient, SecretsClient
from ..config import Settings
from ..core.errors import BcError, ErrorCode
from ..core.ids import new_id, parse_id
from ..logging import register_secret
from ..metal.lifecycle import VERBS, parse_bmc_url, parse_selector
from ..metal.steps.profiles import ENROLL_PROFILE_ID, VALIDATE_PROFILE_ID
from ..metal.steps.ramdisk import token_delivery
from ..wire.codec import convert
from ..wire.engine import NodeView
from ..wire.metal import BulkRun, NodeBmc, VerbName
from . import node_actions, rollout
from .common import add_tenant_flag, api_client, as_rows, engine_client, parse_labels
from .node_refs import NODE_HELP, node_ref
from .output import json_line, named, print_json, print_table
from .plan import bulk_plan, verb_plan
from .rollout import watch_nodes
from .why_commands import why_line

__all__ = [
    "add_bmc_credential_flags",
    "check_lines",
    "read_credentials",
    "register",
    "update_bmc",
    "validate_node",
]


def add_bmc_credential_flags(p: argparse.ArgumentParser) -> None:
    """The flags ``read_credentials`` reads, and ``--bmc-insecure``."""
    p.add_argument(
        "--bmc-credentials-file",
        help='a file with {"username": …, "password": …} or username:password (else asked for)',
    )
    p.add_argument("--bmc-user", help="the BMC username when the password is asked for")
    p.add_argument("--bmc-insecure", action="store_true", help="do not verify the BMC's TLS certificate")
    p.add_argument(
        "--bmc-token-delivery",
        choices=["network", "media"],
        help="how the ramdisk gets its join token: on its kernel line, held until the boot entry"
        " closes clean (network, the default), or on a virtual CD only the BMC fetches (media;"
        " Redfish only; docs/security.md)",
    )
    p.add_argument("--no-prompt", action="store_true", help="never ask for a credential")


def read_credentials(path: str | None, *, user: str | None, interactive: bool) -> bytes | None:
    """The BMC credential as the site agent reads it: JSON ``{"username", "password"}``.

    From ``path`` (that JSON, or one line ``username:password``), else asked at the terminal
    when ``interactive``; None when there is none to give (a BMC without authentication).

    Raises:
        BcError: ``INVALID_INPUT`` at ``bmcCredentialsFile`` for an unreadable or malformed file
            (the message never quotes it).
    """
    if path is not None:
        try:
            text = Path(path).read_text().strip()
        except OSError as exc:
            raise BcError(
                ErrorCode.INVALID_INPUT, f"cannot read {path}: {exc.strerror}", {"path": "bmcCredentialsFile"}
            ) from None
        username, password = _parse_credentials(text, path)
    elif interactive:
        username = user or input("BMC username: ").strip()
        password = getpass.getpass("BMC password: ")
    else:
        return None
    register_secret(password)
    return json.dumps({"username": username, "password": password}).encode()


def _parse_credentials(text: str, path: str) -> tuple[str, str]:
    bad = BcError(
        ErrorCode.INVALID_INPUT,
        f'{path} holds {{"username": …, "password": …}} or one line username:password',
        {"path": "bmcCredentialsFile"},
    )
    if text.startswith("{"):
        try:
            doc = json.loads(text)
        except ValueError:
            raise bad from None
        username, password = doc.get("username"), doc.get("password")
    else:
        username, sep, password = text.partition(":")
        if not sep or "\n" in text:
            raise bad
    if not isinstance(username, str) or not isinstance(password, str) or not username or not password:
        raise bad
    return username, password


def _node_bmc(bmc: dict[str, object], credentials_ref: str | None) -> NodeBmc:
    """The ``--bmc`` URL's BMC naming its credential; ``INVALID_INPUT`` at ``bmc.…``."""
    try:
        return convert({**bmc, "credentialsRef": credentials_ref}, NodeBmc)
    except BcError as err:
        raise err.with_path_prefix("bmc") from err


async def update_bmc(api: Any, args: argparse.Namespace, node: NodeView) -> NodeBmc | None:
    """``nodes update``'s new BMC: ``--bmc URL`` (a new address, and a credential read as enroll
    reads it), or only a new credential for the BMC the node has (``--bmc-credentials-file`` /
    ``--bmc-user``). The credential goes to bc-secrets as the node's; the node keeps only its
    reference. None when neither was given."""
    new_credential = args.bmc_credentials_file is not None or args.bmc_user is not None
    if args.bmc is None and not new_credential and not args.bmc_insecure and not args.bmc_token_delivery:
        return None
    if args.bmc is not None:
        bmc: dict[str, object] = parse_bmc_url(args.bmc)
        ref: Any = None
    elif node.bmc is None:
        raise BcError(ErrorCode.INVALID_INPUT, f"node {node.id} has no BMC: give --bmc", {"path": "bmc"})
    else:
        bmc = {k: v for k, v in node.bmc.items() if k != "credentialsRef"}
        ref = node.bmc.get("credentialsRef")
    if args.bmc_insecure:
        bmc["insecure"] = True
    if args.bmc_token_delivery:
        bmc["tokenDelivery"] = args.bmc_token_delivery
    _node_bmc(bmc, None)  # a bad BMC is refused before a credential is stored for it
    if bmc["driver"] != "sim" and (args.bmc is not None or new_credential):
        interactive = not args.no_prompt and sys.stdin.isatty()
        credential = read_credentials(args.bmc_credentials_file, user=args.bmc_user, interactive=interactive)
        if credential is not None:
            info = await SecretsClient(api).put_for_node(
                credential, tenant_id=node.tenant_id, node_id=node.id, label="bmc"
            )
            ref = info.ref
    return _node_bmc(bmc, ref)


async def nodes_enroll(args: argparse.Namespace, settings: Settings) -> int:
    given = args.node or args.id
    node_id = parse_id(given, "node", path="id") if given else new_id("node")
    if not args.site and not given:
        raise BcError(ErrorCode.INVALID_INPUT, "give --site for a new node", {"path": "site"})
    labels = parse_labels(args.label)
    credential = None
    bmc: dict[str, object] | None = None
    if args.bmc is not None:
        bmc = parse_bmc_url(args.bmc)
        if args.bmc_insecure:
            bmc["insecure"] = True
        if args.bmc_token_delivery:
            bmc["tokenDelivery"] = args.bmc_token_delivery
        _node_bmc(bmc, None)  # a bad BMC is refused before a credential is stored for it
        if bmc["driver"] != "sim":
            interactive = not args.no_prompt and sys.stdin.isatty()
            credential = read_credentials(
                args.bmc_credentials_file, user=args.bmc_user, interactive=interactive
            )
    elif args.bmc_credentials_file is not None:
        raise BcError(ErrorCode.INVALID_INPUT, "--bmc-credentials-file needs --bmc", {"path": "bmc"})
    async with api_client(settings) as api:
        ref = None
        if credential is not None:
            info = await SecretsClient(api).put_for_node(
                credential, tenant_id=args.tenant, node_id=node_id, label="bmc"
            )
            ref = info.ref
        engine = EngineClient(api)
        site = args.site or (await engine.get_node(id=node_id)).site_id  # a discovered node's own
        node = await engine.enroll_node(
            site_id=site, id=node_id, tenant_id=args.tenant, labels=labels, macs=list(args.mac or []),
            bmc=_node_bmc(bmc, ref) if bmc is not None else None, name=args.name,
        )  # fmt: skip
        checks = None
        if node.bmc and not args.no_validate:  # the shipped enroll profile: the BMC checked, read
            checks = await validate_node(api, node, profile_id=ENROLL_PROFILE_ID)
    # a BMC that failed a check; one nobody could check (no site agent yet) is said, not failed
    failed = [c for c in checks or [] if c.get("status") == "failed"]
    if args.json:
        doc = as_rows([node])[0]
        if checks is not None:
            doc["validation"] = {"ok": not failed, "checks": checks}
        print_json(doc)
        return 1 if failed else 0
    named = f"  name {node.name}" if node.name else ""
    print(f"{node.id} {node.state}  site {node.site_id}{named}")
    if node.bmc:
        ref = node.bmc.get("credentialsRef") or "no credential"
        print(f"  bmc {node.bmc['driver']} {node.bmc['address']} ({ref})")
    if checks is not None:
        for line in check_lines(checks):
            print(f"  {line}")
    if failed:
        print(
            f"the node is enrolled, but its BMC failed validation: fix it with bcx nodes update {node.id}"
            " --bmc … --bmc-credentials-file …, then bcx nodes validate",
            file=sys.stderr,
        )
        return 1
    return 0


_WORKFLOW_ENDS = ("succeeded", "failed", "aborted")


async def validate_node(
    api: Any, node: NodeView, *, timeout: float = 120.0, profile_id: str = VALIDATE_PROFILE_ID
) -> list[dict[str, Any]]:
    """Check the node's BMC now: one entry per check, ``{check, status, message}``.

    ``metal.validate`` (its site agent's ``management.validate``), or ``metal.enroll`` (that
    check, whose failure fails its first step, then the machine read through the BMC: one more
    entry, ``inventory``, with its power and what it is)."""
    agents = await CommandQueueClient(api).agents(site_id=node.site_id, connected=True)
    if not [a for a in agents if a.role == "site"]:
        return [{
            "check": "site-agent", "status": "skipped",
            "message": f"no connected site agent at site {node.site_id}: the BMC was not checked",
        }]  # fmt: skip
    engine = EngineClient(api)
    wf = await engine.start_workflow(profile_id=profile_id, node_id=node.id, tenant_id=node.tenant_id)
    end = time.monotonic() + timeout
    while wf.state not in _WORKFLOW_ENDS:
        if time.monotonic() > end:
            raise BcError(
                ErrorCode.TIMEOUT,
                f"the validation of node {node.id} (workflow {wf.id}) did not end in {timeout:.0f}s",
                {"path": "id", "workflowId": wf.id},
            )
        await asyncio.sleep(0.25)
        wf = await engine.workflow(id=wf.id)
    steps = wf.steps if isinstance(wf.steps, list) else []
    checks = _checks_of(steps[0]) if steps else None
    error = (steps[0].error if steps else None) or wf.error
    message = str(error.get("message")) if isinstance(error, dict) else ""
    if checks:
        return checks + _inventory_check(wf.id, steps[1:])
    if (steps and steps[0].state == "succeeded") or "unsupported-kind" in message:
        # an agent that does not run management.validate (an older one, a simulated one)
        return [{
            "check": "site-agent", "status": "skipped",
            "message": f"the site agent did not check the BMC (workflow {wf.id}): it does not run"
            " management.validate",
        }, *_inventory_check(wf.id, steps[1:])]  # fmt: skip
    return [{"check": "validate", "status": "failed", "message": f"workflow {wf.id} {wf.state}: {message}"}]


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _checks_of(step: Any) -> list[dict[str, Any]] | None:
    """The checks a validating step found: in its result (``metal.validate``: the agent's
    answer under ``result``; ``enroll.validateBmc``: its own), or in the error it failed with."""
    done, error = _dict(step.result), _dict(step.error)
    details, inner = _dict(error.get("details")), _dict(done.get("result"))
    for found in (done.get("checks"), inner.get("checks"), details.get("checks")):
        if isinstance(found, list) and found:
            return [c for c in found if isinstance(c, dict)]
    return None


def _inventory_check(workflow_id: str, rest: list[Any]) -> list[dict[str, Any]]:
    """``metal.enroll``'s second step as one more check line: the machine read through its BMC."""
    if not rest or rest[0].action != "enroll.readBmc":
        return []
    step = rest[0]
    if step.state not in ("succeeded", "failed"):
        return []  # it never ran: the check before it stopped the workflow
    if step.state == "failed":
        error = step.error if isinstance(step.error, dict) else {}
        said = error.get("message") or step.state
        return [{"check": "inventory", "status": "failed", "message": f"workflow {workflow_id}: {said}"}]
    done = _dict(step.result)
    system = _dict(done.get("system"))
    if not system and not done.get("powerState"):
        return [{"check": "inventory", "status": "skipped", "message": "the site agent read no inventory"}]
    what = " ".join(str(system[k]) for k in ("manufacturer", "model") if system.get(k)) or "a machine"
    serial = f", serial {system['serial']}" if system.get("serial") else ""
    power = done.get("powerState") or "unknown"
    return [{"check": "inventory", "status": "ok", "message": f"{what}{serial}, power {power}"}]


def check_lines(checks: list[dict[str, Any]]) -> list[str]:
    return [f"{c.get('check', '?'):<12} {c.get('status', '?'):<8} {c.get('message', '')}" for c in checks]


async def nodes_validate(args: argparse.Namespace, settings: Settings) -> int:
    async with api_client(settings) as api:
        node = await EngineClient(api).get_node(id=args.id)
        if not node.bmc:
            raise BcError(
                ErrorCode.INVALID_STATE,
                f"node {node.id} has no BMC: give it one (bcx nodes update {node.id} --bmc …)",
                {"path": "id", "reason": "no-bmc"},
            )
        checks = await validate_node(api, node)
    ok = all(c.get("status") == "ok" for c in checks)
    if args.json:
        print_json({"nodeId": node.id, "ok": ok, "checks": checks})
    else:
        print("\n".join(check_lines(checks)))
    return 0 if ok else 1


def _size(n: Any) -> str:
    if not isinstance(n, int):
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def bmc_view(inventory: dict[str, Any] | None) -> str | None:
    """What the BMC said of the machine (``metal.enroll``), in a line: maker and model, serial,
    processors, memory, NICs, power."""
    if not inventory:
        return None
    system = _dict(inventory.get("system"))
    procs = [_dict(p) for p in _list(inventory.get("processors"))]
    cores = sum(p["cores"] for p in procs if isinstance(p.get("cores"), int))
    memory = _dict(inventory.get("memory")).get("totalGiB")
    nics = _list(inventory.get("nics"))
    parts = [
        " ".join(str(system[k]) for k in ("manufacturer", "model") if system.get(k)) or "a machine",
        f"serial {system['serial']}" if system.get("serial") else None,
        f"{len(procs)} processors ({cores} cores)" if procs else None,
        f"{memory} GiB" if memory else None,
        f"{len(nics)} NICs" if nics else None,
        f"power {str(system['powerState']).lower()}" if system.get("powerState") else None,
    ]
    return ", ".join(p for p in parts if p)


def token_delivery_line(bmc: dict[str, Any]) -> str:
    """How ``metal.ensureRamdisk`` hands this node's ramdisk its join token, and why."""
    if token_delivery(bmc) == "media":
        return "media: on a virtual CD only the BMC fetches, never on the boot network (tokenDelivery media)"
    why = (
        "IPMI has no virtual media" if bmc.get("driver") == "ipmi" else "--bmc-token-delivery media to change"
    )
    return f"network: on the kernel line, held until the boot entry closes clean ({why})"


def show_lines(node: NodeView) -> list[str]:
    """``bcx nodes show`` as text: state, power, inventory, host section, current workflow."""
    lines = [
        f"node        {node.id}",
        f"name        {node.name or '-'}",
        f"state       {node.state}",
        f"site        {node.site_id}  (tenant {node.tenant_id})",
        f"labels      {','.join(f'{k}={v}' for k, v in node.labels.items()) or '-'}",
        f"macs        {', '.join(node.macs) or '-'}",
        f"power       {node.power_state or 'unknown'}",
        f"image       {node.image or '-'}",
        f"generation  {node.generation} (observed {node.observed_generation})",
    ]
    bmc = node.bmc
    if bmc:
        system = f" {bmc['systemId']}" if bmc.get("systemId") else ""
        lines.append(f"bmc         {bmc['driver']} {bmc['address']}{system}")
        lines.append(f"boot token  {token_delivery_line(bmc)}")
    else:
        lines.append("bmc         -")
    seen = bmc_view(node.bmc_inventory)
    if seen:
        lines.append(f"bmc says    {seen}")
    reason = node.state_reason
    if isinstance(reason, dict):
        lines.append(
            f"failed      workflow {reason.get('workflowId')} ({reason.get('verb')}) at step "
            f"{reason.get('step')}: {reason.get('code')}: {reason.get('message')}"
        )
        if reason.get("left"):
            lines.append(f"left        {reason['left']}")
    held = node.maintenance
    if held:
        lines.append(
            f"maintenance {held.get('reason') or '-'} (set by {held.get('by') or '-'} at {held.get('at')});"
            " no verb or workflow runs until bcx nodes maintenance off"
        )
    quarantine = node.quarantine
    if quarantine:
        lines.append(
            f"quarantine  {quarantine.get('reason')}: {quarantine.get('message')}"
            f" (token {quarantine.get('joinTokenId')}, mac {quarantine.get('mac') or '-'});"
            " inspect or retire it once you looked"
        )
    if node.enrolled_by_rule:
        lines.append(f"enrolled    by rule {node.enrolled_by_rule}")
    conflict = node.discovery_conflict
    if conflict:
        claims = conflict.get("claims") or {}
        macs = ", ".join(claims.get("macs") or []) or "-"
        lines.append(
            f"conflict    a discovery showed this hardware with macs {macs}"
            f" serial {claims.get('serial') or '-'} (cert {conflict.get('certId')}): nothing changed"
        )
    hw = node.hardware
    if hw:
        lines.append(f"hardware    uuid {hw.get('productUuid') or '-'}  serial {hw.get('serial') or '-'}")
    inv = node.inventory_summary
    if inv:
        lines.append(
            f"inventory   {inv.cpu_model or '?'} ({inv.cores or '?'} cores), "
            f"{_size(inv.memory_bytes)}, {inv.disks or 0} disks, {inv.nics or 0} NICs, {inv.gpus or 0} GPUs"
        )
    section = node.host_section if isinstance(node.host_section, dict) else {}
    units = section.get("units") or []
    lines.append(f"host        {', '.join(u['name'] for u in units) if units else '-'}")
    wf = node.current_workflow
    if wf:
        lines.append(f"workflow    {wf.id} {wf.state} ({wf.profile_id})")
        if wf.step:
            lines.append(f"  step      {wf.step.index} {wf.step.action}")
        waits = wf.waiting_for if isinstance(wf.waiting_for, dict) else {}
        if waits.get("reason") == "batch-approval":
            count = f"{waits['approvals']} of {waits['threshold']}"
            lines.append(f"  waits for approvals of batch {waits['batchId']}: {count}")
        elif wf.waiting_for:
            lines.append(f"  waits for {json.dumps(wf.waiting_for, separators=(',', ':'))}")
        if wf.batch_id:
            lines.append(f"  batch     {wf.batch_id} (destructive commands need its approvals)")
    return lines


async def nodes_show(args: argparse.Namespace, settings: Settings) -> int:
    async with engine_client(settings) as engine:
        node = await engine.get_node(id=args.id)
        why = await why_line(engine, node.id)
    if args.json:
        print_json({**as_rows([node])[0], "why": why} if why is not None else node)
    else:
        print("\n".join(show_lines(node)))
        if why is not None:
            print(f"why         {why.answer}")
    return 0


def _verb_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options every verb takes: the nodes' tenant, another profile, deploy's image."""
    return {"tenant_id": args.tenant, "profile": args.profile, "image": getattr(args, "image", None)}


async def run_verb(args: argparse.Namespace, settings: Settings) -> int:
    """One node's verb; with ``--watch`` its live progress, with ``--wait`` only its end (both
    then a summary, exit 1 when it failed or the ``--timeout`` passed)."""
    async with engine_client(settings) as engine:
        if args.plan:
            return await verb_plan(engine, args)
        t0 = time.time()
        got = await engine.run_verb(cast(VerbName, args.verb), node_id=args.node, **_verb_options(args))
        if args.json:
            print(json_line(got), flush=True)
        else:
            profile = f"{got.profile.id}@{got.profile.version}"
            named = f" ({got.name})" if isinstance(got.name, str) else ""
            print(f"{got.node_id}{named} {got.state}: workflow {got.workflow_id} ({profile})")
            if got.batch_id:
                print(f"  destructive commands wait for the approvals of batch {got.batch_id}")
            sys.stdout.flush()
        if not (args.watch or args.wait):
            return 0
        node = await engine.get_node(id=got.node_id)
        return await watch_nodes(
            engine, [node], verb=args.verb, as_json=args.json, started=t0, timeout=args.timeout,
            title=f"{args.verb} · {got.node_id}", live=args.watch,
        )  # fmt: skip


async def run_bulk(args: argparse.Namespace, settings: Settings) -> int:
    if (args.selector is None) == (not args.node):
        raise BcError(ErrorCode.INVALID_INPUT, "give --selector or --node (not both)", {"path": "selector"})
    selector = parse_selector(args.selector) if args.selector is not None else None
    node_ids = list(args.node) if args.selector is None else None
    async with engine_client(settings) as engine:
        if args.plan:
            return await bulk_plan(engine, args, node_ids=node_ids, selector=selector)
        t0 = time.time()
        got = await engine.bulk(
            cast(VerbName, args.verb), node_ids=node_ids, selector=selector, **_verb_options(args)
        )
        if args.watch:
            return await _bulk_watch(engine, got, args, t0)
    if args.json:
        print_json(got)
        return 0
    _print_bulk(got)
    return 0


async def _bulk_watch(engine: EngineClient, got: BulkRun, args: argparse.Namespace, t0: float) -> int:
    """``bulk --watch``: what started (and the batch), then the live view of those nodes."""
    if args.json:
        print(json_line(got), flush=True)
    else:
        _print_bulk(got)
        sys.stdout.flush()
    if not got.started:
        return 1
    nodes = [await engine.get_node(id=s.node_id) for s in got.started]
    return await watch_nodes(
        engine, nodes, verb=args.verb, as_json=args.json, started=t0, timeout=args.timeout,
        title=f"{args.verb} · {len(nodes)} nodes",
    )  # fmt: skip


def _print_bulk(got: BulkRun) -> None:
    rows = [
        {
            "node": s.node_id,
            "name": named(s.name),
            "outcome": s.state,
            "detail": s.workflow_id,
        }
        for s in got.started
    ]
    rows += [
        {
            "node": r.node_id,
            "name": named(r.name),
            "outcome": "refused",
            "detail": r.message,
        }
        for r in got.refused
    ]
    print_table(
        rows, [("node", "NODE"), ("name", "NAME"), ("outcome", "OUTCOME"), ("detail", "WORKFLOW / REASON")]
    )
    print(f"{len(got.started)} started, {len(got.refused)} refused")
    if got.batch_id:
        print(f"one batch for all of them: {got.batch_id} (bcx batches approve {got.batch_id})")


def register(sub: Any, common: argparse.ArgumentParser, nodes: Any) -> None:
    """``nodes enroll|show`` under ``bcx nodes``; the verbs and ``bulk`` at the top."""
    p = nodes.add_parser("enroll", parents=[common], help="enroll a machine: its MACs, BMC and credential")
    p.add_argument("node", nargs="?", help="a discovered node's id (node_…) to enroll")
    p.add_argument("--site", help="site id (a new node; a discovered one keeps its own)")
    p.add_argument("--id", help="node id (node_…); new one by default")
    p.add_argument("--name", help="a name unique in the site (lab1-m001); bcx takes it for the id")
    add_tenant_flag(p)
    p.add_argument("--mac", action="append", help="MAC address, repeatable")
    p.add_argument("--label", action="append", help="key=value, repeatable")
    p.add_argument("--bmc", help="redfish://host[:port]/redfish/v1/Systems/1, ipmi://host, sim://name")
    add_bmc_credential_flags(p)
    p.add_argument(
        "--no-validate", action="store_true", help="do not check the BMC after enrolling (bcx nodes validate)"
    )
    p.set_defaults(func=nodes_enroll)
    p = nodes.add_parser(
        "validate", parents=[common], help="check the node's BMC now: reach, credentials, system, power"
    )
    p.add_argument("id", type=node_ref, help=NODE_HELP)
    p.set_defaults(func=nodes_validate)
    p = nodes.add_parser("show", parents=[common], help="state, power, inventory, host section, workflow")
    p.add_argument("id", type=node_ref, help=NODE_HELP)
    p.set_defaults(func=nodes_show)

    helps = {
        "inspect": "boot the node and record its inventory",
        "commission": "inspect and wipe: the node becomes ready",
        "deploy": "install an image on a ready node",
        "release": "wipe a deployed node: it becomes ready again",
        "retire": "erase the node for good",
        "adopt": "take over a machine that already runs: it becomes deployed",
    }
    for verb in VERBS:
        p = sub.add_parser(verb, parents=[common], help=helps[verb])
        p.add_argument("node", type=node_ref, help=NODE_HELP)
        _verb_flags(p, verb)
        until = p.add_mutually_exclusive_group()
        until.add_argument(
            "--watch", action="store_true", help="live progress until the node rests, then a summary"
        )
        until.add_argument("--wait", action="store_true", help="wait until the node rests, then a summary")
        p.add_argument(
            "--timeout", type=float, help="with --watch or --wait: give up after this many seconds"
        )
        p.add_argument(
            "--plan",
            action="store_true",
            help="show what it would do (steps, commands, approvals, or why it would refuse); change nothing",
        )
        p.set_defaults(func=run_verb, verb=verb)
    p = sub.add_parser("bulk", parents=[common], help="one verb over many nodes, under one batch")
    p.add_argument("verb", choices=list(VERBS), help="the lifecycle verb to run on every node")
    p.add_argument("--selector", help="site=lab1,rack=r12: site and labels that must all match")
    p.add_argument(
        "--node", action="append", type=node_ref, help="node id or name, repeatable (instead of --selector)"
    )
    _verb_flags(p, "deploy")
    p.add_argument("--watch", action="store_true", help="live progress until each node rests, then a summary")
    p.add_argument("--timeout", type=float, help="with --watch: give up after this many seconds (exit 1)")
    p.add_argument(
        "--plan",
        action="store_true",
        help="show what it would do (steps, commands, approvals, refusals); change nothing",
    )
    p.set_defaults(func=run_bulk)
    rollout.register(nodes, common)
    node_actions.register(nodes, common)


def _verb_flags(p: argparse.ArgumentParser, verb: str) -> None:
    p.add_argument("--tenant", help="the nodes' tenant (refuses others)")
    p.add_argument("--profile", help="this profile instead of the verb's")
    if verb == "deploy":
        p.add_argument("--image", help="name@version from the image catalog")
