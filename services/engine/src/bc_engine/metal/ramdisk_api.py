"""``bc.api.engine.ramdisk.*``: the bcd ramdisk an operator sets while the engines run.

``ramdisk.set`` stores it in ``ramdisk_override`` (one row, shared by every engine); the
``metal.ensureRamdisk`` step reads it at each run, so the next verb boots it with no restart: the
shipped lifecycle profiles over ``[ramdisk]`` of bc.toml and ``metal(ramdisk=…)``, any other
profile when its step names no ramdisk (``better_compute.metal.steps.ramdisk``). ``ramdisk.clear``
goes back to the profiles' own.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any, Final

import msgspec

from better_compute.core.errors import BcError, ErrorCode
from better_compute.service import ApiRequest
from better_compute.service.audit import requester
from better_compute.wire.metal import ClearRamdisk, GetRamdisk, RamdiskView, SetRamdisk

__all__ = ["RamdiskApi"]

_SET: Final = (
    "INSERT INTO ramdisk_override (id, doc, set_by) VALUES (1, $1::jsonb, $2)"
    " ON CONFLICT (id) DO UPDATE SET doc = EXCLUDED.doc, set_by = EXCLUDED.set_by, updated_at = now()"
    " RETURNING doc, set_by, updated_at"
)
_GET: Final = "SELECT doc, set_by, updated_at FROM ramdisk_override WHERE id = 1"
_CLEAR: Final = "DELETE FROM ramdisk_override WHERE id = 1 RETURNING doc, set_by, updated_at"


def _view(row: Any) -> RamdiskView:
    if row is None:
        return RamdiskView(set=False)
    doc = row["doc"]
    doc = json.loads(doc) if isinstance(doc, str) else doc
    at = row["updated_at"]
    return RamdiskView(
        set=True, kernel=doc.get("kernel"), initrd=doc.get("initrd"), kernel_sha256=doc.get("kernelSha256"),
        initrd_sha256=doc.get("initrdSha256"), cmdline=doc.get("cmdline"), script=doc.get("script"),
        set_by=row["set_by"], since=at.isoformat() if isinstance(at, datetime) else None,
    )  # fmt: skip


class RamdiskApi:
    def __init__(self, db: Any) -> None:
        self.db = db

    def routes(self) -> dict[str, Callable[[ApiRequest], Awaitable[Any]]]:
        return {"ramdisk.set": self.set, "ramdisk.get": self.get, "ramdisk.clear": self.clear}

    async def set(self, req: ApiRequest) -> RamdiskView:
        body = req.decode(SetRamdisk)
        if (body.kernel is None) == (body.script is None):
            raise BcError(
                ErrorCode.INVALID_INPUT, "give the kernel (and initrd) or an iPXE script, not both",
                {"path": "kernel"},
            )  # fmt: skip
        if body.script is not None and (body.initrd or body.kernel_sha256 or body.initrd_sha256):
            raise BcError(ErrorCode.INVALID_INPUT, "a script takes no initrd or sha256s", {"path": "script"})
        doc = {k: v for k, v in msgspec.to_builtins(body).items() if v is not None}
        row = await self.db.fetchrow(_SET, json.dumps(doc), requester(req.headers).actor or "unknown")
        return _view(row)

    async def get(self, req: ApiRequest) -> RamdiskView:
        req.decode(GetRamdisk)
        return _view(await self.db.fetchrow(_GET))

    async def clear(self, req: ApiRequest) -> RamdiskView:
        req.decode(ClearRamdisk)
        await self.db.fetchrow(_CLEAR)
        return RamdiskView(set=False)
