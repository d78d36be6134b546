"""``bcx bus``: the artefacts that secure the deployment's NATS (deploy/nats, deploy/README.md).

``ca`` makes the bus's CA (files, on this machine), ``cert`` a NATS server's TLS certificate signed
by it, ``password`` the bcrypt hash of a NATS user's password for nats.env, ``callout`` what a
site's leaf node and its auth callout responder need (``write_callout_artefacts``). Nothing here
talks to the bus: this is what an operator runs before the bus exists.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

from ..config import Settings
from ..core.errors import BcError, ErrorCode
from ..crypto import (
    BUS_CERT_DAYS,
    bcrypt_password,
    issue_bus_certificate,
    issue_bus_client_certificate,
    new_bus_ca,
)
from ..files import atomic_write
from ..wire.subjects import valid_token
from .output import print_json

__all__ = ["register"]

CA_CERT = "ca.pem"
CA_KEY = "ca-key.pem"
CLIENT_CA = "client-ca.pem"
"""What a leaf node checks its clients' certificates against: bc-pki's CA (agents) and the bus
CA (the site's joining certificate and the callout responder's)."""


def _write(path: Path, data: bytes, *, secret: bool) -> None:
    """Write a new file (never over an existing one); a key is readable by its owner only."""
    try:
        atomic_write(path, data, mode=0o600 if secret else 0o644, exclusive=True)
    except FileExistsError:
        raise BcError(
            ErrorCode.CONFLICT, f"{path} exists: remove it first to replace it", {"path": str(path)}
        ) from None
    except OSError as exc:
        raise BcError(
            ErrorCode.INVALID_INPUT, f"cannot write {path}: {exc.strerror}", {"path": "dir"}
        ) from exc


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


@dataclass(frozen=True)
class CalloutArtefacts:
    """What ``bcx bus callout`` made for one site (files in the bus CA's folder)."""

    site: str
    issuer: str  # the public account nkey: BC_NATS_CALLOUT_ISSUER of the leaf
    password_hash: str  # BC_NATS_CALLOUT_PASSWORD of the leaf (bcrypt, quoted for nats-server)
    client_ca: Path  # BC_NATS_CLIENT_CA of the leaf
    issuer_seed: Path  # the responder's only: it signs every agent's NATS user with it
    password: Path  # the responder's: the callout user's password on the leaf, in plain
    responder_cert: Path
    responder_key: Path
    joining_cert: Path  # the site's joining identity: machines without a certificate yet
    joining_key: Path

    def env(self) -> dict[str, str]:
        """The leaf node's ``nats-leaf.env`` lines."""
        return {
            "BC_NATS_CALLOUT_ISSUER": self.issuer,
            "BC_NATS_CALLOUT_PASSWORD": self.password_hash,
            "BC_NATS_CLIENT_CA": str(self.client_ca),
        }


def write_callout_artefacts(
    folder: Path, *, site: str, pki_ca_pem: bytes, days: int = BUS_CERT_DAYS, bcrypt_rounds: int = 11
) -> CalloutArtefacts:
    """Make, in the bus CA's ``folder``, what site ``site``'s auth callout needs: the issuer nkey
    (its seed for the responder only), the ``callout`` user's password and its hash, the
    responder's and the site's joining client certificates from the bus CA, and the leaf's
    client CA bundle (the bus CA and bc-pki's ``pki_ca_pem``). New files only."""
    import nkeys  # only this command needs it

    if not valid_token(site):
        raise BcError(ErrorCode.INVALID_INPUT, "a site id of letters, digits, '-' and '_'", {"path": "site"})
    try:
        from cryptography import x509

        pki_ca = x509.load_pem_x509_certificate(pki_ca_pem)
    except ValueError:
        raise BcError(
            ErrorCode.INVALID_INPUT, "not bc-pki's CA certificate (PEM)", {"path": "pki_ca"}
        ) from None
    ca_cert, ca_key = _read(folder / CA_CERT), _read(folder / CA_KEY)
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT)
    issuer = nkeys.from_seed(seed).public_key.decode()
    password = "p" + secrets.token_hex(24)  # a letter first: nats-server parses the value
    paths = {
        "seed": folder / f"callout-{site}-issuer.nk",
        "password": folder / f"callout-{site}-password",
        "cert": folder / f"bc-callout-{site}.pem",
        "key": folder / f"bc-callout-{site}-key.pem",
        "join_cert": folder / f"bc-join-{site}.pem",
        "join_key": folder / f"bc-join-{site}-key.pem",
    }
    for path in paths.values():
        if path.exists():
            raise BcError(
                ErrorCode.CONFLICT, f"{path} exists: remove it first to replace it", {"path": str(path)}
            )
    from cryptography.hazmat.primitives import serialization

    bundle = ca_cert + pki_ca.public_bytes(serialization.Encoding.PEM)
    client_ca = folder / CLIENT_CA
    if client_ca.exists() and client_ca.read_bytes() != bundle:
        raise BcError(
            ErrorCode.CONFLICT,
            f"{client_ca} exists with other CAs: remove it first to replace it",
            {"path": str(client_ca)},
        )
    if not client_ca.exists():
        _write(client_ca, bundle, secret=False)
    cert, key = issue_bus_client_certificate(ca_cert, ca_key, name=f"bc-callout-{site}", uris=[], days=days)
    join_cert, join_key = issue_bus_client_certificate(
        ca_cert, ca_key, name=f"bc-join-{site}", uris=[f"urn:bc:join:{site}"], days=days
    )
    _write(paths["seed"], seed + b"\n", secret=True)
    _write(paths["password"], password.encode() + b"\n", secret=True)
    _write(paths["key"], key, secret=True)
    _write(paths["cert"], cert, secret=False)
    _write(paths["join_key"], join_key, secret=True)
    _write(paths["join_cert"], join_cert, secret=False)
    return CalloutArtefacts(
        site=site,
        issuer=issuer,
        password_hash=bcrypt_password(password, rounds=bcrypt_rounds),
        client_ca=client_ca,
        issuer_seed=paths["seed"],
        password=paths["password"],
        responder_cert=paths["cert"],
        responder_key=paths["key"],
        joining_cert=paths["join_cert"],
        joining_key=paths["join_key"],
    )


async def cmd_bus_callout(args: argparse.Namespace, _settings: Settings) -> int:
    folder = Path(args.dir)
    made = write_callout_artefacts(
        folder, site=args.site, pki_ca_pem=_read(Path(args.pki_ca)), days=args.days
    )
    files = {
        "issuerSeed": str(made.issuer_seed), "password": str(made.password),
        "responderCert": str(made.responder_cert), "responderKey": str(made.responder_key),
        "joiningCert": str(made.joining_cert), "joiningKey": str(made.joining_key),
        "clientCa": str(made.client_ca),
    }  # fmt: skip
    if args.json:
        print_json({"site": made.site, "env": made.env(), "files": files})
        return 0
    print(f"# nats-leaf.env of the {made.site} leaf node (its auth_callout block reads these)")
    for var, value in made.env().items():
        # single quotes keep systemd's EnvironmentFile from eating the double quotes
        print(f"{var}='{value}'" if var == "BC_NATS_CALLOUT_PASSWORD" else f"{var}={value}")
    print(f"# the responder's only (bc-pki callout; 0600): {made.issuer_seed}, {made.password},")
    print(f"#   {made.responder_key} with {made.responder_cert}")
    print(f"# the site's joining identity (machines without a certificate): {made.joining_cert},")
    print(f"#   {made.joining_key}")
    return 0


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    common: argparse.ArgumentParser,
) -> None:
    """Add ``bus ca``, ``bus cert``, ``bus password`` and ``bus callout`` to bcx."""
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
    p.add_argument("--user", required=True, help="the NATS user (engine, alice, …)")
    p.set_defaults(func=cmd_bus_password)
    p = bsub.add_parser(
        "callout",
        parents=[common],
        help="a site's auth callout: issuer nkey, callout password hash, responder and joining certificates",
    )
    p.add_argument("--dir", required=True, help="the folder of ca.pem and ca-key.pem; the files go there")
    p.add_argument("--site", required=True, help="the site of the leaf node (eu1)")
    p.add_argument(
        "--pki-ca", required=True, help="bc-pki's CA certificate (PEM), which agents' certificates chain to"
    )
    p.add_argument(
        "--days", type=int, default=BUS_CERT_DAYS, help=f"certificates' lifetime (default {BUS_CERT_DAYS})"
    )
    p.set_defaults(func=cmd_bus_callout)
