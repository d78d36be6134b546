"""The audit trail of operator actions (docs/audit.md): one ``audit`` table in each service's
schema, written by the service skeleton after an audited route succeeded, read by ``audit.list``.

Each service names its audited routes and, for each, the request fields worth keeping
(``Service.audit_routes``): a whitelist, so a secret value in a request (``secrets.put``) never
reaches the table. Requests from the control plane's own services (actor ``service:…``) are not
recorded: they carry out an operator's action already recorded where the operator asked.

Who asked: the NATS user nats-server names in the ``Nats-Request-Info`` header when the
request crossed into the services' account through a ``share: true`` import (the deployed
OPS account, deploy/nats/accounts.conf): *verified*, since the server replaces any header of
that name the sender wrote. Otherwise the ``Bc-Actor`` header's claim, recorded as a claim.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from ..wire.audit import ACTOR_HEADER, MAX_ACTOR, AuditEntry

__all__ = [
    "AUDIT_INSERT",
    "AUDIT_LIST",
    "AUDIT_TABLE",
    "REQUEST_INFO_HEADER",
    "SERVICE_ACTOR_PREFIX",
    "Requester",
    "actor_of",
    "audit_detail",
    "audit_entry",
    "audit_target",
    "requester",
]

SERVICE_ACTOR_PREFIX: Final = "service:"

# One definition for every service: the skeleton writes and reads the table, so the skeleton
# creates it in each service's schema (``apply_migrations``), beside schema_migrations.
AUDIT_TABLE: Final = """
CREATE TABLE IF NOT EXISTS "{schema}".audit (
    id       bigserial PRIMARY KEY,
    at       timestamptz NOT NULL DEFAULT now(),
    actor    text,
    action   text NOT NULL,
    target   text,
    detail   json NOT NULL DEFAULT '{{}}',
    instance text
);
CREATE INDEX IF NOT EXISTS audit_at ON "{schema}".audit (at);
CREATE INDEX IF NOT EXISTS audit_actor ON "{schema}".audit (actor, id);
ALTER TABLE "{schema}".audit ADD COLUMN IF NOT EXISTS verified boolean NOT NULL DEFAULT false;
"""

AUDIT_INSERT: Final = (
    "INSERT INTO audit (actor, action, target, detail, instance, verified)"
    " VALUES ($1, $2, $3, $4::text::json, $5, $6)"
)
# $1 since (epoch s), $2 actor, $3 actor prefix, $4 before id (cursor), $5 limit
AUDIT_LIST: Final = """
SELECT id, extract(epoch FROM at)::float8 AS at, actor, action, target, detail::text AS detail, verified
FROM audit
WHERE ($1::float8 IS NULL OR at >= to_timestamp($1))
  AND ($2::text IS NULL OR actor = $2) AND ($3::text IS NULL OR starts_with(actor, $3))
  AND ($4::bigint IS NULL OR id < $4)
ORDER BY id DESC LIMIT $5
"""

_TARGET_KEYS: Final = ("id", "ref", "joinTokenId", "certId", "workflowId", "batchId", "nodeId")
_MAX_DETAIL_VALUE: Final = 512


REQUEST_INFO_HEADER: Final = "Nats-Request-Info"
"""nats-server's header on a request that came through a service import (its ``ClientInfo``)."""


@dataclass(frozen=True)
class Requester:
    """Who sent a request, as far as the service can tell."""

    actor: str | None
    """The NATS user when ``verified``, else the ``Bc-Actor`` claim (None: nothing said)."""
    verified: bool
    """The server named ``actor``: the request came through a ``share: true`` import."""
    claimed: str | None
    """The ``Bc-Actor`` header, kept beside a verified user when it says something else."""
    imported: bool
    """The request came from another account (a site, the operators): never a service's own."""

    @property
    def is_service(self) -> bool:
        """One of the control plane's own services: its own account, and saying so."""
        return not self.imported and (self.actor or "").startswith(SERVICE_ACTOR_PREFIX)


def _clean(raw: str | None) -> str | None:
    if not raw:
        return None
    clean = "".join(ch for ch in raw if ch.isprintable()).strip()
    return clean[:MAX_ACTOR] or None


def actor_of(headers: Mapping[str, str]) -> str | None:
    """The requester's claimed identity from the ``Bc-Actor`` header, cleaned of control
    characters and cut to ``MAX_ACTOR``; None when absent."""
    return _clean(headers.get(ACTOR_HEADER))


def requester(headers: Mapping[str, str] | None) -> Requester:
    """Who sent a request: the user nats-server names in ``Nats-Request-Info`` (present only on
    a request that crossed an import, and written by the server, never the sender), else the
    ``Bc-Actor`` claim."""
    headers = headers or {}
    claimed = actor_of(headers)
    raw = headers.get(REQUEST_INFO_HEADER)
    if raw is None:
        return Requester(actor=claimed, verified=False, claimed=None, imported=False)
    try:
        info = json.loads(raw)
    except ValueError:
        info = None
    user = _clean(info.get("user")) if isinstance(info, dict) and isinstance(info.get("user"), str) else None
    if user is None:  # an import without share: the account, never the person
        return Requester(actor=claimed, verified=False, claimed=None, imported=True)
    return Requester(actor=user, verified=True, claimed=claimed if claimed != user else None, imported=True)


def _get(doc: Any, path: str) -> Any:
    for key in path.split("."):
        if not isinstance(doc, dict):
            return None
        doc = doc.get(key)
    return doc


def audit_detail(body: Any, keys: Sequence[str], *, claimed: str | None = None) -> dict[str, Any]:
    """The whitelisted request fields (dotted paths into the JSON body), each kept short; and
    ``claimedActor`` when a verified requester's ``Bc-Actor`` said someone else."""
    detail: dict[str, Any] = {"claimedActor": claimed} if claimed else {}
    for key in keys:
        value = _get(body, key)
        if value is None:
            continue
        text = json.dumps(value, separators=(",", ":"), default=str)
        detail[key] = value if len(text) <= _MAX_DETAIL_VALUE else text[: _MAX_DETAIL_VALUE - 1] + "…"
    return detail


def audit_target(body: Any, result: Any) -> str | None:
    """What the action was about: an id in the reply, else one in the request."""
    for doc in (result, body):
        for key in _TARGET_KEYS:
            value = _get(doc, key)
            if isinstance(value, str) and value:
                return value[:200]
    doc_id = _get(body, "document.id")
    return doc_id[:200] if isinstance(doc_id, str) else None


def audit_entry(row: Any, service: str) -> AuditEntry:
    detail = json.loads(row["detail"]) if row["detail"] else {}
    return AuditEntry(
        id=row["id"],
        at=row["at"],
        service=service,
        actor=row["actor"],
        action=row["action"],
        target=row["target"],
        detail=detail if isinstance(detail, dict) else {},
        verified=bool(row["verified"]),
    )


def builtins(value: Any) -> Any:
    """A reply (a Struct or builtins) as plain JSON-like data."""
    try:
        return msgspec.to_builtins(value)
    except (TypeError, msgspec.MsgspecError):
        return None
