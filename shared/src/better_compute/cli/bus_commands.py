"""``bcx bus``: the artefacts that secure the deployment's NATS (deploy/nats, deploy/README.md).

``ca`` makes the bus's CA (files, on this machine), ``cert`` a NATS server's TLS certificate signed
by it, ``password`` the bcrypt hash of a NATS user's password for nats.env. Nothing here talks to
the bus: this is what an operator runs before the bus exists.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..config import Settings
from ..core.errors import BcError, ErrorCode
from ..crypto import BUS_CERT_DAYS, bcrypt_password, issue_bus_certificate, new_bus_ca
from ..wire.subjects import valid_token
from .output import print_json

__all__ = ["register"]

CA_CERT = "ca.pem"
CA_KEY = "ca-key.pem"


def _write(path: Path, data: bytes, *, secret: bool) -> None:
    """Write a new file (never over an existing one); a key is readable by its owner only."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if secret else 0o644)
    except FileExistsError:
        raise BcError(
            ErrorCode.CONFLICT, f"{path} exists: remove it first to replace it", {"path": str(path)}
        ) from None
    except OSError as exc:
        raise BcError(
            ErrorCode.INVALID_INPUT, f"cannot write {path}: {exc.strerror}", {"path": "dir"}
        ) from exc
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise BcError(
            ErrorCode.INVALID_INPUT,
            f"cannot read {path}: {exc.strerror} (bcx bus ca makes it)",
            {"path": "dir"},
        ) from exc


def _make_ca(folder: Path, name: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = new_bus_ca(name)
    _write(folder / CA_KEY, key, secret=True)
    _write(folder / CA_CERT, cert, secret=False)


async def cmd_bus_ca(args: argparse.Namespace, _settings: Settings) -> int:
    folder = Path(args.dir)
    _make_ca(folder, args.name)
    if args.json:
        print_json({"ca": str(folder / CA_CERT), "key": str(folder / CA_KEY)})
    else:
        print(f"bus CA {folder / CA_CERT}, its key {folder / CA_KEY} (keep it off the NATS hosts)")
    return 0


async def cmd_bus_cert(args: argparse.Namespace, _settings: Settings) -> int:
    folder = Path(args.dir)
    if not valid_token(args.name):
        raise BcError(ErrorCode.INVALID_INPUT, "a name of letters, digits, '-' and '_'", {"path": "name"})
    cert, key = issue_bus_certificate(
        _read(folder / CA_CERT),
        _read(folder / CA_KEY),
        name=args.name,
        dns=args.dns or [],
        ips=args.ip or [],
        days=args.days,
    )
    _write(folder / f"{args.name}-key.pem", key, secret=True)
    _write(folder / f"{args.name}.pem", cert, secret=False)
    if args.json:
        print_json({"cert": str(folder / f"{args.name}.pem"), "key": str(folder / f"{args.name}-key.pem")})
    else:
        print(f"certificate {folder / f'{args.name}.pem'}, its key {folder / f'{args.name}-key.pem'}")
    return 0


async def cmd_bus_password(args: argparse.Namespace, _settings: Settings) -> int:
    password = sys.stdin.readline().rstrip("\n")
    hashed = bcrypt_password(password)
    var = f"BC_NATS_{args.user.upper().replace('-', '_')}_PASSWORD"
    if args.json:
        print_json({"variable": var, "value": hashed})
    else:
        # single quotes keep systemd's EnvironmentFile from eating the double quotes
        print(f"{var}='{hashed}'")
    return 0


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    common: argparse.ArgumentParser,
) -> None:
    """Add ``bus ca``, ``bus cert`` and ``bus password`` to bcx."""
    bus = subparsers.add_parser("bus", help="TLS certificates and password hashes for deploy/nats")
    bsub = bus.add_subparsers(dest="bus_command", required=True, metavar="COMMAND")
    p = bsub.add_parser("ca", parents=[common], help="make the bus's CA: ca.pem and ca-key.pem in --dir")
    p.add_argument("--dir", required=True, help="where to write them (new files only)")
    p.add_argument("--name", default="Better Compute bus CA", help="the CA's common name")
    p.set_defaults(func=cmd_bus_ca)
    p = bsub.add_parser("cert", parents=[common], help="a NATS server's TLS certificate from the CA in --dir")
    p.add_argument("--dir", required=True, help="the folder of ca.pem and ca-key.pem; <name>.pem goes there")
    p.add_argument("--name", required=True, help="the server (bc-nats-1, bc-leaf-eu1): the files' name")
    p.add_argument("--dns", action="append", help="a DNS name clients, routes or leaf nodes dial (repeat)")
    p.add_argument("--ip", action="append", help="an address they dial (repeat)")
    p.add_argument("--days", type=int, default=BUS_CERT_DAYS, help=f"lifetime (default {BUS_CERT_DAYS})")
    p.set_defaults(func=cmd_bus_cert)
    p = bsub.add_parser(
        "password", parents=[common], help="the nats.env line for a user: its password (stdin) bcrypt-hashed"
    )
    p.add_argument("--user", required=True, help="the NATS user (engine, alice, leaf-eu1, …)")
    p.set_defaults(func=cmd_bus_password)
