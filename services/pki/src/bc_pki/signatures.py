"""``signatures.verify``: does a signature verify under a valid certificate of the signer (and, with
``once``, is it fresh and never seen before)."""

from __future__ import annotations

import hashlib
import time
from typing import Any

from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import parse_id
from better_compute.service import ApiRequest, Database
from better_compute.wire.pki import Verified, VerifyRequest

from . import store
from ._errors import unauthenticated
from .ca import signature_valid

__all__ = ["Signatures"]


FRESHNESS_MS = 120_000
"""With ``once``, a signature older or newer than this is refused (clock skew included)."""
SEEN_RETENTION_S = 2 * FRESHNESS_MS // 1000 + 60
"""Seen signed data is remembered past the freshness window, so no replay gets through."""


class Signatures:
    """The ``signatures.verify`` route (the service purges the seen signed data it remembers)."""

    def __init__(self, *, db: Database, log: Any) -> None:
        self.db = db
        self.log = log

    async def verify(self, req: ApiRequest) -> Verified:
        return await self.check(req.decode(VerifyRequest))

    async def check(self, body: VerifyRequest) -> Verified:
        """What ``signatures.verify`` answers, for bc-pki's own routes that take signed requests."""
        signer = parse_id(body.signer_id, path="signerId")
        if signer.startswith("cert_"):
            row = await self.db.fetchrow(store.CERT_SELECT_BY_ID, signer)
            rows = [row] if row is not None else []
        else:  # an agent id: agent_… or, for a node's bcd, the node_… id
            rows = await self.db.fetch(store.CERT_SELECT_BY_AGENT, signer)
        if body.once and body.signed_at_ms is None:
            raise BcError(ErrorCode.INVALID_INPUT, "once needs signedAtMs", {"path": "signedAtMs"})
        try:
            verified = await self._check_signature(rows, body)
        except BcError as err:
            self.log.info("signature_refused", signer_id=signer, reason=err.reason)
            raise
        return verified

    async def _check_signature(self, rows: list[Any], body: VerifyRequest) -> Verified:
        if not rows:
            raise unauthenticated("unknown-signer", "no certificate for this signer")
        usable = [r for r in rows if r["state"] == "valid"]
        if not usable:
            if any(r["state"] == "revoked" for r in rows):
                raise unauthenticated("cert-revoked", "the signer's certificate is revoked")
            if any(r["state"] == "pending" for r in rows):
                raise unauthenticated(
                    "cert-pending", "the signer's certificate is held until its boot entry closes clean"
                )
            raise unauthenticated("cert-expired", "the signer's certificate has expired")
        match = next(
            (r for r in usable if signature_valid(r["public_key"], body.data, body.signature)),
            None,
        )
        if match is None:
            raise unauthenticated("bad-signature", "signature does not verify")
        if body.once:
            assert body.signed_at_ms is not None
            if abs(time.time_ns() // 1_000_000 - body.signed_at_ms) > FRESHNESS_MS:
                raise unauthenticated("stale-signature", "signature is not recent enough")
            first = await self.db.fetchrow(
                store.SEEN_INSERT,
                match["agent_id"],
                hashlib.sha256(body.data).digest(),
                SEEN_RETENTION_S,
            )
            if first is None:
                raise unauthenticated("signature-replayed", "this signed data was already used")
        return Verified(
            cert_id=match["id"],
            agent_id=match["agent_id"],
            tenant_id=match["tenant_id"],
            site_id=match["site_id"],
            role=match["role"],
            join_token_id=match["join_token_id"],
        )
