"""``bcx secrets list|show``: metadata; a value only with ``show --reveal``.

bcx is a control-plane client: ``--reveal`` uses ``secrets.get``, which deployments allow
only to control-plane NATS credentials.
"""

from __future__ import annotations

import argparse
import base64
import sys
from typing import Any

import msgspec

from ..clients.secrets import SecretsClient
from ..config import Settings
from ..wire.secrets import SecretInfo
from .common import api_client
from .output import print_json, print_table
from .paging import add_paging, collect_pages, show_page
from .pki_commands import when

__all__ = ["register"]


def _row(s: SecretInfo) -> dict[str, Any]:
    return {
        "ref": s.ref,
        "tenant": s.tenant_id,
        "workflow": s.workflow_id,
        "step": s.step,
        "size": s.size,
        "key": s.key_id,
        "created": when(s.created_at),
        "label": s.label,
    }


async def cmd_secrets_list(args: argparse.Namespace, settings: Settings) -> int:
    async with api_client(settings) as api:
        found, next_ = await collect_pages(
            SecretsClient(api).secrets_page, "secrets", args, tenant_id=args.tenant, workflow_id=args.workflow
        )
    return show_page(
        args, next_, key="secrets", found=msgspec.to_builtins(found),
        rows=[_row(s) for s in found],
        columns=[("ref", "REF"), ("tenant", "TENANT"), ("workflow", "WORKFLOW"), ("step", "STEP"),
                 ("size", "BYTES"), ("key", "KEY"), ("created", "CREATED"), ("label", "LABEL")],
        empty="no secrets",
    )  # fmt: skip


async def cmd_secrets_show(args: argparse.Namespace, settings: Settings) -> int:
    async with api_client(settings) as api:
        client = SecretsClient(api)
        info = await client.describe(ref=args.ref)
        value = await client.get(ref=args.ref) if args.reveal else None
    if args.json:
        doc = msgspec.to_builtins(info)
        if value is not None:
            doc["value"] = base64.b64encode(value).decode()
        print_json(doc)
        return 0
    if value is not None:
        sys.stdout.buffer.write(value)
        sys.stdout.flush()
        return 0
    print_table([_row(info)], [(k, k.upper()) for k in _row(info)])
    return 0


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    common: argparse.ArgumentParser,
) -> None:
    """Add ``secrets`` to bcx."""
    secrets = subparsers.add_parser("secrets", help="stored secrets (metadata)")
    ssub = secrets.add_subparsers(dest="secrets_command", required=True, metavar="COMMAND")
    p = ssub.add_parser("list", parents=[common], help="secrets, metadata only")
    p.add_argument("--tenant", help="only this tenant's")
    p.add_argument("--workflow", help="workflow id")
    add_paging(p, default_limit=100)
    p.set_defaults(func=cmd_secrets_list)
    p = ssub.add_parser("show", parents=[common], help="one secret's metadata")
    p.add_argument("ref", help="SecretRef (sec_…)")
    p.add_argument("--reveal", action="store_true", help="print the value itself (control plane only)")
    p.set_defaults(func=cmd_secrets_show)
