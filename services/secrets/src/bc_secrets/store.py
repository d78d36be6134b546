"""The secrets schema's statements, and rows turned into messages."""

from __future__ import annotations

from typing import Any, Final

from better_compute.service.fences import AttemptFences
from better_compute.wire.secrets import FetchAudit, SecretInfo

__all__ = [
    "FENCES",
    "FETCH_AUDIT_INSERT",
    "FETCH_AUDIT_LIST",
    "SECRET_COLUMNS",
    "SECRET_INSERT",
    "SECRET_LIST",
    "SECRET_RESEAL",
    "SECRET_SELECT",
    "SECRET_SELECT_BY_IDEMPOTENCY_KEY",
    "SECRET_SELECT_STALE_KEY",
    "fetch_audit",
    "secret_info",
]

SECRET_COLUMNS: Final = (
    "ref, tenant_id, workflow_id, step, idempotency_key, label, size, key_id, created_at, revoked_at,"
    " node_id, for_node"
)
SECRET_INSERT: Final = (
    "INSERT INTO secrets (ref, tenant_id, workflow_id, step, idempotency_key, label, size,"
    " key_id, sealed, node_id, for_node) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)"
    f" ON CONFLICT DO NOTHING RETURNING {SECRET_COLUMNS}"
)
SECRET_SELECT_BY_IDEMPOTENCY_KEY: Final = f"SELECT {SECRET_COLUMNS} FROM secrets WHERE idempotency_key = $1"
SECRET_SELECT: Final = f"SELECT {SECRET_COLUMNS}, sealed FROM secrets WHERE ref = $1"
SECRET_LIST: Final = (
    f"SELECT {SECRET_COLUMNS} FROM secrets"
    " WHERE ($1::text IS NULL OR tenant_id = $1) AND ($2::text IS NULL OR workflow_id = $2)"
    " AND ($3::timestamptz IS NULL OR (created_at, ref) < ($3, $4::text))"
    " ORDER BY created_at DESC, ref DESC LIMIT $5"
)
SECRET_SELECT_STALE_KEY: Final = (
    "SELECT ref, sealed FROM secrets WHERE key_id <> $1 LIMIT $2 FOR UPDATE SKIP LOCKED"
)
SECRET_RESEAL: Final = "UPDATE secrets SET sealed = $2, key_id = $3 WHERE ref = $1"

FENCES: Final = AttemptFences(table="secrets", id_column="ref")

FETCH_AUDIT_INSERT: Final = (
    "INSERT INTO fetch_audit (outcome, ref, code, reason, signer_id, agent_id, command_id,"
    " instance) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
)
FETCH_AUDIT_LIST: Final = (
    "SELECT id, at, outcome, ref, code, reason, signer_id, agent_id, command_id"
    " FROM fetch_audit WHERE ($1::text IS NULL OR ref = $1)"
    " AND ($2::text IS NULL OR outcome = $2) AND ($3::bigint IS NULL OR id < $3)"
    " ORDER BY id DESC LIMIT $4"
)


def secret_info(row: Any) -> SecretInfo:
    return SecretInfo(
        ref=row["ref"],
        tenant_id=row["tenant_id"],
        workflow_id=row["workflow_id"],
        step=row["step"],
        size=row["size"],
        key_id=row["key_id"],
        created_at=row["created_at"],
        label=row["label"],
        idempotency_key=row["idempotency_key"],
        revoked_at=row["revoked_at"],
        node_id=row["node_id"],
        for_node=row["for_node"],
    )


def fetch_audit(row: Any) -> FetchAudit:
    return FetchAudit(
        id=row["id"],
        at=row["at"],
        outcome=row["outcome"],
        ref=row["ref"],
        code=row["code"],
        reason=row["reason"],
        signer_id=row["signer_id"],
        agent_id=row["agent_id"],
        command_id=row["command_id"],
    )
