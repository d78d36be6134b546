"""``bcx tokens issue|list|revoke`` and ``bcx certs list|revoke``.

A join token is shown once, when it is issued, and only on request: ``--show-token``
prints it, ``--token-file`` writes it to a new 0600 file.
"""

from __future__ import annotations

import argparse
import os
from datetime import datetime
from typing import Any

import msgspec

from ..clients.pki import PkiClient
from ..config import Settings
from ..core.errors import BcError, ErrorCode
from ..core.manifest import parse_duration
from ..wire.pki import CertificateInfo, JoinTokenInfo
from .common import add_tenant_flag, api_client
from .output import iso, print_json
from .paging import add_paging, collect_pages, show_page

__all__ = ["parse_seconds", "register", "when"]


def parse_seconds(text: str) -> int:
    """A duration flag (``90s``, ``30m``, ``2h``, ``7d``: the manifest grammar) in whole seconds."""
    try:
        ms = parse_duration(text.strip())
    except BcError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    if ms < 1000 or ms % 1000:
        raise argparse.ArgumentTypeError(f"not a whole number of seconds: {text!r}")
    return ms // 1000


def when(value: datetime | None) -> str | None:
    """A timestamp for a table cell: ISO 8601, UTC, to the second."""
    return iso(value)


def _token_row(t: JoinTokenInfo) -> dict[str, Any]:
    return {
        "id": t.join_token_id,
        "tenant": t.tenant_id,
        "role": t.role,
        "site": t.site_id,
        "node": t.node_id,
        "uses": f"{t.uses}/{t.max_uses}",
        "state": t.state,
        "expires": when(t.expires_at),
    }


def _cert_row(c: CertificateInfo) -> dict[str, Any]:
    return {
        "id": c.cert_id,
        "agent": c.agent_id,
        "tenant": c.tenant_id,
        "role": c.role,
        "site": c.site_id,
        "state": c.state,
        "key": c.key_type,
        "notAfter": when(c.not_after),
    }


def _open_token_file(path: str) -> int:
    """Create the token file (new, 0600) before anything is minted: a file that is already
    there is ``CONFLICT`` and no token exists that nobody holds."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise BcError(ErrorCode.CONFLICT, "the token file already exists", {"path": "--token-file"}) from None
    except OSError as exc:
        raise BcError(
            ErrorCode.INVALID_INPUT,
            f"cannot create the token file: {exc.strerror}",
            {"path": "--token-file"},
        ) from None


async def cmd_tokens_issue(args: argparse.Namespace, settings: Settings) -> int:
    if not (args.show_token or args.token_file):
        raise BcError(
            ErrorCode.INVALID_INPUT,
            "a join token is shown only once: pass --show-token to print it or --token-file PATH to write it",
            {"path": "--show-token"},
        )
    expect = {
        "mac": args.expect_mac,
        "productUuid": args.expect_product_uuid,
        "serial": args.expect_serial,
        "gpuUuid": args.expect_gpu_uuid,
    }
    fd = _open_token_file(args.token_file) if args.token_file else None
    try:
        async with api_client(settings) as api:
            issued = await PkiClient(api).issue_join_token(
                tenant_id=args.tenant,
                role=args.role,
                site_id=args.site,
                ttl_seconds=args.ttl,
                max_uses=args.max_uses,
                expect={k: v for k, v in expect.items() if v is not None},
                idempotency_key=args.idempotency_key,
                note=args.note,
                node_id=args.node,
            )
    except BaseException:
        if fd is not None:  # nothing was minted for it: leave no empty file behind
            os.close(fd)
            os.unlink(args.token_file)
        raise
    if fd is not None:
        with os.fdopen(fd, "w") as fh:
            fh.write(issued.token + "\n")
    doc = msgspec.to_builtins(issued)
    if not args.show_token:
        del doc["token"]
    if args.json:
        print_json(doc)
        return 0
    print(
        f"join token {issued.join_token_id}: role {issued.role}, site {issued.site_id},"
        f" {issued.max_uses} use(s), expires {when(issued.expires_at)}"
    )
    if args.token_file:
        print(f"token written to {args.token_file}")
    if args.show_token:
        print(issued.token)
    return 0


async def cmd_tokens_list(args: argparse.Namespace, settings: Settings) -> int:
    async with api_client(settings) as api:
        tokens, next_ = await collect_pages(
            PkiClient(api).join_tokens_page, "tokens", args,
            tenant_id=args.tenant, site_id=args.site, state=args.state,
        )  # fmt: skip
    return show_page(
        args, next_, key="tokens", found=msgspec.to_builtins(tokens),
        rows=[_token_row(t) for t in tokens],
        columns=[("id", "ID"), ("tenant", "TENANT"), ("role", "ROLE"), ("site", "SITE"),
                 ("node", "NODE"), ("uses", "USES"), ("state", "STATE"), ("expires", "EXPIRES")],
        empty="no join tokens",
    )  # fmt: skip


async def cmd_tokens_revoke(args: argparse.Namespace, settings: Settings) -> int:
    async with api_client(settings) as api:
        info = await PkiClient(api).revoke_join_token(join_token_id=args.id, reason=args.reason)
    if args.json:
        print_json(msgspec.to_builtins(info))
    else:
        print(f"join token {info.join_token_id} is {info.state}")
    return 0


async def cmd_certs_list(args: argparse.Namespace, settings: Settings) -> int:
    async with api_client(settings) as api:
        certs, next_ = await collect_pages(
            PkiClient(api).certificates_page, "certificates", args,
            tenant_id=args.tenant, site_id=args.site, agent_id=args.agent,
            join_token_id=args.token, include_revoked=args.include_revoked,
        )  # fmt: skip
    return show_page(
        args, next_, key="certificates", found=msgspec.to_builtins(certs),
        rows=[_cert_row(c) for c in certs],
        columns=[("id", "ID"), ("agent", "AGENT"), ("tenant", "TENANT"), ("role", "ROLE"),
                 ("site", "SITE"), ("state", "STATE"), ("key", "KEY"), ("notAfter", "NOT AFTER")],
        empty="no certificates",
    )  # fmt: skip


async def cmd_certs_revoke(args: argparse.Namespace, settings: Settings) -> int:
    async with api_client(settings) as api:
        info = await PkiClient(api).revoke_certificate(cert_id=args.id, reason=args.reason)
    if args.json:
        print_json(msgspec.to_builtins(info))
    else:
        print(f"certificate {info.cert_id} of {info.agent_id} is {info.state}")
    return 0


async def cmd_certs_ca(args: argparse.Namespace, settings: Settings) -> int:
    async with api_client(settings) as api:
        info = await PkiClient(api).ca()
    if args.json:
        print_json(msgspec.to_builtins(info))
    else:
        print(info.certificate_pem, end="" if info.certificate_pem.endswith("\n") else "\n")
    return 0


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    common: argparse.ArgumentParser,
) -> None:
    """Add ``tokens`` and ``certs`` to bcx."""
    tokens = subparsers.add_parser("tokens", help="join tokens")
    tsub = tokens.add_subparsers(dest="tokens_command", required=True, metavar="COMMAND")
    p = tsub.add_parser("issue", parents=[common], help="mint a join token (shown once)")
    add_tenant_flag(p)
    p.add_argument(
        "--role", required=True, choices=["node", "site", "provisioned", "discovery"], help="who joins"
    )
    p.add_argument("--site", required=True, help="site id")
    p.add_argument("--ttl", type=parse_seconds, default=3600, help="lifetime: 90s, 30m, 2h")
    p.add_argument("--max-uses", type=int, default=1, help="joins it allows (default 1)")
    p.add_argument("--expect-mac", help="refuse joins that do not show this MAC")
    p.add_argument("--expect-product-uuid", help="refuse joins without this product UUID")
    p.add_argument("--expect-serial", help="refuse joins without this serial number")
    p.add_argument("--expect-gpu-uuid", help="refuse joins without this GPU UUID")
    p.add_argument("--node", help="node id the token is for (roles node and provisioned)")
    p.add_argument(
        "--idempotency-key", help="issuing again with it mints nothing new (the token is shown only once)"
    )
    p.add_argument("--note", help="a note kept with the token")
    p.add_argument("--show-token", action="store_true", help="print the token")
    p.add_argument("--token-file", help="write the token to this new file (0600)")
    p.set_defaults(func=cmd_tokens_issue)
    p = tsub.add_parser("list", parents=[common], help="join tokens, without their secrets")
    p.add_argument("--tenant", help="only this tenant's")
    p.add_argument("--site", help="only this site's")
    p.add_argument("--state", choices=["active", "expired", "used", "revoked"], help="only in this state")
    add_paging(p, default_limit=100)
    p.set_defaults(func=cmd_tokens_list)
    p = tsub.add_parser("revoke", parents=[common], help="revoke a join token")
    p.add_argument("id", help="join token id (tok_…)")
    p.add_argument("--reason", help="recorded with the revocation")
    p.set_defaults(func=cmd_tokens_revoke)

    certs = subparsers.add_parser("certs", help="agent certificates")
    csub = certs.add_subparsers(dest="certs_command", required=True, metavar="COMMAND")
    p = csub.add_parser("list", parents=[common], help="certificates (valid ones by default)")
    p.add_argument("--tenant", help="only this tenant's")
    p.add_argument("--site", help="only this site's")
    p.add_argument("--agent", help="agent id")
    p.add_argument("--token", help="join token id the certificate was earned with")
    p.add_argument("--include-revoked", action="store_true", help="revoked certificates too")
    add_paging(p, default_limit=100)
    p.set_defaults(func=cmd_certs_list)
    p = csub.add_parser("revoke", parents=[common], help="revoke a certificate")
    p.add_argument("id", help="certificate id (cert_…)")
    p.add_argument("--reason", help="recorded with the revocation")
    p.set_defaults(func=cmd_certs_revoke)
    p = csub.add_parser(
        "ca", parents=[common], help="bc-pki's CA certificate (PEM): what agents' certificates chain to"
    )
    p.set_defaults(func=cmd_certs_ca)
