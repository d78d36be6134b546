"""``bcx nodes``, ``bcx profiles``, ``bcx workflows`` and ``bcx steps``: the engine's API."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from typing import Any

from ..config import Settings
from ..core.errors import BcError, ErrorCode
from ..service.client import ApiClient
from .common import api_client, read_document
from .output import iso, json_line, print_json, print_table
from .paging import add_paging, collect, show_page

__all__ = ["register"]

FINISHED = ("succeeded", "failed", "aborted")


def _short(value: Any, width: int = 60) -> str:
    if value is None:
        return "-"
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return text if len(text) <= width else text[: width - 1] + "…"


def _labels(pairs: list[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise BcError(ErrorCode.INVALID_INPUT, f"labels are key=value, got {pair!r}", {"path": "label"})
        out[key] = value
    return out


# -- nodes ----------------------------------------------------------------------


async def nodes_create(args: argparse.Namespace, settings: Settings) -> int:
    async with api_client(settings) as api:
        node = await api.call(
            "engine",
            "nodes.create",
            {"siteId": args.site, "id": args.id, "tenantId": args.tenant, "labels": _labels(args.label)},
        )
    if args.json:
        print_json(node)
    else:
        print(node["id"])
    return 0


async def _pages(
    api: ApiClient, route: str, field: str, request: dict[str, Any], args: argparse.Namespace
) -> tuple[list[Any], str | None]:
    async def fetch(cursor: str | None) -> tuple[list[Any], str | None]:
        got = await api.call("engine", route, {**request, "limit": args.limit, "cursor": cursor})
        return list(got[field]), got.get("next")

    return await collect(fetch, args)


async def nodes_list(args: argparse.Namespace, settings: Settings) -> int:
    async with api_client(settings) as api:
        nodes, next_ = await _pages(api, "nodes.list", "nodes", {"siteId": args.site}, args)
    return show_page(
        args, next_, key="nodes", found=nodes,
        rows=[{**n, "labels": ",".join(f"{k}={v}" for k, v in n["labels"].items())} for n in nodes],
        columns=[("id", "NODE"), ("siteId", "SITE"), ("tenantId", "TENANT"), ("labels", "LABELS")],
        empty="no nodes",
    )  # fmt: skip


async def nodes_get(args: argparse.Namespace, settings: Settings) -> int:
    async with api_client(settings) as api:
        node = await api.call("engine", "nodes.get", {"id": args.id})
    print_json(node)
    return 0


def _print_node(node: dict[str, Any], *, as_json: bool) -> None:
    if as_json:
        print_json(node)
        return
    labels = ",".join(f"{k}={v}" for k, v in node["labels"].items()) or "-"
    print(f"{node['id']}  site {node['siteId']}  labels {labels}")


async def nodes_update(args: argparse.Namespace, settings: Settings) -> int:
    request: dict[str, Any] = {"id": args.id}
    if args.site is not None:
        request["siteId"] = args.site
    if args.label is not None or args.no_labels:
        request["labels"] = _labels(args.label)
    if len(request) == 1:
        raise BcError(ErrorCode.INVALID_INPUT, "give --site, --label or --no-labels", {"path": "site"})
    async with api_client(settings) as api:
        node = await api.call("engine", "nodes.update", request)
    _print_node(node, as_json=args.json)
    return 0


async def nodes_label(args: argparse.Namespace, settings: Settings) -> int:
    """``key=value`` sets a label, ``key-`` removes it (as kubectl label does)."""
    remove = [c[:-1] for c in args.change if c.endswith("-") and "=" not in c]
    sets = _labels([c for c in args.change if not (c.endswith("-") and "=" not in c)])
    async with api_client(settings) as api:
        node = await api.call("engine", "nodes.label", {"id": args.id, "set": sets, "remove": remove})
    _print_node(node, as_json=args.json)
    return 0


async def nodes_delete(args: argparse.Namespace, settings: Settings) -> int:
    async with api_client(settings) as api:
        got = await api.call("engine", "nodes.delete", {"id": args.id})
    if args.json:
        print_json(got)
    else:
        print(f"deleted {got['deleted']}")
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
    async with api_client(settings) as api:
        got = await api.call("engine", "steps.list", {})
    if args.json:
        print_json(got)
        return 0
    rows = [
        {"use": s["id"], "on": "/".join([s["runsOn"], *s["relays"]]), "with": _inputs(s["input"])}
        for s in got["steps"]
    ]
    rows += [
        {"use": o["name"], "on": "site (driver)", "with": _inputs(o["input"])}
        for o in got["driverOperations"]
    ]
    print_table(rows, [("use", "USE"), ("on", "ON"), ("with", "WITH (* required)")], empty="no steps")
    return 0


# -- profiles ---------------------------------------------------------------------


async def profiles_create(args: argparse.Namespace, settings: Settings) -> int:
    document = read_document(args.file)
    async with api_client(settings) as api:
        got = await api.call(
            "engine",
            "profiles.create",
            {"tenantId": args.tenant, "document": document, "public": args.public, "replace": args.replace},
        )
    if args.json:
        print_json(got)
    else:
        print(f"stored {got['id']} version {got['version']} for tenant {got['tenantId']}")
    return 0


async def profiles_get(args: argparse.Namespace, settings: Settings) -> int:
    async with api_client(settings) as api:
        got = await api.call(
            "engine", "profiles.get", {"tenantId": args.tenant, "id": args.id, "version": args.version}
        )
    print_json(got)
    return 0


async def profiles_list(args: argparse.Namespace, settings: Settings) -> int:
    async with api_client(settings) as api:
        profiles, next_ = await _pages(api, "profiles.list", "profiles", {"tenantId": args.tenant}, args)
    return show_page(
        args, next_, key="profiles", found=profiles, rows=profiles,
        columns=[("id", "PROFILE"), ("version", "VERSION"), ("tenantId", "FROM"), ("target", "TARGET"),
                 ("steps", "STEPS"), ("public", "PUBLIC"), ("immutable", "IMMUTABLE")],
        empty="no profiles",
    )  # fmt: skip


async def profiles_delete(args: argparse.Namespace, settings: Settings) -> int:
    async with api_client(settings) as api:
        await api.call(
            "engine", "profiles.delete", {"tenantId": args.tenant, "id": args.id, "version": args.version}
        )
    if args.json:
        print_json({"deleted": True})
    else:
        print(f"deleted {args.id} version {args.version}")
    return 0


def _ref(args: argparse.Namespace) -> dict[str, Any]:
    if args.file:
        return {"tenantId": args.tenant, "document": read_document(args.file)}
    if args.id:
        return {"tenantId": args.tenant, "id": args.id, "version": args.version}
    raise BcError(ErrorCode.INVALID_INPUT, "give a profile file or --id", {"path": "file"})


async def profiles_validate(args: argparse.Namespace, settings: Settings) -> int:
    async with api_client(settings) as api:
        got = await api.call("engine", "profiles.validate", _ref(args))
    if args.json:
        print_json(got)
    elif got["valid"]:
        kinds = got.get("commandKinds") or []
        print("valid; " + (f"sends {', '.join(kinds)}" if kinds else "sends no commands"))
    else:
        print_table(got["problems"], [("path", "PATH"), ("code", "CODE"), ("message", "PROBLEM")])
    return 0 if got["valid"] else 1


async def profiles_render(args: argparse.Namespace, settings: Settings) -> int:
    async with api_client(settings) as api:
        got = await api.call("engine", "profiles.render", _ref(args))
    if args.json:
        print_json(got)
        return 0
    rows = [{**s, "with": _short(s["with"]), "timeout": f"{s['timeoutMs'] // 1000}s"} for s in got["steps"]]
    print_table(
        rows,
        [("index", "#"), ("action", "ACTION"), ("runsOn", "ON"), ("mode", "MODE"), ("command", "COMMAND"),
         ("timeout", "TIMEOUT"), ("via", "VIA"), ("with", "WITH")],
    )  # fmt: skip
    return 0


# -- workflows ----------------------------------------------------------------------


def _print_steps(wf: dict[str, Any]) -> None:
    rows = [
        {
            **s,
            "started": iso(s["startedAt"]),
            "outcome": (
                f"{s['error']['code']}: {s['error']['message']}" if s["error"] else _short(s["result"], 50)
            ),
        }
        for s in wf["steps"]
    ]
    print_table(
        rows,
        [("index", "#"), ("action", "ACTION"), ("state", "STATE"), ("attempt", "ATTEMPT"),
         ("started", "STARTED"), ("outcome", "RESULT / ERROR")],
    )  # fmt: skip


async def workflows_start(args: argparse.Namespace, settings: Settings) -> int:
    async with api_client(settings) as api:
        wf = await api.call(
            "engine",
            "workflows.start",
            {"tenantId": args.tenant, "profileId": args.profile, "profileVersion": args.version,
             "nodeId": args.node, "owner": args.owner},
        )  # fmt: skip
        if args.wait:
            # the id first: a reader (or `| head -1`) has it before the first step ends
            print(json_line(wf) if args.json else wf["id"], flush=True)
            return await _watch(api, settings, wf["id"], as_json=args.json)
    if args.json:
        print_json(wf)
    else:
        print(wf["id"])
    return 0


async def get_workflow(api: ApiClient, workflow_id: str) -> dict[str, Any]:
    """The workflow with every step: its steps' results may take several replies."""
    wf: dict[str, Any] = await api.call("engine", "workflows.get", {"id": workflow_id})
    steps = list(wf["steps"])
    cursor = wf.get("stepsNext")
    while cursor is not None:
        more = await api.call("engine", "workflows.get", {"id": workflow_id, "stepsCursor": cursor})
        steps += more["steps"]
        cursor = more.get("stepsNext")
    return {**wf, "steps": steps, "stepsNext": None}


async def workflows_get(args: argparse.Namespace, settings: Settings) -> int:
    async with api_client(settings) as api:
        wf = await get_workflow(api, args.id)
    if args.json:
        print_json(wf)
        return 0
    p = wf["profile"]
    where = f"profile {p['id']}@{p['version']} ({p['tenantId']})  node {wf['nodeId'] or '-'}"
    print(f"{wf['id']}  {wf['state']}  {where}")
    if wf["error"]:
        print(f"error: {wf['error']['code']}: {wf['error']['message']}")
    _print_steps(wf)
    return 0


async def workflows_list(args: argparse.Namespace, settings: Settings) -> int:
    async with api_client(settings) as api:
        filters = {"nodeId": args.node, "state": args.state, "profileId": args.profile}
        workflows, next_ = await _pages(api, "workflows.list", "workflows", filters, args)
    rows = [
        {
            **w,
            "profileRef": f"{w['profile']['id']}@{w['profile']['version']}",
            "created": iso(w["createdAt"]),
        }
        for w in workflows
    ]
    return show_page(
        args, next_, key="workflows", found=workflows, rows=rows,
        columns=[("id", "WORKFLOW"), ("state", "STATE"), ("profileRef", "PROFILE"),
                 ("nodeId", "NODE"), ("created", "CREATED")],
        empty="no workflows",
    )  # fmt: skip


async def _verb(args: argparse.Namespace, settings: Settings, verb: str) -> int:
    async with api_client(settings) as api:
        wf = await api.call(
            "engine", f"workflows.{verb}", {"id": args.id, "reason": getattr(args, "reason", None)}
        )
        if getattr(args, "wait", False):
            print(json_line(wf) if args.json else f"{wf['id']} is {wf['state']}", flush=True)
            return await _watch(api, settings, wf["id"], as_json=args.json)
    if args.json:
        print_json(wf)
    else:
        print(f"{wf['id']} is {wf['state']}")
    return 0


async def workflows_abort(args: argparse.Namespace, settings: Settings) -> int:
    return await _verb(args, settings, "abort")


async def workflows_retry(args: argparse.Namespace, settings: Settings) -> int:
    return await _verb(args, settings, "retry")


async def workflows_resume(args: argparse.Namespace, settings: Settings) -> int:
    return await _verb(args, settings, "resume")


async def workflows_watch(args: argparse.Namespace, settings: Settings) -> int:
    async with api_client(settings) as api:
        return await _watch(api, settings, args.id, as_json=args.json)


async def _watch(api: ApiClient, settings: Settings, workflow_id: str, *, as_json: bool) -> int:
    """Print each step change as it happens; exit 0 when the workflow succeeds, 1 otherwise."""
    changed = asyncio.Event()

    async def on_event(_msg: Any) -> None:
        changed.set()

    sub = await api.nc.subscribe(api.subjects.event("workflow", workflow_id), cb=on_event)
    seen: dict[int, tuple[str, int]] = {}
    state = ""
    try:
        while True:
            changed.clear()
            wf = await get_workflow(api, workflow_id)
            for s in wf["steps"]:
                now = (s["state"], s["attempt"])
                if seen.get(s["index"]) == now or s["state"] == "pending":
                    continue
                seen[s["index"]] = now
                if as_json:
                    print(json_line({"workflowId": workflow_id, "workflowState": wf["state"], "step": s}))
                else:
                    tail = ""
                    if s["error"]:
                        tail = f"  {s['error']['code']}: {s['error']['message']}"
                    elif s["state"] == "succeeded":
                        tail = f"  {_short(s['result'], 50)}"
                    at = iso(s["finishedAt"] or s["startedAt"]) or "-"
                    print(
                        f"{at}  step {s['index']:>3} {s['action']:<28}"
                        f" {s['state']:<10} attempt {s['attempt']}{tail}",
                        flush=True,
                    )
            if wf["state"] != state:
                state = wf["state"]
                if as_json:
                    print(json_line({"workflowId": workflow_id, "workflowState": state}), flush=True)
                elif state in FINISHED:
                    err = wf["error"]
                    print(
                        f"workflow {workflow_id} {state}"
                        + (f": {err['code']}: {err['message']}" if err else "")
                    )
            sys.stdout.flush()
            if state in FINISHED:
                return 0 if state == "succeeded" else 1
            # events wake us at once; the timeout is the safety net for a lost event
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), timeout=2.0)
    finally:
        await sub.unsubscribe()


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    tenant = argparse.ArgumentParser(add_help=False)
    tenant.add_argument("--tenant", default="root", help="tenant (default root)")

    nodes = sub.add_parser("nodes", help="nodes the engine knows").add_subparsers(
        dest="nodes_command", required=True, metavar="COMMAND"
    )
    p = nodes.add_parser("create", parents=[common, tenant], help="register a node")
    p.add_argument("--site", required=True, help="site id")
    p.add_argument("--id", help="node id (node_…); new one by default")
    p.add_argument("--label", action="append", help="key=value, repeatable")
    p.set_defaults(func=nodes_create)
    p = nodes.add_parser("list", parents=[common], help="list nodes")
    p.add_argument("--site")
    add_paging(p, default_limit=100)
    p.set_defaults(func=nodes_list)
    p = nodes.add_parser("get", parents=[common], help="one node")
    p.add_argument("id")
    p.set_defaults(func=nodes_get)
    p = nodes.add_parser("update", parents=[common], help="change a node's site or replace its labels")
    p.add_argument("id")
    p.add_argument("--site", help="new site id (not while a workflow runs on the node)")
    p.add_argument("--label", action="append", help="key=value, repeatable: replaces every label")
    p.add_argument("--no-labels", action="store_true", help="remove every label")
    p.set_defaults(func=nodes_update)
    p = nodes.add_parser("label", parents=[common], help="set (key=value) or remove (key-) labels")
    p.add_argument("id")
    p.add_argument("change", nargs="+", help="key=value sets, key- removes")
    p.set_defaults(func=nodes_label)
    p = nodes.add_parser("delete", parents=[common], help="forget a node (not while a workflow runs on it)")
    p.add_argument("id")
    p.set_defaults(func=nodes_delete)

    steps = sub.add_parser("steps", help="registered steps and driver operations").add_subparsers(
        dest="steps_command", required=True, metavar="COMMAND"
    )
    p = steps.add_parser("list", parents=[common], help="what a profile's use can name, with its inputs")
    p.set_defaults(func=steps_list)

    profiles = sub.add_parser("profiles", help="versioned documents of steps").add_subparsers(
        dest="profiles_command", required=True, metavar="COMMAND"
    )
    p = profiles.add_parser("create", parents=[common, tenant], help="store a profile (JSON or TOML file)")
    p.add_argument("file")
    p.add_argument("--public", action="store_true", help="visible to every tenant")
    p.add_argument("--replace", action="store_true", help="replace a version no workflow has used")
    p.set_defaults(func=profiles_create)
    p = profiles.add_parser("get", parents=[common, tenant], help="one profile, as the lookup finds it")
    p.add_argument("id")
    p.add_argument("--version", type=int)
    p.set_defaults(func=profiles_get)
    p = profiles.add_parser("list", parents=[common, tenant], help="profiles a tenant can use")
    add_paging(p, default_limit=100)
    p.set_defaults(func=profiles_list)
    p = profiles.add_parser("delete", parents=[common, tenant], help="delete a version no workflow used")
    p.add_argument("id")
    p.add_argument("--version", type=int, required=True)
    p.set_defaults(func=profiles_delete)
    for name, fn, what in (
        ("validate", profiles_validate, "every unresolved use and rejected with, with its path"),
        ("render", profiles_render, "the steps a workflow would persist"),
    ):
        p = profiles.add_parser(name, parents=[common, tenant], help=what)
        p.add_argument("file", nargs="?", help="a profile document (or --id for a stored one)")
        p.add_argument("--id")
        p.add_argument("--version", type=int)
        p.set_defaults(func=fn)

    wfs = sub.add_parser("workflows", help="profiles running for nodes").add_subparsers(
        dest="workflows_command", required=True, metavar="COMMAND"
    )
    p = wfs.add_parser("start", parents=[common, tenant], help="start a workflow")
    p.add_argument("--profile", required=True)
    p.add_argument("--version", type=int)
    p.add_argument("--node")
    p.add_argument("--owner", help="reconciler that hears when it ends")
    p.add_argument("--wait", action="store_true", help="watch it until it ends")
    p.set_defaults(func=workflows_start)
    p = wfs.add_parser("get", parents=[common], help="one workflow and its steps")
    p.add_argument("id")
    p.set_defaults(func=workflows_get)
    p = wfs.add_parser("list", parents=[common], help="list workflows, newest first")
    p.add_argument("--node")
    p.add_argument("--state", choices=["running", "succeeded", "failed", "aborted"])
    p.add_argument("--profile")
    add_paging(p, default_limit=50)
    p.set_defaults(func=workflows_list)
    for name, fn, what in (
        ("abort", workflows_abort, "stop a running workflow, cancelling its live commands"),
        ("retry", workflows_retry, "run a failed workflow's failed step again"),
        ("resume", workflows_resume, "carry on an aborted workflow"),
    ):
        p = wfs.add_parser(name, parents=[common], help=what)
        p.add_argument("id")
        if name == "abort":
            p.add_argument("--reason")
        else:
            p.add_argument("--wait", action="store_true", help="watch it until it ends")
        p.set_defaults(func=fn)
    p = wfs.add_parser("watch", parents=[common], help="show each step live until the workflow ends")
    p.add_argument("id")
    p.set_defaults(func=workflows_watch)
