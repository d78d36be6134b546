"""The bc-pki service process: CA, join tokens, joins, certificates, signature checks."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import secrets
import time
from collections.abc import Mapping
from typing import Any, ClassVar

from cryptography.hazmat.primitives import serialization

from better_compute.config import Settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id, parse_id
from better_compute.keyring import Keyring, load_service_keyring
from better_compute.logging import register_secret
from better_compute.service import ApiRequest, Handler, Service
from better_compute.service.fences import attempt_superseded
from better_compute.wire.paging import decode_cursor, take_page
from better_compute.wire.pki import (
    CaInfo,
    CertIdRequest,
    CertificateInfo,
    CertificateList,
    IssuedJoinToken,
    IssueJoinTokenRequest,
    JoinAuditList,
    JoinClaims,
    JoinRequest,
    JoinResult,
    JoinTokenIdRequest,
    JoinTokenInfo,
    JoinTokenList,
    ListCertificatesRequest,
    ListJoinsRequest,
    ListJoinTokensRequest,
    RevokeAttempt,
    RevokeCertificateRequest,
    RevokedAttempt,
    RevokeJoinTokenRequest,
    RewrapResult,
    Verified,
    VerifyRequest,
)

from . import discovery, store
from .ca import CertificateAuthority, parse_csr, signature_valid
from .tokens import (
    derived_token,
    mismatched_claims,
    normalize_claims,
    normalize_expect,
    random_token,
    same_token,
    token_hash,
    well_formed,
)

__all__ = ["PkiService"]

_CA_KEY_AAD = b"bc-pki:ca:key"
_TOKEN_KEY_AAD = b"bc-pki:ca:token-key"

FRESHNESS_MS = 120_000
"""With ``once``, a signature older or newer than this is refused (clock skew included)."""
SEEN_RETENTION_S = 2 * FRESHNESS_MS // 1000 + 60
"""Seen signed data is remembered past the freshness window, so no replay gets through."""


def _unauthenticated(reason: str, message: str) -> BcError:
    return BcError(ErrorCode.UNAUTHENTICATED, message, {"reason": reason})


class PkiService(Service):
    """PKI: certificate authority, join tokens, joins, signature verification"""

    name: ClassVar[str] = "bc-pki"
    api_name: ClassVar[str] = "pki"
    schema: ClassVar[str | None] = "pki"
    migrations_package: ClassVar[str | None] = "bc_pki.migrations"
    description: ClassVar[str] = "PKI: certificate authority, join tokens, joins, signature verification"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.keyring: Keyring | None = None
        self.ca: CertificateAuthority | None = None
        self.ca_created_at: dt.datetime | None = None
        self._token_key = b""
        self.cert_lifetime = dt.timedelta(milliseconds=settings.pki.cert_ttl.ms)

    # -- start ------------------------------------------------------------------

    async def on_start(self) -> None:
        self.keyring = load_service_keyring(self.settings, self.settings.pki.key_file, "pki", self.log)
        await self._load_ca()

    async def _load_ca(self) -> None:
        assert self.db is not None
        assert self.keyring is not None
        async with self.db.transaction() as conn:
            # Instances starting together: the first creates the CA, the others wait and load it.
            await conn.execute(store.CA_LOCK)
            row = await conn.fetchrow(store.CA_SELECT)
            if row is None:
                ca = CertificateAuthority.create(name=f"Better Compute CA {secrets.token_hex(4)}")
                await conn.execute(
                    store.CA_INSERT,
                    ca.certificate_pem,
                    ca.fingerprint,
                    self.keyring.seal(ca.key_pem(), aad=_CA_KEY_AAD),
                    self.keyring.seal(secrets.token_bytes(32), aad=_TOKEN_KEY_AAD),
                )
                self.log.info("ca_created", fingerprint=ca.fingerprint)
                row = await conn.fetchrow(store.CA_SELECT)
        self.ca = CertificateAuthority.load(
            row["certificate_pem"], self.keyring.open(row["key_sealed"], aad=_CA_KEY_AAD)
        )
        self._token_key = self.keyring.open(row["token_key_sealed"], aad=_TOKEN_KEY_AAD)
        self.ca_created_at = row["created_at"]
        self.log.info("ca_loaded", fingerprint=self.ca.fingerprint)

    def routes(self) -> Mapping[str, Handler]:
        return {
            "tokens.issue": self.issue_token,
            "tokens.list": self.list_tokens,
            "tokens.get": self.get_token,
            "tokens.revoke": self.revoke_token,
            "tokens.revoke_attempt": self.revoke_attempt,
            "agents.join": self.join,
            "joins.list": self.list_joins,
            "signatures.verify": self.verify,
            "certs.get": self.get_cert,
            "certs.list": self.list_certs,
            "certs.revoke": self.revoke_cert,
            "ca.get": self.get_ca,
            "keys.rewrap": self.rewrap,
        }

    def side_loops(self) -> Mapping[str, Any]:
        return {"purge_seen_signatures": self._purge_seen}

    async def _purge_seen(self) -> None:
        assert self.db is not None
        while True:
            await self.db.execute(store.SEEN_PURGE)
            await asyncio.sleep(60.0)

    @property
    def _ca(self) -> CertificateAuthority:
        if self.ca is None:
            raise BcError(ErrorCode.UNAVAILABLE, "the CA is not loaded yet")
        return self.ca

    # -- join tokens --------------------------------------------------------------

    async def issue_token(self, req: ApiRequest) -> IssuedJoinToken:
        assert self.db is not None
        body = req.decode(IssueJoinTokenRequest)
        if body.node_id is not None:
            if body.role not in ("node", "provisioned"):
                raise BcError(
                    ErrorCode.INVALID_INPUT,
                    "only node and provisioned tokens are bound to a node",
                    {"path": "nodeId"},
                )
            parse_id(body.node_id, "node", path="nodeId")
        expect = normalize_expect(body.expect)
        ikey, mint_secret = body.idempotency_key, body.mint_secret
        if mint_secret is not None and ikey is None:
            raise BcError(
                ErrorCode.INVALID_INPUT, "mintSecret goes with an idempotencyKey", {"path": "mintSecret"}
            )
        # Derived only from the token key (here) and the caller's mint secret (there): the
        # idempotency key a listing shows gives nobody the token.
        token = derived_token(self._token_key, ikey, mint_secret) if ikey and mint_secret else random_token()
        register_secret(token)
        row = await self.db.fetchrow(
            store.TOKEN_INSERT,
            new_id("tok"),
            token_hash(token),
            ikey,
            body.tenant_id,
            body.role,
            body.site_id,
            body.node_id,
            store.json_of(expect),
            body.ttl_seconds,
            body.max_uses,
            body.note,
        )
        found = row is None
        if found:
            row = await self.db.fetchrow(store.TOKEN_SELECT_BY_IDEMPOTENCY_KEY, ikey)
            if row is None:  # a random 256-bit token collided: never in practice
                raise BcError(ErrorCode.CONFLICT, "token collision; issue again")
            self._same_parameters(store.token_info(row), body, expect)
        if ikey is not None and await store.FENCES.revoke_if_fenced(
            self.db, ikey, row["id"], "minted by a superseded step attempt"
        ):
            self.log.warning("join_token_refused_superseded", join_token_id=row["id"])
            raise attempt_superseded("mints")
        if found and not same_token(token, row["token_hash"]):
            # Issued before, and this caller cannot make the same token: it is not the step
            # attempt that minted it (another mint secret, or none). It gets the id, never the token.
            self.log.warning("join_token_refused_already_issued", join_token_id=row["id"])
            raise BcError(
                ErrorCode.CONFLICT,
                "a join token was already issued under this idempotency key; it is shown once,"
                " and again only to the workflow step attempt that minted it",
                {"path": "idempotencyKey", "reason": "already-issued", "joinTokenId": row["id"]},
            )
        info = store.token_info(row)
        self.log.info(
            "join_token_issued",
            join_token_id=info.join_token_id,
            tenant_id=info.tenant_id,
            role=info.role,
            site_id=info.site_id,
            max_uses=info.max_uses,
            again=found,
        )
        return IssuedJoinToken(
            join_token_id=info.join_token_id,
            token=token,
            tenant_id=info.tenant_id,
            role=info.role,
            site_id=info.site_id,
            max_uses=info.max_uses,
            expires_at=info.expires_at,
        )

    @staticmethod
    def _same_parameters(info: JoinTokenInfo, body: IssueJoinTokenRequest, expect: Any) -> None:
        first = (info.tenant_id, info.role, info.site_id, info.node_id, info.max_uses, info.expect)
        again = (body.tenant_id, body.role, body.site_id, body.node_id, body.max_uses, expect)
        if first != again:
            raise BcError(
                ErrorCode.CONFLICT,
                "idempotency key already used for a token with other parameters",
                {"path": "idempotencyKey", "joinTokenId": info.join_token_id},
            )

    async def list_tokens(self, req: ApiRequest) -> JoinTokenList:
        assert self.db is not None
        body = req.decode(ListJoinTokensRequest)
        at, ident = decode_cursor(body.cursor, dt.datetime, str) or (None, None)
        rows = await self.db.fetch(
            store.TOKEN_LIST, body.tenant_id, body.site_id, body.state, at, ident, body.limit + 1
        )
        tokens, next_ = take_page(
            [store.token_info(r) for r in rows], limit=body.limit,
            key=lambda t: (t.created_at, t.join_token_id), budget=req.page_budget,
        )  # fmt: skip
        return JoinTokenList(tokens=tokens, next=next_)

    async def get_token(self, req: ApiRequest) -> JoinTokenInfo:
        assert self.db is not None
        body = req.decode(JoinTokenIdRequest)
        tok_id = parse_id(body.join_token_id, "tok", path="joinTokenId")
        row = await self.db.fetchrow(store.TOKEN_SELECT_BY_ID, tok_id)
        if row is None:
            raise BcError(ErrorCode.NOT_FOUND, "no such join token", {"path": "joinTokenId"})
        return store.token_info(row)

    async def revoke_token(self, req: ApiRequest) -> JoinTokenInfo:
        assert self.db is not None
        body = req.decode(RevokeJoinTokenRequest)
        tok_id = parse_id(body.join_token_id, "tok", path="joinTokenId")
        row = await self.db.fetchrow(store.TOKEN_REVOKE, tok_id, body.reason)
        if row is None:
            row = await self.db.fetchrow(store.TOKEN_SELECT_BY_ID, tok_id)
            if row is None:
                raise BcError(ErrorCode.NOT_FOUND, "no such join token", {"path": "joinTokenId"})
        else:
            self.log.info("join_token_revoked", join_token_id=tok_id)
        return store.token_info(row)

    async def revoke_attempt(self, req: ApiRequest) -> RevokedAttempt:
        """Revoke every token one workflow step attempt minted, and fence its key."""
        assert self.db is not None
        body = req.decode(RevokeAttempt)
        prefix, revoked = await store.FENCES.fence(
            self.db, workflow_id=body.workflow_id, step=body.step, attempt=body.attempt, reason=body.reason
        )
        if revoked:
            self.log.info("join_tokens_revoked", key=prefix, join_token_ids=revoked)
        return RevokedAttempt(revoked=revoked)

    # -- joins --------------------------------------------------------------------

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
        assert self.db is not None
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
        assert self.db is not None
        try:
            body = req.decode(JoinRequest)
            if not well_formed(body.token):
                raise BcError(ErrorCode.INVALID_INPUT, "not a join token", {"path": "token"})
            csr = parse_csr(body.csr)
        except BcError as err:
            await self._audit_join("malformed", code=err.code.value, detail=err.path)
            self.log.info("join_refused", outcome="malformed", path=err.path)
            raise
        claims = normalize_claims(body.claims)
        refusal: BcError | None = None
        tok_id: str | None = None
        async with self.db.transaction() as conn:
            row = await conn.fetchrow(store.TOKEN_SELECT_FOR_JOIN, token_hash(body.token))
            if row is not None:
                tok_id = row["id"]
            refusal = self._refusal(row, claims) or discovery.refusal(row, claims, body.site_id)
            if refusal is None:
                register_secret(body.token)
                result = await self._issue_cert(conn, row, csr, claims)
                await conn.execute(store.TOKEN_SPEND, row["id"])
                await self._audit_join(
                    "joined",
                    join_token_id=row["id"],
                    cert_id=result.cert_id,
                    agent_id=result.agent_id,
                    claims=claims,
                    conn=conn,
                )
        if refusal is not None:
            # The transaction above rolled nothing forward: a refused join spends no use.
            await self._audit_join(
                str(refusal.reason), code=refusal.code.value, join_token_id=tok_id, claims=claims
            )
            self.log.info("join_refused", outcome=refusal.reason, join_token_id=tok_id, code=refusal.code)
            raise refusal
        self.log.info(
            "agent_joined",
            join_token_id=result.join_token_id,
            agent_id=result.agent_id,
            cert_id=result.cert_id,
            role=result.role,
            site_id=result.site_id,
        )
        await self.publish_event(
            "join",
            result.join_token_id,
            {
                "joinTokenId": result.join_token_id,
                "agentId": result.agent_id,
                "certId": result.cert_id,
                "role": result.role,
            },
        )
        return result

    @staticmethod
    def _refusal(row: Any, claims: JoinClaims) -> BcError | None:
        if row is None:
            return _unauthenticated("token-unknown", "join token is not known")
        if row["revoked_at"] is not None:
            return _unauthenticated("token-revoked", "join token was revoked")
        if row["expired"]:
            return _unauthenticated("token-expired", "join token has expired")
        if row["uses"] >= row["max_uses"]:
            return _unauthenticated("token-used-up", "join token has no uses left")
        wrong = mismatched_claims(store.token_info(row).expect, claims)
        if wrong:
            return BcError(
                ErrorCode.PERMISSION_DENIED,
                "hardware claims differ from what the token expects; the token was not spent",
                {"reason": "claims-mismatch", "claims": wrong},
            )
        return None

    async def _issue_cert(self, conn: Any, token: Any, csr: Any, claims: JoinClaims) -> JoinResult:
        ca = self._ca
        agent_id = await discovery.agent_id_for(conn, token, claims)
        cert_id = new_id("cert")
        cert = ca.issue(
            csr,
            agent_id=agent_id,
            tenant_id=token["tenant_id"],
            site_id=token["site_id"],
            role=token["role"],
            lifetime=self.cert_lifetime,
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
        assert self.db is not None
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

    # -- signatures ---------------------------------------------------------------

    async def verify(self, req: ApiRequest) -> Verified:
        assert self.db is not None
        body = req.decode(VerifyRequest)
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
        assert self.db is not None
        if not rows:
            raise _unauthenticated("unknown-signer", "no certificate for this signer")
        usable = [r for r in rows if r["state"] == "valid"]
        if not usable:
            if any(r["state"] == "revoked" for r in rows):
                raise _unauthenticated("cert-revoked", "the signer's certificate is revoked")
            raise _unauthenticated("cert-expired", "the signer's certificate has expired")
        match = next(
            (r for r in usable if signature_valid(r["public_key"], body.data, body.signature)),
            None,
        )
        if match is None:
            raise _unauthenticated("bad-signature", "signature does not verify")
        if body.once:
            assert body.signed_at_ms is not None
            if abs(time.time_ns() // 1_000_000 - body.signed_at_ms) > FRESHNESS_MS:
                raise _unauthenticated("stale-signature", "signature is not recent enough")
            first = await self.db.fetchrow(
                store.SEEN_INSERT,
                match["agent_id"],
                hashlib.sha256(body.data).digest(),
                SEEN_RETENTION_S,
            )
            if first is None:
                raise _unauthenticated("signature-replayed", "this signed data was already used")
        return Verified(
            cert_id=match["id"],
            agent_id=match["agent_id"],
            tenant_id=match["tenant_id"],
            site_id=match["site_id"],
            role=match["role"],
            join_token_id=match["join_token_id"],
        )

    # -- certificates -------------------------------------------------------------

    async def get_cert(self, req: ApiRequest) -> CertificateInfo:
        assert self.db is not None
        cert_id = parse_id(req.decode(CertIdRequest).cert_id, "cert", path="certId")
        row = await self.db.fetchrow(store.CERT_SELECT_BY_ID, cert_id)
        if row is None:
            raise BcError(ErrorCode.NOT_FOUND, "no such certificate", {"path": "certId"})
        return store.cert_info(row)

    async def list_certs(self, req: ApiRequest) -> CertificateList:
        assert self.db is not None
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
        assert self.db is not None
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
        await self.publish_event("cert", cert_id, {"certId": cert_id, "state": "revoked"})
        return info

    # -- CA and keys --------------------------------------------------------------

    async def get_ca(self, _req: ApiRequest) -> CaInfo:
        ca = self._ca
        assert self.ca_created_at is not None
        return CaInfo(
            certificate_pem=ca.certificate_pem,
            fingerprint_sha256=ca.fingerprint,
            created_at=self.ca_created_at,
        )

    async def rewrap(self, _req: ApiRequest) -> RewrapResult:
        """Re-seal the CA key and the token key under the key file's current key."""
        assert self.db is not None
        assert self.keyring is not None
        ring = self.keyring
        async with self.db.transaction() as conn:
            await conn.execute(store.CA_LOCK)
            row = await conn.fetchrow(store.CA_SELECT)
            key = ring.reseal(row["key_sealed"], aad=_CA_KEY_AAD)
            token_key = ring.reseal(row["token_key_sealed"], aad=_TOKEN_KEY_AAD)
            count = (key is not None) + (token_key is not None)
            if count:
                await conn.execute(
                    store.CA_UPDATE_SEALED,
                    key or row["key_sealed"],
                    token_key or row["token_key_sealed"],
                )
        self.log.info("keys_rewrapped", key_id=ring.current_key_id, rewrapped=count)
        return RewrapResult(key_id=ring.current_key_id, rewrapped=count)
