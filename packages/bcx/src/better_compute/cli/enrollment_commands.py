"""``bcx enrollment-rules create|list|delete|pending|confirm``: rules that enroll discovered nodes
by their inventory and labels (docs/metal.md, "Enrollment rules"). ``pending`` lists the nodes a
rule would enroll with a BMC address the machine reported itself; ``confirm`` enrolls one.

The rule's BMC credential is read from a file (``--bmc-credentials-file``) or asked for at the
terminal, never taken as an argument value, and stored through bc-secrets as a template secret:
no agent reads it; the engine copies it into the standing secret of each node the rule enrolls.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from ..clients import EngineClient, SecretsClient
from ..config import Settings
from ..core.errors import BcError, ErrorCode
from ..metal.lifecycle import parse_bmc_url
from ..wire.codec import convert
from ..wire.metal import EnrollmentRuleBmc, EnrollmentRuleView
from .common import add_tenant_flag, api_client, engine_client, parse_labels
from .metal_commands import add_bmc_credential_flags, read_credentials, show_lines
from .output import print_json, print_table

__all__ = ["register"]


def _bmc_template(args: argparse.Namespace) -> dict[str, Any] | None:
    """``--bmc`` as a template: a BMC URL whose host may be a ``{fact}`` placeholder."""
    if args.bmc is None:
        if args.bmc_credentials_file is not None or args.bmc_cidr:
            raise BcError(
                ErrorCode.INVALID_INPUT, "--bmc-credentials-file and --bmc-cidr need --bmc", {"path": "bmc"}
            )
        return None
    # parse the URL with a stand-in host, then put the template's host back
    placeholder = "bc-placeholder.invalid"
    text, holes = args.bmc, {}
    for i, part in enumerate(sorted(set(_holes(text)))):
        stand_in = f"h{i}.{placeholder}"
        holes[stand_in] = part
        text = text.replace(part, stand_in)
    bmc = parse_bmc_url(text)
    for stand_in, part in holes.items():
        for key in ("address", "systemId"):
            if isinstance(bmc.get(key), str):
                bmc[key] = str(bmc[key]).replace(stand_in, part)
    if args.bmc_insecure:
        bmc["insecure"] = True
    if args.bmc_token_delivery:
        bmc["tokenDelivery"] = args.bmc_token_delivery
    if args.bmc_cidr:
        bmc["addressCidrs"] = list(args.bmc_cidr)
    return bmc


def _holes(text: str) -> list[str]:
    return re.findall(r"\{[A-Za-z0-9._-]+\}", text)


async def rules_create(args: argparse.Namespace, settings: Settings) -> int:
    labels = parse_labels(args.label)
    bmc = _bmc_template(args)
    credential = None
    if bmc is not None and bmc["driver"] != "sim":
        interactive = not args.no_prompt and sys.stdin.isatty()
        credential = read_credentials(args.bmc_credentials_file, user=args.bmc_user, interactive=interactive)
    async with api_client(settings) as api:
        engine = EngineClient(api)
        if credential is not None:
            info = await SecretsClient(api).put_template(
                credential, tenant_id=args.tenant, label=f"bmc (enrollment rule {args.name})"
            )
            assert bmc is not None
            bmc["credentialsRef"] = info.ref
        try:
            template = convert(bmc, EnrollmentRuleBmc) if bmc is not None else None
        except BcError as err:
            raise err.with_path_prefix("bmc") from err
        rule = await engine.create_enrollment_rule(
            name=args.name, selector=args.selector, tenant_id=args.tenant, site_id=args.site,
            labels=labels, bmc=template, priority=args.priority, name_template=args.name_template,
        )  # fmt: skip
    if args.json:
        print_json(rule)
    else:
        print("\n".join(_lines(rule)))
    return 0


def _lines(rule: EnrollmentRuleView) -> list[str]:
    bmc = rule.bmc or {}
    lines = [
        f"rule      {rule.id} {rule.name}  (tenant {rule.tenant_id}, priority {rule.priority})",
        f"site      {rule.site_id or 'any'}",
        f"selector  {rule.selector}",
        f"labels    {','.join(f'{k}={v}' for k, v in rule.labels.items()) or '-'}",
        f"names     {rule.name_template or '{hostname} (the reported host name, when free in the site)'}",
    ]
    if bmc:
        cidrs = f"  within {', '.join(bmc['addressCidrs'])}" if bmc.get("addressCidrs") else ""
        ref = bmc.get("credentialsRef") or "no credential"
        lines.append(f"bmc       {bmc['driver']} {bmc['address']}{cidrs} ({ref})")
    else:
        lines.append("bmc       -")
    return lines


async def rules_list(args: argparse.Namespace, settings: Settings) -> int:
    async with engine_client(settings) as engine:
        got = await engine.list_enrollment_rules(tenant_id=args.tenant)
    if args.json:
        print_json(got)
        return 0
    rows = [
        {"id": r.id, "name": r.name, "priority": r.priority, "site": r.site_id or "any",
         "selector": r.selector, "bmc": f"{r.bmc['driver']} {r.bmc['address']}" if r.bmc else "-",
         "names": r.name_template or "-"}
        for r in got.rules
    ]  # fmt: skip
    print_table(rows, [("id", "ID"), ("name", "NAME"), ("priority", "PRIO"), ("site", "SITE"),
                       ("selector", "SELECTOR"), ("bmc", "BMC"), ("names", "NODE NAMES")])  # fmt: skip
    return 0


async def rules_delete(args: argparse.Namespace, settings: Settings) -> int:
    async with engine_client(settings) as engine:
        got = await engine.delete_enrollment_rule(id=args.id)
    if args.json:
        print_json(got)
    else:
        print(f"deleted {got.id} {got.name} (nodes it enrolled stay enrolled)")
    return 0


async def rules_pending(args: argparse.Namespace, settings: Settings) -> int:
    async with engine_client(settings) as engine:
        got = await engine.pending_enrollments(tenant_id=args.tenant, site_id=args.site)
    if args.json:
        print_json(got)
        return 0
    rows = [
        {"node": p.node_id, "site": p.site_id, "rule": f"{p.rule_name} ({p.rule_id})",
         "bmc": " ".join(str(p.bmc[k]) for k in ("driver", "address", "systemId") if p.bmc.get(k)),
         "macs": ", ".join(p.macs) or "-", "uuid": p.product_uuid or "-", "since": p.since or "-"}
        for p in got.nodes
    ]  # fmt: skip
    print_table(rows, [("node", "NODE"), ("site", "SITE"), ("rule", "RULE"), ("bmc", "BMC (reported)"),
                       ("macs", "MACS"), ("uuid", "UUID"), ("since", "SINCE")])  # fmt: skip
    return 0


async def rules_confirm(args: argparse.Namespace, settings: Settings) -> int:
    async with engine_client(settings) as engine:
        node = await engine.confirm_enrollment(node_id=args.node)
    if args.json:
        print_json(node)
    else:
        print("\n".join(show_lines(node)))
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    rules = sub.add_parser(
        "enrollment-rules",
        help="rules that enroll discovered nodes by their inventory and labels",
        description=(
            "A discovered node whose facts match a rule's selector is enrolled by it when its "
            "discovery inventory arrives: the rule's labels and BMC, its credential copied to the "
            "node. Facts: the node's labels, site, and inventory.vendor, inventory.product, "
            "inventory.serial, inventory.cpu_model, inventory.cpu_cores, inventory.memory_gib, "
            "inventory.gpus, inventory.disks, inventory.nics, inventory.boot_mode, "
            "inventory.bmc_address. Rules are tried by priority (lowest first), then name."
        ),
    )
    rsub = rules.add_subparsers(dest="rules_command", required=True, metavar="COMMAND")
    p = rsub.add_parser("create", parents=[common], help="a rule: selector, labels, BMC template")
    p.add_argument("name", help="the rule's name (unique in its tenant)")
    p.add_argument(
        "--selector",
        required=True,
        help="label expression over the facts: "
        "'inventory.vendor=\"Dell Inc.\" and inventory.memory_gib>=512'",
    )
    add_tenant_flag(
        p, "the tenant whose discovered nodes it enrolls (default: $BC_TENANT, the context's, else root)"
    )
    p.add_argument("--site", help="only nodes discovered at this site (default any)")
    p.add_argument("--label", action="append", help="key=value given to the node, repeatable")
    p.add_argument("--priority", type=int, default=100, help="lower is tried first (default 100)")
    p.add_argument(
        "--name-template",
        help="the node's name from its facts, unique in its site: 'rack1-{inventory.serial}', "
        "'{hostname}' (default: the node keeps the name its reported host name gave it)",
    )
    p.add_argument(
        "--bmc",
        help="redfish://host/redfish/v1/Systems/1, ipmi://host, sim://name; the host may be "
        "{inventory.bmc_address} (then give --bmc-cidr)",
    )
    p.add_argument("--bmc-cidr", action="append", help="a network a BMC address from facts must be in")
    add_bmc_credential_flags(p)
    p.set_defaults(func=rules_create)
    p = rsub.add_parser("list", parents=[common], help="the rules, in the order they are tried")
    p.add_argument("--tenant", help="one tenant's")
    p.set_defaults(func=rules_list)
    p = rsub.add_parser("delete", parents=[common], help="delete a rule (its nodes stay enrolled)")
    p.add_argument("id", help="rule id (rule_…)")
    p.set_defaults(func=rules_delete)
    p = rsub.add_parser(
        "pending",
        parents=[common],
        help="nodes a rule would enroll with a BMC address the machine reported: they wait for confirm",
    )
    p.add_argument("--tenant", help="one tenant's")
    p.add_argument("--site", help="one site's")
    p.set_defaults(func=rules_pending)
    p = rsub.add_parser(
        "confirm",
        parents=[common],
        help="enroll a pending node as its rule would (check its BMC address first: the machine said it)",
    )
    p.add_argument("node", help="node id (node_…)")
    p.set_defaults(func=rules_confirm)
