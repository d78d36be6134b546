"""``bc.api.engine.images.*``: the image catalog (register, list, get, delete), and the signer
allowlist every engine writes from ``[images] signers`` at start.

A registration is checked where it enters: the signer must be allowlisted (``PERMISSION_DENIED``,
reason ``unknown-signer``, at ``signer``) and its signature over the image's signing payload
(name, version, digest, URL) must verify (``PERMISSION_DENIED``, reason ``bad-signature``, at
``signature``; ``digest-only-signature`` for one over the digest alone); an app's ``image_verifier``
decides instead when it has one. Resolving for a deploy checks again (better_compute.metal.images).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime
from typing import Any, Final

import msgspec

from better_compute.app import App
from better_compute.config import ImagesSettings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.metal.images import (
    RESOLVE_IMAGE,
    check_image_signer,
    digest_only_refusal,
    parse_image_ref,
)
from better_compute.metal.signatures import (
    ImageSigner,
    image_signer,
    image_signing_payload,
    is_digest_only_signature,
    verify_image_signature,
)
from better_compute.provision.module import ImageVerifier
from better_compute.service import ApiRequest
from better_compute.service.audit import requester
from better_compute.wire.images import (
    AddImageSigner,
    DeleteImage,
    GetImage,
    ImageDeleted,
    ImageList,
    ImageSignerList,
    ImageSignerView,
    ImageView,
    ListImages,
    ListImageSigners,
    RegisterImage,
    RemoveImageSigner,
    SignerStatus,
)
from better_compute.wire.paging import decode_cursor, take_page

from . import images_store

__all__ = ["ImagesApi", "allowlist", "image_signers", "write_image_signers"]

_IMMUTABLE: Final = ("url", "sha256", "format", "size", "signer", "signature", "public")


def image_signers(settings: ImagesSettings) -> list[ImageSigner]:
    """The allowlist of ``[images] signers``, each key checked.

    Raises:
        BcError: ``INVALID_CONFIG`` at ``images.signers[i].publicKey`` (or ``.id``, or a
            signer given twice).
    """
    found: list[ImageSigner] = []
    for index, entry in enumerate(settings.signers):
        path = f"images.signers[{index}]"
        signer = image_signer(entry.id, entry.public_key, path=path)
        if any(s.id == signer.id for s in found):
            raise BcError(
                ErrorCode.INVALID_CONFIG, f"signer {signer.id} is given twice", {"path": f"{path}.id"}
            )
        found.append(signer)
    return found


def allowlist(app: App, configured: list[ImageSigner]) -> list[ImageSigner]:
    """``[images] signers`` and the plugins' image signers; one id in both is ``INVALID_CONFIG``."""
    ids = {s.id for s in configured}
    for index, signer in enumerate(configured):
        if signer.id in app.image_signers:
            raise BcError(
                ErrorCode.INVALID_CONFIG,
                f"signer {signer.id} is given by [images] signers and by a plugin (bcx plugins list)",
                {"path": f"images.signers[{index}].id"},
            )
    return [*configured, *(s for s in app.image_signers.values() if s.id not in ids)]


async def write_image_signers(db: Any, signers: list[ImageSigner]) -> None:
    """Make the catalog's allowlist ``signers`` (one transaction)."""
    async with db.transaction() as conn:
        await conn.execute(images_store.LOCK_SIGNERS)
        await conn.execute(images_store.DROP_OTHER_SIGNERS, [s.id for s in signers])
        await conn.execute(
            images_store.UPSERT_SIGNERS,
            [s.id for s in signers],
            [s.algorithm for s in signers],
            [s.public_key for s in signers],
        )


def _iso(value: Any) -> str | None:
    return value.isoformat() if isinstance(value, datetime) else None


def image_doc(
    row: Mapping[str, Any], signer_status: SignerStatus | msgspec.UnsetType = msgspec.UNSET
) -> ImageView:
    """An image as the API shows it (the signature stays in the catalog)."""
    return ImageView(
        tenant_id=row["tenant_id"],
        name=row["name"],
        version=row["version"],
        ref=f"{row['name']}@{row['version']}",
        public=row["public"],
        url=row["url"],
        sha256=row["sha256"],
        format=row["format"],
        size=row["size"],
        signer=row["signer"],
        created_at=_iso(row["created_at"]),
        signer_status=signer_status,
    )


def _signer_view(row: Mapping[str, Any]) -> ImageSignerView:
    return ImageSignerView(
        id=row["id"], algorithm=row["algorithm"], source="operator" if row["added_by"] else "config",
        added_by=row["added_by"], since=_iso(row["updated_at"]),
    )  # fmt: skip


def _verifier(app: App) -> ImageVerifier | None:
    return app.provision.image_verifier if app.provision is not None else None


class ImagesApi:
    def __init__(self, *, app: App, db: Any) -> None:
        self.app = app
        self.db = db

    def routes(self) -> dict[str, Callable[[ApiRequest], Awaitable[Any]]]:
        return {
            "images.register": self.register,
            "images.list": self.list,
            "images.get": self.get,
            "images.delete": self.delete,
            "images.signers.add": self.add_signer,
            "images.signers.remove": self.remove_signer,
            "images.signers.list": self.list_signers,
        }

    async def _check_signature(self, body: RegisterImage) -> str | None:
        """The signer to record (``None`` when the app's verifier accepted the image)."""
        image = {"name": body.name, "version": body.version, "sha256": body.sha256, "url": body.url}
        verifier = _verifier(self.app)
        if verifier is not None:
            accepted = await verifier(
                tenant_id=body.tenant_id, digest=body.sha256, signature=body.signature, name=body.name,
                version=body.version, url=body.url, payload=image_signing_payload(**image),
            )  # fmt: skip
            if not accepted:
                raise BcError(
                    ErrorCode.PERMISSION_DENIED,
                    "the app's image_verifier refuses this image's signature",
                    {"path": "signature", "reason": "bad-signature"},
                )
            return None
        if body.signer is None:
            raise BcError(ErrorCode.INVALID_INPUT, "name the allowlisted signer", {"path": "signer"})
        row = await self.db.fetchrow(images_store.SIGNER, body.signer)
        if row is None:
            raise BcError(
                ErrorCode.PERMISSION_DENIED,
                f"{body.signer} is not an allowlisted image signer ([images] signers, or bcx images"
                " signers add)",
                {"path": "signer", "reason": "unknown-signer"},
            )
        signer = ImageSigner(row["id"], row["algorithm"], bytes(row["public_key"]))
        if not verify_image_signature(signer, body.signature, **image):
            if is_digest_only_signature(signer, body.sha256, body.signature):
                ref = f"{body.name}@{body.version}"
                raise digest_only_refusal(ErrorCode.PERMISSION_DENIED, ref, "signature", signer.id)
            raise BcError(
                ErrorCode.PERMISSION_DENIED,
                f"the signature is not {signer.id}'s over the signing payload of"
                f" {body.name}@{body.version} (sha256 {body.sha256}, url {body.url})",
                {"path": "signature", "reason": "bad-signature"},
            )
        return signer.id

    async def register(self, req: ApiRequest) -> ImageView:
        body = req.decode(RegisterImage)
        signer = await self._check_signature(body)
        values = (body.url, body.sha256, body.format, body.size, signer, body.signature, body.public)
        key = (body.tenant_id, body.name, body.version)
        row = await self.db.fetchrow(images_store.INSERT_IMAGE, *key, *values)
        if row is None:
            row = await self.db.fetchrow(images_store.OWN_IMAGE, *key)
            if (
                row is not None
                and tuple(bytes(row[f]) if f == "signature" else row[f] for f in _IMMUTABLE) != values
            ):
                raise BcError(
                    ErrorCode.CONFLICT,
                    f"image {body.name}@{body.version} exists with other contents: images are"
                    " immutable, register a new version",
                    {"path": "version"},
                )
        if row is None:  # deleted in between: the caller may try again
            raise BcError(ErrorCode.CONFLICT, "the image changed meanwhile, try again", {"path": "version"})
        return image_doc(row)

    async def get(self, req: ApiRequest) -> ImageView:
        body = req.decode(GetImage)
        name, version = parse_image_ref(body.ref, path="ref")
        row = await self.db.fetchrow(RESOLVE_IMAGE, body.tenant_id, name, version)
        if row is None:
            raise BcError(
                ErrorCode.NOT_FOUND,
                f"no image {body.ref} in tenant {body.tenant_id} nor a public one",
                {"path": "ref"},
            )
        if _verifier(self.app) is not None:
            return image_doc(row, "verifier")
        try:
            await check_image_signer(row, tenant_id=body.tenant_id)
        except BcError as err:
            return image_doc(row, "removed" if err.reason == "signer-removed" else "bad-signature")
        return image_doc(row, "allowlisted")

    async def list(self, req: ApiRequest) -> ImageList:
        body = req.decode(ListImages)
        after = decode_cursor(body.cursor, str, str, str)
        rows = await self.db.fetch(
            images_store.LIST_IMAGES,
            body.tenant_id,
            body.name,
            *(after or (None, None, None)),
            body.limit + 1,
        )
        verifier = _verifier(self.app) is not None
        docs = [
            image_doc(row, "verifier" if verifier else "allowlisted" if row["allowlisted"] else "removed")
            for row in rows
        ]
        page, next_ = take_page(
            docs, limit=body.limit, key=lambda d: (d.name, d.version, d.tenant_id), budget=req.page_budget
        )
        return ImageList(images=page, next=next_)

    # -- the signer allowlist, changed while the engines run ---------------------------------

    async def add_signer(self, req: ApiRequest) -> ImageSignerView:
        """An operator's signer: in the shared allowlist at once, so every engine's next
        registration and deploy accept it (``CONFLICT`` when the id is allowlisted already)."""
        body = req.decode(AddImageSigner)
        try:
            signer = image_signer(body.id, body.public_key, path="signer", code=ErrorCode.INVALID_INPUT)
        except BcError as err:  # the request's own fields: id, publicKey
            path = str(err.details.get("path", "")).removeprefix("signer.")
            raise BcError(err.code, err.message, {**err.details, "path": path}) from None
        row = await self.db.fetchrow(
            images_store.ADD_SIGNER, signer.id, signer.algorithm, signer.public_key,
            requester(req.headers).actor or "unknown",
        )  # fmt: skip
        if row is None:
            raise BcError(
                ErrorCode.CONFLICT,
                f"{body.id} is an allowlisted signer already (bcx images signers list); remove it first"
                " to give it another key",
                {"path": "id", "reason": "signer-exists"},
            )
        return _signer_view(row)

    async def remove_signer(self, req: ApiRequest) -> ImageSignerView:
        """Take an operator's signer off the allowlist: its images stop resolving at once. A
        configured one is removed from ``[images] signers`` (``INVALID_STATE``)."""
        body = req.decode(RemoveImageSigner)
        row = await self.db.fetchrow(images_store.REMOVE_SIGNER, body.id)
        if row is not None:
            return _signer_view(row)
        if await self.db.fetchrow(images_store.SIGNER_ROW, body.id) is not None:
            raise BcError(
                ErrorCode.INVALID_STATE,
                f"{body.id} is configured ([images] signers or a plugin): remove it there; every engine"
                " drops it at its next start",
                {"path": "id", "reason": "configured-signer"},
            )
        raise BcError(ErrorCode.NOT_FOUND, f"no allowlisted signer {body.id}", {"path": "id"})

    async def list_signers(self, req: ApiRequest) -> ImageSignerList:
        req.decode(ListImageSigners)
        rows = await self.db.fetch(images_store.LIST_SIGNERS)
        return ImageSignerList(signers=[_signer_view(r) for r in rows])

    async def delete(self, req: ApiRequest) -> ImageDeleted:
        body = req.decode(DeleteImage)
        name, version = parse_image_ref(body.ref, path="ref")
        if await self.db.fetchrow(images_store.DELETE_IMAGE, body.tenant_id, name, version) is None:
            raise BcError(
                ErrorCode.NOT_FOUND, f"tenant {body.tenant_id} has no image {body.ref}", {"path": "ref"}
            )
        return ImageDeleted(deleted=True)
