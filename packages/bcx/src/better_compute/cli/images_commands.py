"""``bcx images register|list|show|delete``: the engine's image catalog; ``bcx images payload|sign``:
what an image's signer signs, and signing it locally (docs/images.md)."""

from __future__ import annotations

import argparse
import base64
import hashlib
import sys
from pathlib import Path
from typing import Any, cast

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from ..config import Settings
from ..core.errors import BcError, ErrorCode
from ..metal.signatures import image_signing_payload, sign_image
from ..wire.images import ImageFormat, ImageView
from .common import add_tenant_flag, as_rows, engine_client
from .output import print_json, print_table
from .paging import add_paging, collect, print_more

__all__ = ["register"]

FORMATS = ("raw", "raw.gz", "raw.xz", "raw.zst", "qcow2", "iso")


def _bad(path: str, message: str) -> BcError:
    return BcError(ErrorCode.INVALID_INPUT, message, {"path": path})


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise _bad(what, f"cannot read {path}: {exc.strerror or exc}") from None


def _signature(args: argparse.Namespace) -> bytes:
    """The signature: from ``--signature-file`` (raw bytes as openssl writes them, or base64
    text) or ``--signature`` (base64)."""
    if args.signature_file is not None:
        data = _read(args.signature_file, "signature-file")
        try:
            text = data.decode("ascii").strip()
            if text and (raw := base64.b64decode(text, validate=True)):
                return raw
        except (UnicodeDecodeError, ValueError):
            pass
        return data
    if args.signature is None:
        raise _bad("signature", "give --signature-file (or --signature with base64)")
    try:
        return base64.b64decode(str(args.signature), validate=True)
    except ValueError:
        raise _bad("signature", "--signature is base64") from None


def _digest(args: argparse.Namespace) -> tuple[str, int | None]:
    if args.file is None:
        if args.sha256 is None:
            raise _bad("sha256", "give --sha256 (or --file to compute it from a local copy)")
        return str(args.sha256), args.size
    h = hashlib.sha256()
    size = 0
    try:
        with open(args.file, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
                size += len(chunk)
    except OSError as exc:
        raise _bad("file", f"cannot read {args.file}: {exc.strerror or exc}") from None
    if args.sha256 is not None and args.sha256 != h.hexdigest():
        raise _bad("sha256", f"{args.file} has sha256 {h.hexdigest()}, not the --sha256 given")
    return h.hexdigest(), size


def _split(ref: str) -> tuple[str, str]:
    name, sep, version = ref.partition("@")
    if not sep:
        raise _bad("ref", "an image is name@version, like ubuntu-24.04@2024.06.1")
    return name, version


def _size(image: ImageView) -> str:
    return f"{image.size / 2**30:.1f} GiB" if isinstance(image.size, int) else "-"


def _payload(args: argparse.Namespace) -> tuple[bytes, dict[str, str]]:
    name, version = _split(args.ref)
    sha256, _ = _digest(args)
    image = {"name": name, "version": version, "sha256": sha256, "url": str(args.url)}
    return image_signing_payload(**image), image


async def images_payload(args: argparse.Namespace, settings: Settings) -> int:
    """The image's signing payload, byte for byte, for a signer that signs elsewhere (openssl)."""
    payload, _image = _payload(args)
    if args.out is not None:
        _write(args.out, payload)
    else:
        sys.stdout.buffer.write(payload)
        sys.stdout.flush()
    return 0


def _signing_key(path: str) -> ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except OSError as exc:
        raise _bad("key-file", f"cannot read the key file: {exc.strerror or exc}") from None
    except (ValueError, TypeError):
        raise _bad("key-file", "the key file holds no unencrypted PEM private key") from None
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key
    if isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(key.curve, ec.SECP256R1):
        return key
    raise _bad("key-file", "an image signing key is Ed25519 or ECDSA P-256")


def _write(path: str, data: bytes) -> None:
    try:
        Path(path).write_bytes(data)
    except OSError as exc:
        raise _bad("out", f"cannot write {path}: {exc.strerror or exc}") from None


async def images_sign(args: argparse.Namespace, settings: Settings) -> int:
    """Sign the image's payload with a local key (nothing is sent anywhere): raw bytes to
    ``--out`` (what ``register --signature-file`` takes), else base64 on stdout."""
    _, image = _payload(args)
    signature = sign_image(_signing_key(args.key_file), **image)
    if args.out is not None:
        _write(args.out, signature)
        print(f"signed {image['name']}@{image['version']} (sha256 {image['sha256']}, url {image['url']}):"
              f" {args.out}")  # fmt: skip
    else:
        print(base64.b64encode(signature).decode())
    return 0


async def images_register(args: argparse.Namespace, settings: Settings) -> int:
    name, version = _split(args.ref)
    sha256, size = _digest(args)
    async with engine_client(settings) as engine:
        image = await engine.register_image(
            tenant_id=args.tenant, name=name, version=version, url=args.url, sha256=sha256,
            format=cast(ImageFormat, args.format), size=size, signer=args.signer, signature=_signature(args),
            public=args.public,
        )  # fmt: skip
    if args.json:
        print_json(image)
    else:
        print(f"image {image.ref} registered in tenant {image.tenant_id} (sha256 {image.sha256})")
    return 0


async def images_list(args: argparse.Namespace, settings: Settings) -> int:
    async with engine_client(settings) as engine:

        async def fetch(cursor: str | None) -> tuple[list[ImageView], str | None]:
            got = await engine.list_images(
                tenant_id=args.tenant, name=args.name, limit=args.limit, cursor=cursor
            )
            return got.images, got.next

        images, next_ = await collect(fetch, args)
    if args.json:
        print_json({"images": images, "next": next_})
        return 0
    print_table(
        [{**row, "size": _size(i)} for i, row in zip(images, as_rows(images), strict=True)],
        [("ref", "IMAGE"), ("tenantId", "FROM"), ("format", "FORMAT"), ("size", "SIZE"),
         ("signer", "SIGNER"), ("signerStatus", "SIGNATURE"), ("public", "PUBLIC")],
        empty="no images",
    )  # fmt: skip
    print_more(next_)
    return 0


async def images_show(args: argparse.Namespace, settings: Settings) -> int:
    async with engine_client(settings) as engine:
        image = await engine.get_image(tenant_id=args.tenant, ref=args.ref)
    if args.json:
        print_json(image)
        return 0
    status = {
        "allowlisted": "valid (allowlisted signer)",
        "removed": "REFUSED at deploy: its signer is no longer allowlisted",
        "bad-signature": "REFUSED at deploy: the signature does not verify with the signer's key"
        " (one over the digest alone, from before signatures covered name, version and URL: re-sign it)",
        "verifier": "decided by the app's image_verifier",
    }.get(str(image.signer_status), str(image.signer_status))
    for label, value in (
        ("image", image.ref),
        ("tenant", image.tenant_id + ("  (public)" if image.public else "")),
        ("url", image.url),
        ("sha256", image.sha256),
        ("format", image.format),
        ("size", _size(image)),
        ("signer", image.signer or "-"),
        ("signature", status),
        ("registered", image.created_at),
    ):
        print(f"{label:<11} {value}")
    return 0


async def images_delete(args: argparse.Namespace, settings: Settings) -> int:
    async with engine_client(settings) as engine:
        deleted = await engine.delete_image(tenant_id=args.tenant, ref=args.ref)
    if args.json:
        print_json(deleted)
    else:
        print(f"image {args.ref} deleted from tenant {args.tenant}")
    return 0


async def signers_list(args: argparse.Namespace, settings: Settings) -> int:
    async with engine_client(settings) as engine:
        got = await engine.list_image_signers()
    if args.json:
        print_json(got)
        return 0
    rows = [
        {"id": s.id, "algorithm": s.algorithm, "source": s.source, "by": s.added_by or "-", "since": s.since}
        for s in got.signers
    ]
    print_table(
        rows,
        [
            ("id", "ID"),
            ("algorithm", "ALGORITHM"),
            ("source", "SOURCE"),
            ("by", "ADDED BY"),
            ("since", "SINCE"),
        ],
    )
    return 0


async def signers_add(args: argparse.Namespace, settings: Settings) -> int:
    if (args.public_key is None) == (args.public_key_file is None):
        raise BcError(
            ErrorCode.INVALID_INPUT,
            "give --public-key-file or --public-key (not both)",
            {"path": "publicKey"},
        )
    key = args.public_key
    if args.public_key_file is not None:
        key = _read(args.public_key_file, "publicKey").decode("utf-8", "replace")
    async with engine_client(settings) as engine:
        signer = await engine.add_image_signer(id=args.id, public_key=key)
    if args.json:
        print_json(signer)
    else:
        print(f"signer {signer.id} ({signer.algorithm}) allowlisted: every engine accepts its images now")
    return 0


async def signers_remove(args: argparse.Namespace, settings: Settings) -> int:
    async with engine_client(settings) as engine:
        signer = await engine.remove_image_signer(id=args.id)
    if args.json:
        print_json(signer)
    else:
        print(f"signer {signer.id} removed: its images no longer resolve")
    return 0


def _register_signers(images: Any, common: argparse.ArgumentParser) -> None:
    signers = images.add_parser(
        "signers",
        help="the allowlisted image signers, changed while the engines run",
        description="Signers added here are in force for every engine at once (no restart); those of"
        " [images] signers in bc.toml and of plugins are written by every engine at its start.",
    ).add_subparsers(dest="signers_command", required=True, metavar="COMMAND")
    p = signers.add_parser("list", parents=[common], help="every allowlisted signer and where it comes from")
    p.set_defaults(func=signers_list)
    p = signers.add_parser("add", parents=[common], help="allowlist a signer now, for every engine")
    p.add_argument("id", help="the signer's id (acme-release): registrations name it with --signer")
    p.add_argument("--public-key-file", help="its public key: Ed25519 or ECDSA P-256, PEM")
    p.add_argument(
        "--public-key", help="its public key as text (base64 of the raw Ed25519 key, or of the DER)"
    )
    p.set_defaults(func=signers_add)
    p = signers.add_parser("remove", parents=[common], help="take a signer you added off the allowlist")
    p.add_argument("id", help="the signer's id")
    p.set_defaults(func=signers_remove)


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    tenant = argparse.ArgumentParser(add_help=False)
    add_tenant_flag(tenant)
    images = sub.add_parser("images", help="the image catalog").add_subparsers(
        dest="images_command", required=True, metavar="COMMAND"
    )
    p = images.add_parser("register", parents=[common, tenant], help="add a signed image (name@version)")
    p.add_argument("ref", metavar="NAME@VERSION", help="the image's catalog name and version")
    p.add_argument("--url", required=True, help="http(s) URL the site fetches the image from")
    p.add_argument("--sha256", help="hex SHA-256 of the image")
    p.add_argument("--file", help="a local copy: computes --sha256 and --size")
    p.add_argument("--size", type=int, help="bytes")
    p.add_argument("--format", choices=FORMATS, default="raw", help="how the bytes are packed (default raw)")
    p.add_argument("--signer", help="the allowlisted signer's id (bcx images signers list)")
    p.add_argument(
        "--signature-file", help="the signature over the image's signing payload (raw, as openssl writes it)"
    )
    p.add_argument("--signature", help="the signature, base64")
    p.add_argument("--public", action="store_true", help="visible to every tenant")
    p.set_defaults(func=images_register)
    for command, func, what in (
        ("payload", images_payload, "print what an image's signer signs (name, version, sha256, URL)"),
        ("sign", images_sign, "sign an image's payload with a local Ed25519 or P-256 key"),
    ):
        p = images.add_parser(command, parents=[common], help=what)
        p.add_argument("ref", metavar="NAME@VERSION", help="the image's catalog name and version")
        p.add_argument("--url", required=True, help="the URL it will be registered with")
        p.add_argument("--sha256", help="hex SHA-256 of the image")
        p.add_argument("--file", help="a local copy: computes --sha256")
        p.add_argument("--size", type=int, help=argparse.SUPPRESS)
        if command == "sign":
            p.add_argument("--key-file", required=True, help="the signer's private key (PEM, unencrypted)")
            p.add_argument("--out", help="write the raw signature here (default: base64 on stdout)")
        else:
            p.add_argument("--out", help="write the payload here (default: stdout)")
        p.set_defaults(func=func)
    p = images.add_parser("list", parents=[common, tenant], help="the tenant's and public images")
    p.add_argument("--name", help="only this image name")
    add_paging(p, default_limit=100)
    p.set_defaults(func=images_list)
    p = images.add_parser("show", parents=[common, tenant], help="one image, as the tenant resolves it")
    p.add_argument("ref", metavar="NAME@VERSION", help="the image's catalog name and version")
    p.set_defaults(func=images_show)
    p = images.add_parser("delete", parents=[common, tenant], help="remove one of the tenant's images")
    p.add_argument("ref", metavar="NAME@VERSION", help="the image's catalog name and version")
    p.set_defaults(func=images_delete)
    _register_signers(images, common)
