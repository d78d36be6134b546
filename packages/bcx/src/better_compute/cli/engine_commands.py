"""``bcx nodes``, ``bcx profiles``, ``bcx steps`` and ``bcx plugins``: the engine's API through
``EngineClient`` (``bcx workflows`` is ``workflow_commands``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..clients import EngineClient
from ..config import Settings
from ..core.errors import BcError, ErrorCode
from ..metal.lifecycle import NODE_STATES, SELECTOR_SITE, parse_selector
from ..wire.engine import NODE_EVENTS, NodeChanged, NodeRemoved, NodeView, PluginInfo, decode_node_event
from .common import (
    add_tenant_flag,
    api_client,
    as_rows,
    engine_client,
    parse_labels,
    read_document,
    short,
    stop_if_interrupted,
)
from .metal_commands import add_bmc_credential_flags, check_lines, update_bmc, validate_node
from .node_refs import NODE_HELP, node_ref
from .output import json_line, print_json, print_table
from .paging import add_paging, collect_pages, show_page

__all__ = ["register"]


def _label_text(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


# -- nodes ----------------------------------------------------------------------


async def nodes_create(args: argparse.Namespace, settings: Settings) -> int:
    async with engine_client(settings) as engine:
        node = await engine.create_node(
            site_id=args.site, id=args.id, tenant_id=args.tenant, labels=parse_labels(args.label),
            name=args.name,
        )  # fmt: skip
    if args.json:
        print_json(node)
    else:
        print(node.id)
    return 0


async def nodes_list(args: argparse.Namespace, settings: Settings) -> int:
    """Nodes by id, filtered on the server (site, state, labels); ``-o wide`` adds MACs, BMC,
    image and workflow."""
    selector = parse_selector(args.selector) if args.selector else {}
    site = selector.pop(SELECTOR_SITE, None)
    if args.site and site and args.site != site:
        raise BcError(ErrorCode.INVALID_INPUT, "--site and the selector's site= differ", {"path": "selector"})
    if args.timeout is not None and not args.watch:
        raise BcError(ErrorCode.INVALID_INPUT, "--timeout goes with --watch", {"path": "timeout"})
    columns = NODE_COLUMNS + (WIDE_COLUMNS if getattr(args, "wide", False) else [])
    filters = {"site_id": args.site or site, "state": args.state, "labels": selector or None}
    async with engine_client(settings) as engine:
        if args.watch:
            return await _watch_list(engine, args, filters, columns)
        nodes, next_ = await collect_pages(engine.list_nodes, "nodes", args, **filters)
    return show_page(
        args, next_, key="nodes", found=nodes, rows=_node_rows(nodes), columns=columns, empty="no nodes",
    )  # fmt: skip


def _matches(node: NodeView, filters: dict[str, Any]) -> bool:
    """Whether ``node`` passes the list's filters (as the server applies them)."""
    labels = filters["labels"] or {}
    return (
        filters["site_id"] in (None, node.site_id)
        and filters["state"] in (None, node.state)
        and all(node.labels.get(k) == v for k, v in labels.items())
    )


def _line(row: dict[str, Any], columns: list[tuple[str, str]], widths: list[int]) -> str:
    cells = ["-" if row.get(key) is None else str(row.get(key)) for key, _ in columns]
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()


async def _watch_list(
    engine: EngineClient, args: argparse.Namespace, filters: dict[str, Any], columns: list[tuple[str, str]]
) -> int:
    """``nodes list -w``: the matching nodes, then one more row each time one of them changes (as
    ``kubectl get -w``): a node that stops matching is shown once more as it left, a deleted one
    as ``deleted``. ``--json``: one JSON object per row. Until interrupted or ``--timeout``."""
    import asyncio  # here: bcx nodes --help does not load it
    import time

    changed: asyncio.Queue[tuple[str, bool]] = asyncio.Queue()
    wanted_state = filters["state"]
    shown: dict[str, str] = {}

    async def on_node(msg: Any) -> None:
        match decode_node_event(msg.data):
            case NodeChanged(node_id=node_id, state=state):
                if wanted_state is None or state == wanted_state or node_id in shown:
                    changed.put_nowait((node_id, False))  # others cannot match: no read for them
            case NodeRemoved(node_id=node_id):
                changed.put_nowait((node_id, True))
            case _:
                pass

    api = engine.api
    sub = await api.nc.subscribe(api.subjects.events_all(NODE_EVENTS), cb=on_node)  # before the read
    try:
        nodes, _ = await collect_pages(engine.list_nodes, "nodes", args, **filters)
        rows = _node_rows(nodes)
        headers = [h for _, h in columns]
        # room for what a row may grow to (a state with "(maintenance)", a longer label)
        widths = [max([len(h) + 4, *(len(str(r.get(k, "-"))) for r in rows)]) for k, h in columns]

        def emit(node_id: str, row: dict[str, Any], doc: Any) -> None:
            line = json_line(doc) if args.json else _line(row, columns, widths)
            if shown.get(node_id) != line:
                print(line, flush=True)
            shown[node_id] = line

        if not args.json:
            print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip(), flush=True)
        for node, row in zip(nodes, rows, strict=True):
            emit(node.id, row, node)
        deadline = None if args.timeout is None else time.monotonic() + args.timeout
        while True:
            stop_if_interrupted()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return 0
            try:
                async with asyncio.timeout(left):  # not wait_for: it can swallow a Ctrl-C (3.11)
                    node_id, removed = await changed.get()
            except TimeoutError:
                return 0
            if removed:
                if node_id in shown:
                    gone = {"id": node_id, "state": "deleted"}
                    emit(node_id, gone, {"id": node_id, "deleted": True})
                    shown.pop(node_id, None)
                continue
            try:
                node = await engine.get_node(id=node_id)
            except BcError:
                continue  # deleted since: its own event follows
            if _matches(node, filters) or node_id in shown:
                emit(node_id, _node_rows([node])[0], node)
                if not _matches(node, filters):
                    shown.pop(node_id, None)  # shown as it left; it comes back when it matches again
    finally:
        await sub.unsubscribe()


NODE_COLUMNS = [
    ("id", "NODE"), ("nameText", "NAME"), ("siteId", "SITE"), ("state", "STATE"), ("power", "POWER"),
    ("tenantId", "TENANT"), ("labels", "LABELS"),
]  # fmt: skip


WIDE_COLUMNS = [("macs", "MACS"), ("bmcText", "BMC"), ("image", "IMAGE"), ("workflowId", "WORKFLOW")]


def _node_rows(nodes: list[NodeView]) -> list[dict[str, Any]]:
    return [
        {
            **row, "labels": _label_text(n.labels), "power": n.power_state or "unknown",
            "nameText": n.name or "-",
            "macs": ",".join(n.macs) or "-",
            "bmcText": f"{n.bmc['driver']} {n.bmc['address']}" if n.bmc else "-",
            "image": n.image or "-", "workflowId": n.workflow_id or "-",
            **({"state": f"{n.state} (maintenance)"} if n.maintenance else {}),
        }
        for n, row in zip(nodes, as_rows(nodes), strict=True)
    ]  # fmt: skip


async def nodes_get(args: argparse.Namespace, settings: Settings) -> int:
    """One node: a table row as ``nodes list`` shows it (``--json``/``-o yaml``: the whole
    document; ``nodes show`` describes it)."""
    async with engine_client(settings) as engine:
        node = await engine.get_node(id=args.id)
    if args.json:
        print_json(node)
    else:
        print_table(_node_rows([node]), NODE_COLUMNS)
    return 0


def _print_node(node: NodeView, *, as_json: bool) -> None:
    if as_json:
        print_json(node)
        return
    named = f"  name {node.name}" if node.name else ""
    print(f"{node.id}{named}  site {node.site_id}  labels {_label_text(node.labels) or '-'}")


async def nodes_update(args: argparse.Namespace, settings: Settings) -> int:
    """A node's site, labels or BMC (``--bmc URL``, or a new credential for its BMC)."""
    labels = parse_labels(args.label) if args.label is not None or args.no_labels else None
    bmc_given = any(
        (args.bmc, args.bmc_credentials_file, args.bmc_user, args.bmc_insecure, args.bmc_token_delivery)
    )  # fmt: skip
    if args.name is not None and args.no_name:
        raise BcError(ErrorCode.INVALID_INPUT, "give --name or --no-name, not both", {"path": "name"})
    if args.site is None and labels is None and not bmc_given and args.name is None and not args.no_name:
        raise BcError(
            ErrorCode.INVALID_INPUT,
            "give --site, --name, --no-name, --label, --no-labels, --bmc or --bmc-credentials-file",
            {"path": "site"},
        )
    checks = None
    async with api_client(settings) as api:
        engine = EngineClient(api)
        bmc = None
        if bmc_given:
            bmc = await update_bmc(api, args, await engine.get_node(id=args.id))
        node = await engine.update_node(
            id=args.id, site_id=args.site, labels=labels, bmc=bmc, name=args.name, clear_name=args.no_name
        )
        if bmc is not None and node.bmc and not args.no_validate:
            checks = await validate_node(api, node)  # the new BMC or credential, checked at once
    failed = [c for c in checks or [] if c.get("status") == "failed"]
    if args.json:
        doc = as_rows([node])[0]
        if checks is not None:
            doc["validation"] = {"ok": not failed, "checks": checks}
        print_json(doc)
        return 1 if failed else 0
    _print_node(node, as_json=False)
    if bmc is not None and node.bmc:
        ref = node.bmc.get("credentialsRef") or "no credential"
        print(f"  bmc {node.bmc['driver']} {node.bmc['address']} ({ref})")
    for line in check_lines(checks or []):
        print(f"  {line}")
    if failed:
        print(
            f"the BMC is changed, but failed validation: fix it with bcx nodes update {node.id}"
            " --bmc … --bmc-credentials-file …",
            file=sys.stderr,
        )
        return 1
    return 0


async def nodes_label(args: argparse.Namespace, settings: Settings) -> int:
    """``key=value`` sets a label, ``key-`` removes it (as kubectl label does)."""
    remove = [c[:-1] for c in args.change if c.endswith("-") and "=" not in c]
    sets = parse_labels([c for c in args.change if not (c.endswith("-") and "=" not in c)])
    async with engine_client(settings) as engine:
        node = await engine.label_node(id=args.id, set=sets, remove=remove)
    _print_node(node, as_json=args.json)
    return 0


async def nodes_maintenance(args: argparse.Namespace, settings: Settings) -> int:
    """``on``: the node runs no lifecycle verb and no workflow until ``off``."""
    async with engine_client(settings) as engine:
        node = await engine.set_maintenance(id=args.id, on=args.mode == "on", reason=args.reason)
    if args.json:
        print_json(node)
    elif node.maintenance:
        held = node.maintenance
        print(f"{node.id} in maintenance: {held.get('reason') or '-'} (set by {held.get('by') or '-'})")
    else:
        print(f"{node.id} out of maintenance")
    return 0


async def nodes_delete(args: argparse.Namespace, settings: Settings) -> int:
    async with engine_client(settings) as engine:
        got = await engine.delete_node(id=args.id)
    if args.json:
        print_json(got)
    else:
        print(f"deleted {got.deleted}")
    return 0


# -- steps --------------------------------------------------------------------------


def _inputs(schema: dict[str, Any]) -> str:
    """``action*: on|off, bmc`` — the input's fields, required ones starred, enums spelled out."""
    required = set(schema.get("required", []))
    parts = []
    for name, prop in (schema.get("properties") or {}).items():
        text = name + ("*" if name in required else "")
        if isinstance(prop, dict) and "enum" in prop:
            text += ": " + "|".join(str(v) for v in prop["enum"])
        parts.append(text)
    return ", ".join(parts) or "-"


async def steps_list(args: argparse.Namespace, settings: Settings) -> int:
    async with engine_client(settings) as engine:
        got = await engine.list_steps()
    if args.json:
        print_json(got)
        return 0
    rows = [
        {
            "use": s.id,
            "on": "/".join([s.runs_on, *s.relays]),
            "from": s.plugin or "provision",
            "with": _inputs(s.input),
        }
        for s in got.steps
        if args.plugin is None or s.plugin == args.plugin
    ]
    if args.plugin is None:
        rows += [
            {"use": o.name, "on": "site (driver)", "from": "-", "with": _inputs(o.input)}
            for o in got.driver_operations
        ]
    print_table(
        rows,
        [("use", "USE"), ("on", "ON"), ("from", "FROM"), ("with", "WITH (* required)")],
        empty="no steps"
        if args.plugin is None
        else f"no steps of {args.plugin} in the running engine: a plugin installed since its start loads"
        " at its next (bcx dev up --restart, or restart bc-engine); bcx plugins list shows what runs",
    )
    return 0


# -- plugins --------------------------------------------------------------------------


def _names(items: list[str]) -> str:
    return ", ".join(items) or "-"


def _origin(plugin: PluginInfo) -> str:
    """``acme-plugin 0.1.0 (entry point acme)``, or ``app`` for one the app lists."""
    if plugin.source != "entry-point":
        return "app"
    package = " ".join(x for x in (plugin.distribution, plugin.version) if x) or "?"
    return f"{package} (entry point {plugin.entry_point})"


async def plugins_list(args: argparse.Namespace, settings: Settings) -> int:
    """The plugins the engine that answers runs (installed packages it loaded, and the app's)."""
    async with engine_client(settings) as engine:
        got = await engine.list_plugins()
    if args.json:
        print_json(got)
        return 0
    rows = [
        {
            "id": p.id,
            "from": _origin(p),
            "steps": _names(p.steps) + ("" if p.lent or not p.steps else " (not lent to provision)"),
            "profiles": _names([f"{q.id}@{q.version}" for q in p.profiles]),
            "units": _names(p.config_units),
            "signers": _names(p.image_signers),
        }
        for p in got.plugins
    ]
    print_table(
        rows,
        [("id", "PLUGIN"), ("from", "FROM"), ("steps", "STEPS"), ("profiles", "PROFILES"),
         ("units", "UNITS"), ("signers", "SIGNERS")],
        empty="no plugins (install one: pip install <package>, then restart the services; docs/plugins.md)",
    )  # fmt: skip
    return 0


# -- profiles ---------------------------------------------------------------------


async def profiles_create(args: argparse.Namespace, settings: Settings) -> int:
    document = read_document(args.file)
    async with engine_client(settings) as engine:
        got = await engine.create_profile(
            tenant_id=args.tenant, document=document, public=args.public, replace=args.replace
        )
    if args.json:
        print_json(got)
    else:
        print(f"stored {got.id} version {got.version} for tenant {got.tenant_id}")
    return 0


async def profiles_get(args: argparse.Namespace, settings: Settings) -> int:
    async with engine_client(settings) as engine:
        got = await engine.get_profile(tenant_id=args.tenant, id=args.id, version=args.version)
    print_json(got)
    return 0


async def profiles_list(args: argparse.Namespace, settings: Settings) -> int:
    async with engine_client(settings) as engine:
        profiles, next_ = await collect_pages(engine.list_profiles, "profiles", args, tenant_id=args.tenant)
    return show_page(
        args, next_, key="profiles", found=profiles, rows=as_rows(profiles),
        columns=[("id", "PROFILE"), ("version", "VERSION"), ("tenantId", "FROM"), ("target", "TARGET"),
                 ("steps", "STEPS"), ("public", "PUBLIC"), ("immutable", "IMMUTABLE")],
        empty="no profiles",
    )  # fmt: skip


async def profiles_delete(args: argparse.Namespace, settings: Settings) -> int:
    async with engine_client(settings) as engine:
        await engine.delete_profile(tenant_id=args.tenant, id=args.id, version=args.version)
    if args.json:
        print_json({"deleted": True})
    else:
        print(f"deleted {args.id} version {args.version}")
    return 0


def _ref(args: argparse.Namespace) -> dict[str, Any]:
    """The profile a command names: a file, or ``--id`` (and ``--version``)."""
    if args.file:
        return {"tenant_id": args.tenant, "document": read_document(args.file)}
    if args.id:
        return {"tenant_id": args.tenant, "id": args.id, "version": args.version}
    raise BcError(ErrorCode.INVALID_INPUT, "give a profile file or --id", {"path": "file"})


async def profiles_validate(args: argparse.Namespace, settings: Settings) -> int:
    async with engine_client(settings) as engine:
        got = await engine.validate_profile(**_ref(args))
    if args.json:
        print_json(got)
    elif got.valid:
        kinds = got.command_kinds or []
        print("valid; " + (f"sends {', '.join(kinds)}" if kinds else "sends no commands"))
    else:
        print_table(as_rows(got.problems), [("path", "PATH"), ("code", "CODE"), ("message", "PROBLEM")])
    return 0 if got.valid else 1


async def profiles_render(args: argparse.Namespace, settings: Settings) -> int:
    async with engine_client(settings) as engine:
        got = await engine.render_profile(**_ref(args))
    if args.json:
        print_json(got)
        return 0
    rows = [
        {**row, "with": short(s.input), "timeout": f"{s.timeout_ms // 1000}s"}
        for s, row in zip(got.steps, as_rows(got.steps), strict=True)
    ]
    print_table(
        rows,
        [("index", "#"), ("action", "ACTION"), ("runsOn", "ON"), ("mode", "MODE"), ("command", "COMMAND"),
         ("timeout", "TIMEOUT"), ("via", "VIA"), ("with", "WITH")],
    )  # fmt: skip
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> Any:
    """The engine's command groups; returns ``bcx nodes``'s subcommands (metal adds to them)."""
    tenant = argparse.ArgumentParser(add_help=False)
    add_tenant_flag(tenant)

    nodes = sub.add_parser("nodes", help="nodes the engine knows").add_subparsers(
        dest="nodes_command", required=True, metavar="COMMAND"
    )
    p = nodes.add_parser("create", parents=[common, tenant], help="register a node")
    p.add_argument("--site", required=True, help="site id")
    p.add_argument("--id", help="node id (node_…); new one by default")
    p.add_argument("--name", help="a name unique in the site (lab1-m001); bcx takes it for the id")
    p.add_argument("--label", action="append", help="key=value, repeatable")
    p.set_defaults(func=nodes_create)
    p = nodes.add_parser("list", parents=[common], help="list nodes")
    p.add_argument("--site", help="only nodes of this site")
    p.add_argument("--state", choices=NODE_STATES, help="only nodes in this lifecycle state")
    p.add_argument("-l", "--selector", help="site=lab1,rack=r12: the site and labels that must all match")
    p.add_argument(
        "-w", "--watch", action="store_true", help="after the list, a row each time a listed node changes"
    )
    p.add_argument("--timeout", type=float, help="with --watch: stop after this many seconds")
    add_paging(p, default_limit=100)
    p.set_defaults(func=nodes_list)
    p = nodes.add_parser("get", parents=[common], help="one node")
    p.add_argument("id", type=node_ref, help=NODE_HELP)
    p.set_defaults(func=nodes_get)
    p = nodes.add_parser(
        "update", parents=[common], help="change a node's name, site, labels or BMC (the BMC is checked)"
    )
    p.add_argument("id", type=node_ref, help=NODE_HELP)
    p.add_argument("--site", help="new site id (not while a workflow runs on the node)")
    p.add_argument("--label", action="append", help="key=value, repeatable: replaces every label")
    p.add_argument("--no-labels", action="store_true", help="remove every label")
    p.add_argument("--name", help="a new name, unique in the site (lab1-m001)")
    p.add_argument("--no-name", action="store_true", help="take the node's name away")
    p.add_argument(
        "--bmc", help="a new BMC: redfish://host[:port]/redfish/v1/Systems/1, ipmi://host, sim://name"
    )
    add_bmc_credential_flags(p)
    p.add_argument(
        "--no-validate", action="store_true", help="do not check a new BMC or credential (bcx nodes validate)"
    )
    p.set_defaults(func=nodes_update)
    p = nodes.add_parser("label", parents=[common], help="set (key=value) or remove (key-) labels")
    p.add_argument("id", type=node_ref, help=NODE_HELP)
    p.add_argument("change", nargs="+", help="key=value sets, key- removes")
    p.set_defaults(func=nodes_label)
    p = nodes.add_parser(
        "maintenance", parents=[common], help="on: the node runs no lifecycle verb or workflow until off"
    )
    p.add_argument("mode", choices=["on", "off"], help="on or off")
    p.add_argument("id", type=node_ref, help=NODE_HELP)
    p.add_argument("--reason", help="why (shown by nodes show and in the audit)")
    p.set_defaults(func=nodes_maintenance)
    p = nodes.add_parser(
        "delete",
        parents=[common],
        help="forget a node (not while a workflow runs on it); its discovery certificate is revoked",
    )
    p.add_argument("id", type=node_ref, help=NODE_HELP)
    p.set_defaults(func=nodes_delete)

    steps = sub.add_parser("steps", help="registered steps and driver operations").add_subparsers(
        dest="steps_command", required=True, metavar="COMMAND"
    )
    p = steps.add_parser("list", parents=[common], help="what a profile's use can name, with its inputs")
    p.add_argument("--plugin", help="only the steps this plugin or module lends (acme, metal)")
    p.set_defaults(func=steps_list)

    plugins = sub.add_parser("plugins", help="plugins the engine runs").add_subparsers(
        dest="plugins_command", required=True, metavar="COMMAND"
    )
    p = plugins.add_parser(
        "list", parents=[common], help="installed plugins with their steps, profiles, units and signers"
    )
    p.set_defaults(func=plugins_list)

    profiles = sub.add_parser("profiles", help="versioned documents of steps").add_subparsers(
        dest="profiles_command", required=True, metavar="COMMAND"
    )
    p = profiles.add_parser("create", parents=[common, tenant], help="store a profile (JSON, YAML, TOML)")
    p.add_argument("file", help="the profile document (.json, .yaml, .toml; - for stdin)")
    p.add_argument("--public", action="store_true", help="visible to every tenant")
    p.add_argument("--replace", action="store_true", help="replace a version no workflow has used")
    p.set_defaults(func=profiles_create)
    p = profiles.add_parser("get", parents=[common, tenant], help="one profile, as the lookup finds it")
    p.add_argument("id", help="profile id")
    p.add_argument("--version", type=int, help="this version (default: the newest)")
    p.set_defaults(func=profiles_get)
    p = profiles.add_parser("list", parents=[common, tenant], help="profiles a tenant can use")
    add_paging(p, default_limit=100)
    p.set_defaults(func=profiles_list)
    p = profiles.add_parser("delete", parents=[common, tenant], help="delete a version no workflow used")
    p.add_argument("id", help="profile id")
    p.add_argument("--version", type=int, required=True, help="the version to delete")
    p.set_defaults(func=profiles_delete)
    for name, fn, what in (
        ("validate", profiles_validate, "every unresolved use and rejected with, with its path"),
        ("render", profiles_render, "the steps a workflow would persist"),
    ):
        p = profiles.add_parser(name, parents=[common, tenant], help=what)
        p.add_argument("file", nargs="?", help="a profile document (or --id for a stored one)")
        p.add_argument("--id", help="a stored profile instead of a file")
        p.add_argument("--version", type=int, help="with --id: this version (default: the newest)")
        p.set_defaults(func=fn)
    return nodes
