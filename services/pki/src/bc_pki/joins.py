"""``agents.join`` and ``joins.list``: a machine spends a join token for a certificate; every try,
joined or refused, is audited."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Awaitable, Callable
from typing import Any

from cryptography.hazmat.primitives import serialization

from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id
from better_compute.logging import register_secret
from better_compute.service import ApiRequest, Database
from better_compute.service.killpoints import declare, kill_point
from better_compute.wire.paging import decode_cursor, take_page
from better_compute.wire.pki import (
    JOIN_EVENTS,
    JoinAccepted,
    JoinAuditList,
    JoinClaims,
    JoinRefused,
    JoinRequest,
    JoinResult,
    ListJoinsRequest,
)

from . import discovery, metrics, store
from ._errors import unauthenticated
from .burns import burn_token
from .ca import CertificateAuthority, parse_csr
from .tokens import mismatched_claims, normalize_claims, token_hash, well_formed

__all__ = ["AFTER_JOIN", "Joins"]

AFTER_JOIN = declare(
    "pki.after-join", "pki", "a join is committed (token spent, certificate stored) and not answered"
)


class Joins:
    """The join routes: check the token and the claims, issue the certificate, spend a use."""

    def __init__(
        self,
        *,
        db: Database,
        log: Any,
        ca: CertificateAuthority,
        cert_lifetime: dt.timedelta,
        instance: str,
        publish_event: Callable[[str, str, Any], Awaitable[None]],
    ) -> None:
        self.db = db
        self.log = log
        self.ca = ca
        self.cert_lifetime = cert_lifetime
        self.instance = instance
        self.publish_event = publish_event

    async def _audit_join(
        self,
        outcome: str,
        *,
        code: str | None = None,
        join_token_id: str | None = None,
        cert_id: str | None = None,
        agent_id: str | None = None,
        claims: JoinClaims | None = None,
        detail: str | None = None,
        conn: Any = None,
    ) -> None:
        metrics.JOINS.labels("accepted" if outcome == "joined" else "refused", outcome).inc()
        await (conn or self.db).execute(
            store.JOIN_AUDIT_INSERT,
            outcome,
            code,
            join_token_id,
            cert_id,
            agent_id,
            store.json_of(claims) if claims is not None else None,
            detail,
            self.instance,
        )

    async def join(self, req: ApiRequest) -> JoinResult:
        try:
            body = req.decode(JoinRequest)
            if not well_formed(body.token):
                raise BcError(ErrorCode.INVALID_INPUT, "not a join token", {"path": "token"})
            csr = parse_csr(body.csr)
        except BcError as err:
            await self._audit_join("malformed", code=err.code.value, detail=err.path)
            self.log.info("join_refused", outcome="malformed", path=err.path)
            await self.publish_event(
                JOIN_EVENTS, "unknown", JoinRefused(reason="malformed", code=err.code.value, at=time.time())
            )
            raise
        claims = normalize_claims(body.claims)
        refusal: BcError | None = None
        tok_id: str | None = None
        async with self.db.transaction() as conn:
            row = await conn.fetchrow(store.TOKEN_SELECT_FOR_JOIN, token_hash(body.token))
            if row is not None:
                tok_id = row["id"]
            refusal = self._refusal(row, claims) or discovery.refusal(row, claims, body.site_id)
            earlier = None
            if row is not None and row["uses"] > 0 and (refusal is None or refusal.reason == "token-used-up"):
                # the same join asked again (its answer was lost: the bc-pki that issued it died,
                # or the request timed out): the same key proves the same joiner, who gets the
                # certificate it already has; nothing is spent again, nothing burned (a token not
                # used yet has issued nothing: a first join does not look)
                earlier = await conn.fetchrow(store.CERT_OF_TOKEN_AND_KEY, row["id"], csr.public_key_der)
            if refusal is None or earlier is not None:
                register_secret(body.token)
                detail = None
                if earlier is not None:
                    refusal = None
                    result = self._result_of(earlier)
                    detail = "asked again with the same key: the certificate it already had"
                else:
                    result = await self._issue_cert(conn, row, csr, claims)
                    await conn.execute(store.TOKEN_SPEND, row["id"])
                await self._audit_join(
                    "joined",
                    join_token_id=row["id"],
                    cert_id=result.cert_id,
                    agent_id=result.agent_id,
                    claims=claims,
                    detail=detail,
                    conn=conn,
                )
        if refusal is not None:
            # The transaction above rolled nothing forward: a refused join spends no use.
            await self._audit_join(
                str(refusal.reason), code=refusal.code.value, join_token_id=tok_id, claims=claims
            )
            self.log.info("join_refused", outcome=refusal.reason, join_token_id=tok_id, code=refusal.code)
            await self.publish_event(
                JOIN_EVENTS,
                tok_id or "unknown",
                JoinRefused(
                    join_token_id=tok_id, reason=str(refusal.reason), code=refusal.code.value, at=time.time()
                ),
            )
            if refusal.reason == "token-used-up" and row is not None and row["node_id"] is not None:
                # a second join with a node's single-use token: one of the two is not the node
                await burn_token(self.db, self.publish_event, self.log, row, reason="second-join", mac=None)
            raise refusal
        kill_point(AFTER_JOIN)
        self.log.info(
            "agent_joined",
            join_token_id=result.join_token_id,
            agent_id=result.agent_id,
            cert_id=result.cert_id,
            role=result.role,
            site_id=result.site_id,
        )
        await self.publish_event(
            JOIN_EVENTS,
            result.join_token_id,
            JoinAccepted(
                join_token_id=result.join_token_id,
                agent_id=result.agent_id,
                cert_id=result.cert_id,
                role=result.role,
                site_id=result.site_id,
                at=time.time(),
            ),
        )
        return result

    @staticmethod
    def _refusal(row: Any, claims: JoinClaims) -> BcError | None:
        if row is None:
            return unauthenticated("token-unknown", "join token is not known")
        if row["revoked_at"] is not None:
            return unauthenticated("token-revoked", "join token was revoked")
        if row["expired"]:
            return unauthenticated("token-expired", "join token has expired")
        if row["uses"] >= row["max_uses"]:
            return unauthenticated("token-used-up", "join token has no uses left")
        wrong = mismatched_claims(store.token_info(row).expect, claims)
        if wrong:
            return BcError(
                ErrorCode.PERMISSION_DENIED,
                "hardware claims differ from what the token expects; the token was not spent",
                {"reason": "claims-mismatch", "claims": wrong},
            )
        return None

    def _result_of(self, cert: Any) -> JoinResult:
        """The join's answer for an issued certificate's row."""
        return JoinResult(
            cert_id=cert["id"],
            agent_id=cert["agent_id"],
            tenant_id=cert["tenant_id"],
            site_id=cert["site_id"],
            role=cert["role"],
            join_token_id=cert["join_token_id"],
            certificate_pem=cert["certificate_pem"],
            ca_pem=self.ca.certificate_pem,
            not_after=cert["not_after"],
        )

    async def _issue_cert(self, conn: Any, token: Any, csr: Any, claims: JoinClaims) -> JoinResult:
        ca = self.ca
        agent_id = await discovery.agent_id_for(conn, token, claims, csr.public_key_der)
        cert_id = new_id("cert")
        cert = ca.issue(
            csr,
            agent_id=agent_id,
            tenant_id=token["tenant_id"],
            site_id=token["site_id"],
            role=token["role"],
            lifetime=self.cert_lifetime,
            cert_id=cert_id,
        )
        pem = cert.public_bytes(serialization.Encoding.PEM).decode()
        await conn.execute(
            store.CERT_INSERT,
            cert_id,
            agent_id,
            token["tenant_id"],
            token["site_id"],
            token["role"],
            token["id"],
            format(cert.serial_number, "x"),
            csr.key_type,
            csr.public_key_der,
            pem,
            store.json_of(claims),
            cert.not_valid_before_utc,
            cert.not_valid_after_utc,
            # a held token's boot entry has not closed clean yet: whoever this is, not the node yet
            bool(token["held"]) and token["confirmed_at"] is None,
        )
        return JoinResult(
            cert_id=cert_id,
            agent_id=agent_id,
            tenant_id=token["tenant_id"],
            site_id=token["site_id"],
            role=token["role"],
            join_token_id=token["id"],
            certificate_pem=pem,
            ca_pem=ca.certificate_pem,
            not_after=cert.not_valid_after_utc,
        )

    async def list_joins(self, req: ApiRequest) -> JoinAuditList:
        body = req.decode(ListJoinsRequest)
        (before,) = decode_cursor(body.cursor, int) or (None,)
        rows = await self.db.fetch(
            store.JOIN_AUDIT_LIST, body.join_token_id, body.outcome, before, body.limit + 1
        )
        joins, next_ = take_page(
            [store.join_audit(r) for r in rows], limit=body.limit, key=lambda j: (j.id,),
            budget=req.page_budget,
        )  # fmt: skip
        return JoinAuditList(joins=joins, next=next_)
