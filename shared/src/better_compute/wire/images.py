"""Requests of the engine's image catalog, ``bc.api.engine.images.*`` (camelCase on the wire).

======================  =================  ===========================================
route                   request            reply
======================  =================  ===========================================
``images.register``     ``RegisterImage``  ``ImageView`` (no ``signerStatus``)
``images.list``         ``ListImages``     ``ImageList``: ``{images: [...], next}``
``images.get``          ``GetImage``       ``ImageView``, with ``signerStatus``
``images.delete``       ``DeleteImage``    ``ImageDeleted``: ``{deleted: true}``
======================  =================  ===========================================

and the signer allowlist, changed while the engines run (no restart):

==========================  ======================  ====================================
route                       request                 reply
==========================  ======================  ====================================
``images.signers.add``      ``AddImageSigner``      ``ImageSignerView``
``images.signers.remove``   ``RemoveImageSigner``   ``ImageSignerView`` (as it was)
``images.signers.list``     ``ListImageSigners``    ``ImageSignerList``
==========================  ======================  ====================================

An image document: ``{tenantId, name, version, ref, public, url, sha256, format, size, signer,
createdAt}``; ``images.get`` adds ``signerStatus``: ``allowlisted`` (it resolves),
``removed`` (its signer left the allowlist: it does not resolve) or ``verifier`` (the app's
``image_verifier`` decides).
"""

from __future__ import annotations

from typing import Annotated, Final, Literal, TypeAlias

import msgspec

from ..core.names import Name
from .paging import DEFAULT_LIMIT, Cursor, Limit

__all__ = [
    "MAX_IMAGE_URL",
    "AddImageSigner",
    "DeleteImage",
    "GetImage",
    "ImageDeleted",
    "ImageFormat",
    "ImageList",
    "ImageSignerList",
    "ImageSignerView",
    "ImageView",
    "ListImageSigners",
    "ListImages",
    "RegisterImage",
    "RemoveImageSigner",
    "SignerStatus",
]

MAX_IMAGE_URL: Final = 2048
ImageName = Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9][a-z0-9._-]{0,127}$")]
"""``ubuntu-24.04``: lowercase letters, digits and ``._-``."""
ImageVersion = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")]
"""``2024.06.1``."""
ImageFormat = Literal["raw", "raw.gz", "raw.xz", "raw.zst", "qcow2", "iso"]
Sha256 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
SignerId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
Url = Annotated[str, msgspec.Meta(pattern=r"^https?://[^\s]+$", max_length=MAX_IMAGE_URL)]


class _Req(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    pass


class RegisterImage(_Req, frozen=True, kw_only=True):
    """Add ``name@version`` to a tenant's catalog; ``signature`` (base64 on the wire) is the
    signer's over the image's signing payload: name, version, digest and URL
    (docs/images.md). Registering the same image again is a no-op;
    another digest, URL or signature under the same name and version is ``CONFLICT``."""

    tenant_id: Name = "root"
    name: ImageName
    version: ImageVersion
    url: Url
    sha256: Sha256
    format: ImageFormat = "raw"
    size: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None = None
    signer: SignerId | None = None
    """The allowlisted signer; may be left out when the app's ``image_verifier`` decides."""
    signature: Annotated[bytes, msgspec.Meta(min_length=1, max_length=512)]
    public: bool = False
    """Visible to every tenant (each tenant's own image of the same name and version wins)."""


class GetImage(_Req, frozen=True, kw_only=True):
    """``name@version`` as the tenant resolves it: its own, else a public one."""

    tenant_id: Name = "root"
    ref: Annotated[str, msgspec.Meta(max_length=260)]


class DeleteImage(_Req, frozen=True, kw_only=True):
    """Only the tenant's own image; workflows that resolved it already keep their URL."""

    tenant_id: Name = "root"
    ref: Annotated[str, msgspec.Meta(max_length=260)]


class ListImages(_Req, frozen=True, kw_only=True):
    """The tenant's own and public images, by name and version; ``cursor`` is the ``next`` of
    the page before."""

    tenant_id: Name = "root"
    name: ImageName | None = None
    limit: Limit = DEFAULT_LIMIT
    cursor: Cursor | None = None


# -- replies --------------------------------------------------------------------------


class AddImageSigner(_Req, frozen=True, kw_only=True):
    """An allowlisted signer added while the engines run: every engine's next registration and
    deploy accept its signatures. ``public_key``: Ed25519 or ECDSA P-256, as ``[images] signers``
    takes it (PEM, base64 of the DER form, or base64 of the raw 32-byte Ed25519 key)."""

    id: SignerId
    public_key: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]


class RemoveImageSigner(_Req, frozen=True, kw_only=True):
    """An operator's signer taken off the allowlist: its images stop resolving at once."""

    id: SignerId


class ListImageSigners(_Req, frozen=True, kw_only=True):
    """Every allowlisted signer (few: no paging)."""


class _Reply(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    pass


SignerStatus: TypeAlias = Literal["allowlisted", "removed", "verifier", "bad-signature"]


class ImageView(_Reply, frozen=True, kw_only=True):
    """An image of the catalog (its signature stays there). ``signerStatus`` is set by
    ``images.get`` and ``images.list``: whether the image still resolves."""

    tenant_id: str
    name: str
    version: str
    ref: str
    """``name@version``."""
    public: bool
    url: str
    sha256: str
    format: str
    size: int | None
    signer: str | None
    created_at: str | None
    signer_status: SignerStatus | msgspec.UnsetType = msgspec.UNSET


class ImageList(_Reply, frozen=True, kw_only=True):
    images: list[ImageView]
    next: str | None = None
    """The cursor of the next page; None after the last."""


class ImageDeleted(_Reply, frozen=True, kw_only=True):
    deleted: bool


class ImageSignerView(_Reply, frozen=True, kw_only=True):
    """An allowlisted signer: ``source`` ``config`` (``[images] signers`` or a plugin, written by
    every engine at start) or ``operator`` (``images.signers.add``; ``addedBy`` who)."""

    id: str
    algorithm: str
    source: Literal["config", "operator"]
    added_by: str | None
    since: str | None


class ImageSignerList(_Reply, frozen=True, kw_only=True):
    signers: list[ImageSignerView]
