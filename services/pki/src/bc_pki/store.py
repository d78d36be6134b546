"""The pki schema's statements, and rows turned into messages."""

from __future__ import annotations

from typing import Any, Final

import msgspec

from better_compute.service.fences import AttemptFences
from better_compute.wire.pki import (
    CertificateInfo,
    JoinAudit,
    JoinClaims,
    JoinExpect,
    JoinTokenInfo,
)

__all__ = [
    "CA_INSERT",
    "CA_LOCK",
    "CA_SELECT",
    "CA_UPDATE_SEALED",
    "CERT_COLUMNS",
    "CERT_CONFIRM_OF_TOKEN",
    "CERT_INSERT",
    "CERT_OF_TOKEN_AND_KEY",
    "CERT_REVOKE",
    "CERT_SELECT_BY_AGENT",
    "CERT_SELECT_BY_ID",
    "CERT_SELECT_LIST",
    "FENCES",
    "JOIN_AUDIT_INSERT",
    "JOIN_AUDIT_LIST",
    "SEEN_INSERT",
    "SEEN_PURGE",
    "TOKEN_COLUMNS",
    "TOKEN_CONFIRM",
    "TOKEN_INSERT",
    "TOKEN_LIST",
    "TOKEN_REVOKE",
    "TOKEN_SELECT_BY_ID",
    "TOKEN_SELECT_BY_IDEMPOTENCY_KEY",
    "TOKEN_SELECT_FOR_JOIN",
    "TOKEN_SPEND",
    "cert_info",
    "join_audit",
    "json_of",
    "token_info",
]

CA_LOCK: Final = "SELECT pg_advisory_xact_lock(hashtext('bc-pki:ca'))"
CA_SELECT: Final = (
    "SELECT certificate_pem, fingerprint_sha256, key_sealed, token_key_sealed, created_at"
    " FROM ca WHERE id = 1"
)
CA_INSERT: Final = (
    "INSERT INTO ca (id, certificate_pem, fingerprint_sha256, key_sealed, token_key_sealed)"
    " VALUES (1, $1, $2, $3, $4)"
)
CA_UPDATE_SEALED: Final = "UPDATE ca SET key_sealed = $1, token_key_sealed = $2 WHERE id = 1"

_TOKEN_STATE: Final = (
    "CASE WHEN revoked_at IS NOT NULL THEN 'revoked' WHEN uses >= max_uses THEN 'used'"
    " WHEN expires_at <= now() THEN 'expired' ELSE 'active' END AS state"
)
TOKEN_COLUMNS: Final = (
    "id, tenant_id, role, site_id, node_id, expect, ttl_seconds, max_uses, uses, expires_at,"
    " revoked_at, revoke_reason, note, idempotency_key, created_at, held, confirmed_at,"
    f" {_TOKEN_STATE}"
)
TOKEN_INSERT: Final = (
    "INSERT INTO join_tokens (id, token_hash, idempotency_key, tenant_id, role, site_id, node_id,"
    " expect, ttl_seconds, max_uses, expires_at, note, held)"
    " VALUES ($1, $2, $3, $4, $5, $6, $7, $8::jsonb, $9, $10, now() + $9::int * interval '1 second',"
    " $11, $12)"
    f" ON CONFLICT DO NOTHING RETURNING {TOKEN_COLUMNS}"
)
TOKEN_SELECT_BY_IDEMPOTENCY_KEY: Final = (
    f"SELECT {TOKEN_COLUMNS}, token_hash FROM join_tokens WHERE idempotency_key = $1"
)
TOKEN_SELECT_BY_ID: Final = f"SELECT {TOKEN_COLUMNS} FROM join_tokens WHERE id = $1"
TOKEN_SELECT_FOR_JOIN: Final = (
    f"SELECT {TOKEN_COLUMNS}, expires_at <= now() AS expired"
    " FROM join_tokens WHERE token_hash = $1 FOR UPDATE"
)
TOKEN_SPEND: Final = "UPDATE join_tokens SET uses = uses + 1 WHERE id = $1"
TOKEN_REVOKE: Final = (
    "UPDATE join_tokens SET revoked_at = now(), revoke_reason = $2"
    f" WHERE id = $1 AND revoked_at IS NULL RETURNING {TOKEN_COLUMNS}"
)
FENCES: Final = AttemptFences(table="join_tokens", id_column="id")
TOKEN_LIST: Final = (
    f"SELECT * FROM (SELECT {TOKEN_COLUMNS} FROM join_tokens"
    " WHERE ($1::text IS NULL OR tenant_id = $1) AND ($2::text IS NULL OR site_id = $2)) t"
    " WHERE ($3::text IS NULL OR state = $3)"
    " AND ($4::timestamptz IS NULL OR (created_at, id) < ($4, $5::text))"
    " ORDER BY created_at DESC, id DESC LIMIT $6"
)

CERT_COLUMNS: Final = (
    "id, agent_id, tenant_id, site_id, role, join_token_id, serial, key_type, public_key,"
    " certificate_pem, not_before, not_after, revoked_at, revoke_reason, created_at, claims,"
    " CASE WHEN revoked_at IS NOT NULL THEN 'revoked' WHEN not_after <= now() THEN 'expired'"
    " WHEN pending THEN 'pending' ELSE 'valid' END AS state"
)
CERT_INSERT: Final = (
    "INSERT INTO certificates (id, agent_id, tenant_id, site_id, role, join_token_id, serial,"
    " key_type, public_key, certificate_pem, claims, not_before, not_after, pending)"
    " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11::jsonb, $12, $13, $14)"
)
CERT_CONFIRM_OF_TOKEN: Final = (
    "UPDATE certificates SET pending = false"
    " WHERE join_token_id = $1 AND pending AND revoked_at IS NULL RETURNING id"
)
TOKEN_CONFIRM: Final = "UPDATE join_tokens SET confirmed_at = coalesce(confirmed_at, now()) WHERE id = $1"
CERT_SELECT_BY_ID: Final = f"SELECT {CERT_COLUMNS} FROM certificates WHERE id = $1"
# $1 join token id, $2 public key (DER): the certificate a join with this token and key already got
CERT_OF_TOKEN_AND_KEY: Final = (
    f"SELECT {CERT_COLUMNS} FROM certificates WHERE join_token_id = $1 AND public_key = $2"
    " AND revoked_at IS NULL AND not_after > now()"
)
CERT_SELECT_BY_AGENT: Final = (
    f"SELECT {CERT_COLUMNS} FROM certificates WHERE agent_id = $1 ORDER BY created_at DESC"
)
CERT_SELECT_LIST: Final = (
    f"SELECT {CERT_COLUMNS} FROM certificates"
    " WHERE ($1::text IS NULL OR tenant_id = $1) AND ($2::text IS NULL OR site_id = $2)"
    " AND ($3::text IS NULL OR agent_id = $3) AND ($4::text IS NULL OR join_token_id = $4)"
    " AND ($5 OR revoked_at IS NULL)"
    " AND ($6::timestamptz IS NULL OR (created_at, id) < ($6, $7::text))"
    " AND ($9::text[] IS NULL OR id = ANY ($9::text[])) AND ($10::text IS NULL OR role = $10)"
    " ORDER BY created_at DESC, id DESC LIMIT $8"
)
CERT_REVOKE: Final = (
    "UPDATE certificates SET revoked_at = now(), revoke_reason = $2"
    f" WHERE id = $1 AND revoked_at IS NULL RETURNING {CERT_COLUMNS}"
)

JOIN_AUDIT_INSERT: Final = (
    "INSERT INTO join_audit (outcome, code, join_token_id, cert_id, agent_id, claims, detail,"
    " instance) VALUES ($1, $2, $3, $4, $5, $6::jsonb, $7, $8)"
)
JOIN_AUDIT_LIST: Final = (
    "SELECT id, at, outcome, code, join_token_id, cert_id, agent_id, claims, detail"
    " FROM join_audit WHERE ($1::text IS NULL OR join_token_id = $1)"
    " AND ($2::text IS NULL OR outcome = $2) AND ($3::bigint IS NULL OR id < $3)"
    " ORDER BY id DESC LIMIT $4"
)

SEEN_INSERT: Final = (
    "INSERT INTO seen_signatures (signer, digest, expires_at)"
    " VALUES ($1, $2, now() + $3::int * interval '1 second') ON CONFLICT DO NOTHING RETURNING 1"
)
SEEN_PURGE: Final = "DELETE FROM seen_signatures WHERE expires_at < now()"

_json = msgspec.json.Encoder()


def json_of(value: Any) -> str:
    """A struct or value as JSON text, for a ``jsonb`` parameter."""
    return _json.encode(value).decode()


def token_info(row: Any) -> JoinTokenInfo:
    return JoinTokenInfo(
        join_token_id=row["id"],
        tenant_id=row["tenant_id"],
        role=row["role"],
        site_id=row["site_id"],
        node_id=row["node_id"],
        max_uses=row["max_uses"],
        uses=row["uses"],
        state=row["state"],
        expires_at=row["expires_at"],
        created_at=row["created_at"],
        expect=msgspec.json.decode(row["expect"], type=JoinExpect),
        idempotency_key=row["idempotency_key"],
        revoked_at=row["revoked_at"],
        revoke_reason=row["revoke_reason"],
        note=row["note"],
    )


def cert_info(row: Any) -> CertificateInfo:
    return CertificateInfo(
        cert_id=row["id"],
        agent_id=row["agent_id"],
        tenant_id=row["tenant_id"],
        site_id=row["site_id"],
        role=row["role"],
        join_token_id=row["join_token_id"],
        serial=row["serial"],
        key_type=row["key_type"],
        state=row["state"],
        not_before=row["not_before"],
        not_after=row["not_after"],
        created_at=row["created_at"],
        certificate_pem=row["certificate_pem"],
        revoked_at=row["revoked_at"],
        revoke_reason=row["revoke_reason"],
        claims=msgspec.json.decode(row["claims"], type=JoinClaims) if row["claims"] else None,
    )


def join_audit(row: Any) -> JoinAudit:
    claims = row["claims"]
    return JoinAudit(
        id=row["id"],
        at=row["at"],
        outcome=row["outcome"],
        code=row["code"],
        join_token_id=row["join_token_id"],
        cert_id=row["cert_id"],
        agent_id=row["agent_id"],
        claims=msgspec.json.decode(claims, type=JoinClaims) if claims else None,
        detail=row["detail"],
    )
