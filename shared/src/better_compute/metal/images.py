"""The image catalog as a step sees it: ``resolve_image_ref`` and the ``ImageSource`` contract.

Images live in the engine's ``images`` table, registered (``images.register``) by digest with a
signature from an allowlisted signer, per tenant, optionally public. ``resolve_image_ref`` finds
``name@version`` for a tenant (its own image first, then a public one of another tenant) and
checks the signature again against today's allowlist (``image_signers``, which every engine
writes from ``[images] signers`` at start): an image whose signer was removed since, or whose
signature no longer verifies, does not resolve. An app's ``image_verifier`` replaces the
allowlist: pass it as ``verifier`` (``ctx.provision.image_verifier``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Protocol, TypedDict

from better_compute.core.errors import BcError, ErrorCode
from better_compute.provision._names import IMAGE_REF_PATTERN, matches
from better_compute.provision.context import Sql
from better_compute.provision.module import ImageVerifier

from .signatures import ImageSigner, image_signing_payload, is_digest_only_signature, verify_image_signature

__all__ = [
    "IMAGE_FORMATS",
    "RESOLVE_IMAGE",
    "ImageSource",
    "ResolvedImage",
    "check_image_signer",
    "digest_only_refusal",
    "parse_image_ref",
    "resolve_image_ref",
]

IMAGE_FORMATS: Final = ("raw", "raw.gz", "raw.xz", "raw.zst", "qcow2", "iso")
"""What ``node.imageWrite`` writes, and ISO for virtual media."""

# $1 tenant, $2 name, $3 version: the tenant's own image, else the oldest public one of another
# tenant; with its signer's key when the signer is still allowlisted.
RESOLVE_IMAGE: Final = """
SELECT i.tenant_id, i.name, i.version, i.public, i.url, i.sha256, i.format, i.size, i.signer,
       i.signature, i.created_at, s.algorithm AS signer_algorithm, s.public_key AS signer_key
FROM images i LEFT JOIN image_signers s ON s.id = i.signer
WHERE i.name = $2 AND i.version = $3 AND (i.tenant_id = $1 OR i.public)
ORDER BY (i.tenant_id = $1) DESC, i.created_at, i.tenant_id
LIMIT 1
"""


class ResolvedImage(TypedDict):
    """What ``resolve_image_ref`` returns: enough to send ``node.imageWrite``."""

    name: str
    version: str
    url: str
    sha256: str
    format: str
    size: int | None
    signer: str | None
    tenantId: str


class ImageSource(Protocol):
    """Resolves an image URL of another scheme (``oci://``, ``s3://``) to one the site can fetch.

    Declared for plugins; nothing in Better Compute calls it yet.
    """

    scheme: str
    """The URL scheme handled, without ``://``."""

    async def resolve(self, *, url: str, sha256: str) -> str:
        """An ``http(s)`` URL serving the image whose digest is ``sha256``."""
        ...


def parse_image_ref(ref: object, *, path: str = "image") -> tuple[str, str]:
    """``name@version`` as ``(name, version)``; ``INVALID_INPUT`` at ``path`` otherwise."""
    if not matches(IMAGE_REF_PATTERN, ref):
        raise BcError(
            ErrorCode.INVALID_INPUT,
            "an image is name@version, like ubuntu-24.04@2024.06.1",
            {"path": path},
        )
    name, _, version = str(ref).partition("@")
    return name, version


def digest_only_refusal(code: ErrorCode, ref: str, path: str, signer: str) -> BcError:
    """The refusal of a signature over the digest alone (the scheme before signing payloads)."""
    return BcError(
        code,
        f"image {ref}: signer {signer}'s signature covers only the image's digest, not its name,"
        " version and URL: re-sign its signing payload (bcx images sign, or bcx images payload"
        " and openssl; docs/images.md) and register it again (a catalog entry never changes:"
        " delete the old one first, or register a new version)",
        {"path": path, "reason": "digest-only-signature", "signer": signer},
    )


async def check_image_signer(
    row: Mapping[str, Any], *, tenant_id: str, verifier: ImageVerifier | None = None
) -> None:
    """Refuse a catalog row (``RESOLVE_IMAGE``'s) whose signature is no longer acceptable.

    Raises:
        BcError: ``INVALID_STATE`` with reason ``signer-removed`` (the signer left the
            allowlist, or the image was accepted by an ``image_verifier`` not given now),
            ``digest-only-signature`` (signed before signatures covered name, version and URL:
            re-sign it) or ``bad-signature`` (the allowlisted key, or ``verifier``, refuses it now).
    """
    ref = f"{row['name']}@{row['version']}"
    signature = bytes(row["signature"])
    image = {"name": row["name"], "version": row["version"], "sha256": row["sha256"], "url": row["url"]}
    if verifier is not None:
        payload = image_signing_payload(**image)
        accepted = await verifier(
            tenant_id=tenant_id, digest=row["sha256"], signature=signature, name=row["name"],
            version=row["version"], url=row["url"], payload=payload,
        )  # fmt: skip
        if not accepted:
            raise BcError(
                ErrorCode.INVALID_STATE,
                f"image {ref}: the app's image_verifier refuses its signature",
                {"path": "image", "reason": "bad-signature"},
            )
        return
    if row["signer_key"] is None:
        who = f"signer {row['signer']}" if row["signer"] else "the app's image_verifier"
        raise BcError(
            ErrorCode.INVALID_STATE,
            f"image {ref} was signed by {who}, which is not an allowlisted signer any more",
            {"path": "image", "reason": "signer-removed", "signer": row["signer"]},
        )
    signer = ImageSigner(row["signer"], row["signer_algorithm"], bytes(row["signer_key"]))
    if not verify_image_signature(signer, signature, **image):
        if is_digest_only_signature(signer, row["sha256"], signature):
            raise digest_only_refusal(ErrorCode.INVALID_STATE, ref, "image", signer.id)
        raise BcError(
            ErrorCode.INVALID_STATE,
            f"image {ref}: its signature does not verify with signer {signer.id}'s key today",
            {"path": "image", "reason": "bad-signature", "signer": signer.id},
        )


async def resolve_image_ref(
    tx: Sql, tenant_id: str, ref: str, *, verifier: ImageVerifier | None = None
) -> ResolvedImage:
    """The catalog image ``name@version`` for ``tenant_id``: its own, else a public one.

    Args:
        tx: the engine's database (``ctx.sql`` or a transaction of it).
        tenant_id: the machine owner's tenant.
        ref: ``name@version``.
        verifier: the app's ``image_verifier`` (``ctx.provision.image_verifier``), which then
            decides instead of the allowlist.

    Raises:
        BcError: ``INVALID_INPUT`` at ``image`` for a malformed ref; ``NOT_FOUND`` at ``image``
            when neither the tenant nor anyone public has it; ``INVALID_STATE`` when its
            signer was removed or its signature no longer verifies (``check_image_signer``).
    """
    name, version = parse_image_ref(ref)
    rows = await tx.query(RESOLVE_IMAGE, tenant_id, name, version)
    if not rows:
        raise BcError(
            ErrorCode.NOT_FOUND,
            f"no image {ref} in tenant {tenant_id} nor a public one",
            {"path": "image"},
        )
    row = rows[0]
    await check_image_signer(row, tenant_id=tenant_id, verifier=verifier)
    return ResolvedImage(
        name=row["name"],
        version=row["version"],
        url=row["url"],
        sha256=row["sha256"],
        format=row["format"],
        size=row["size"],
        signer=row["signer"],
        tenantId=row["tenant_id"],
    )
