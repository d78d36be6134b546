"""``bcx keys``: rotate a service's key file and re-seal its stored secrets under the new key.

The key file is local (each instance reads its own copy); ``rotate`` changes the file on this
machine and prints only the new key's id. ``rewrap`` asks the running services to re-seal what
they store under their current key, once every instance has restarted with the new file.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Final

from ..clients.pki import PkiClient
from ..clients.secrets import SecretsClient
from ..config import Settings
from ..keyring import key_file_path, rotate_key_file
from .common import api_client
from .output import print_json, print_table

__all__ = ["register"]

KEYED_SERVICES: Final = ("pki", "secrets")


def _key_file(settings: Settings, service: str, explicit: str | None) -> Path:
    configured = settings.pki.key_file if service == "pki" else settings.secrets.key_file
    return key_file_path(settings, explicit or configured, service)


async def cmd_keys_rotate(args: argparse.Namespace, settings: Settings) -> int:
    path = _key_file(settings, args.service, args.file)
    key_id = rotate_key_file(path)
    if args.json:
        print_json({"service": args.service, "path": str(path), "keyId": key_id})
    else:
        print(f"new key {key_id} on top of {path}")
        print(f"next: copy the file to every bc-{args.service} host, restart every instance, then")
        print(f"      bcx keys rewrap --service {args.service}")
    return 0


async def cmd_keys_rewrap(args: argparse.Namespace, settings: Settings) -> int:
    services = KEYED_SERVICES if args.service == "all" else (args.service,)
    rows: list[dict[str, Any]] = []
    async with api_client(settings) as api:
        for service in services:
            if service == "pki":
                done: Any = await PkiClient(api).rewrap_keys()
            else:
                done = await SecretsClient(api).rewrap_keys()
            rows.append({"service": service, "keyId": done.key_id, "rewrapped": done.rewrapped})
    if args.json:
        print_json({"services": rows})
    else:
        print_table(rows, [("service", "SERVICE"), ("keyId", "SEALED UNDER"), ("rewrapped", "REWRAPPED")])
    return 0


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    common: argparse.ArgumentParser,
) -> None:
    """Add ``keys rotate`` and ``keys rewrap`` to bcx."""
    keys = subparsers.add_parser("keys", help="the key files of bc-pki and bc-secrets")
    ksub = keys.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")
    p = ksub.add_parser(
        "rotate", parents=[common], help="put a new key on top of a service's key file (this machine)"
    )
    p.add_argument("--service", required=True, choices=list(KEYED_SERVICES), help="whose key to rotate")
    p.add_argument("--file", help="the key file (default: the service's key_file setting, else "
                   "<state_dir>/keys/<service>.key)")  # fmt: skip
    p.set_defaults(func=cmd_keys_rotate)
    p = ksub.add_parser(
        "rewrap", parents=[common], help="re-seal stored secrets under each service's current key"
    )
    p.add_argument(
        "--service", default="all", choices=[*KEYED_SERVICES, "all"], help="whose rows (default all)"
    )
    p.set_defaults(func=cmd_keys_rewrap)
