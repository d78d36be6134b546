"""``certs.*``: reading, listing and revoking the certificates joins issued."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Awaitable, Callable
from typing import Any

from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import parse_id
from better_compute.service import ApiRequest, Database
from better_compute.wire.paging import decode_cursor, take_page
from better_compute.wire.pki import (
    CERT_EVENTS,
    CertIdRequest,
    CertificateInfo,
    CertificateList,
    CertRevoked,
    ListCertificatesRequest,
    RevokeCertificateRequest,
)

from . import store

__all__ = ["Certificates"]


class Certificates:
    """The ``certs.*`` routes; a revocation is published as a ``cert`` event."""

    def __init__(
        self, *, db: Database, log: Any, publish_event: Callable[[str, str, Any], Awaitable[None]]
    ) -> None:
        self.db = db
        self.log = log
        self.publish_event = publish_event

    async def get_cert(self, req: ApiRequest) -> CertificateInfo:
        cert_id = parse_id(req.decode(CertIdRequest).cert_id, "cert", path="certId")
        row = await self.db.fetchrow(store.CERT_SELECT_BY_ID, cert_id)
        if row is None:
            raise BcError(ErrorCode.NOT_FOUND, "no such certificate", {"path": "certId"})
        return store.cert_info(row)

    async def list_certs(self, req: ApiRequest) -> CertificateList:
        b = req.decode(ListCertificatesRequest)
        for i, cert_id in enumerate(b.cert_ids or ()):
            parse_id(cert_id, "cert", path=f"certIds[{i}]")
        at, ident = decode_cursor(b.cursor, dt.datetime, str) or (None, None)
        rows = await self.db.fetch(
            store.CERT_SELECT_LIST,
            b.tenant_id,
            b.site_id,
            b.agent_id,
            b.join_token_id,
            b.include_revoked,
            at,
            ident,
            b.limit + 1,
            b.cert_ids,
            b.role,
        )
        certs, next_ = take_page(
            [store.cert_info(r) for r in rows], limit=b.limit, key=lambda c: (c.created_at, c.cert_id),
            budget=req.page_budget,
        )  # fmt: skip
        return CertificateList(certificates=certs, next=next_)

    async def revoke_cert(self, req: ApiRequest) -> CertificateInfo:
        body = req.decode(RevokeCertificateRequest)
        cert_id = parse_id(body.cert_id, "cert", path="certId")
        row = await self.db.fetchrow(store.CERT_REVOKE, cert_id, body.reason)
        if row is None:
            row = await self.db.fetchrow(store.CERT_SELECT_BY_ID, cert_id)
            if row is None:
                raise BcError(ErrorCode.NOT_FOUND, "no such certificate", {"path": "certId"})
            return store.cert_info(row)
        info = store.cert_info(row)
        self.log.info("certificate_revoked", cert_id=cert_id, agent_id=info.agent_id)
        await self.publish_event(CERT_EVENTS, cert_id, CertRevoked(cert_id=cert_id, at=time.time()))
        return info
