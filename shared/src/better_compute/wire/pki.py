"""The PKI service's contract: its requests, replies and routes (the client is
``better_compute.clients.PkiClient``; signing and keys are in ``better_compute.crypto``).

Every route is ``bc.api.pki.<resource>.<verb>`` (``SERVICE``):

=====================  ===========================  ================================
route                  request                      result
=====================  ===========================  ================================
``tokens.issue``       ``IssueJoinTokenRequest``    ``IssuedJoinToken`` (token once)
``tokens.list``        ``ListJoinTokensRequest``    ``JoinTokenList``
``tokens.get``         ``JoinTokenIdRequest``       ``JoinTokenInfo``
``tokens.revoke``      ``RevokeJoinTokenRequest``   ``JoinTokenInfo``
``agents.join``        ``JoinRequest``              ``JoinResult``
``joins.list``         ``ListJoinsRequest``         ``JoinAuditList``
``signatures.verify``  ``VerifyRequest``            ``Verified``
``certs.get``          ``CertIdRequest``            ``CertificateInfo``
``certs.list``         ``ListCertificatesRequest``  ``CertificateList``
``certs.revoke``       ``RevokeCertificateRequest`` ``CertificateInfo``
``ca.get``             ``{}``                       ``CaInfo``
``keys.rewrap``        ``{}``                       ``RewrapResult``
=====================  ===========================  ================================
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Final, Literal

import msgspec

from ..core.names import Name
from .paging import DEFAULT_LIMIT, Cursor

__all__ = [
    "BURN_PURPOSE",
    "BURN_REASONS",
    "CERT_EVENTS",
    "CONFIRM_PURPOSE",
    "JOIN_EVENTS",
    "MAX_TTL_SECONDS",
    "SERVICE",
    "BurnJoinTokenRequest",
    "BurnedJoinToken",
    "CaInfo",
    "CertEvent",
    "CertIdRequest",
    "CertRevoked",
    "CertState",
    "CertificateInfo",
    "CertificateList",
    "ConfirmJoinTokenRequest",
    "ConfirmedJoinToken",
    "IdempotencyKey",
    "IssueJoinTokenRequest",
    "IssuedJoinToken",
    "JoinAccepted",
    "JoinAudit",
    "JoinAuditList",
    "JoinClaims",
    "JoinEvent",
    "JoinExpect",
    "JoinRefused",
    "JoinRequest",
    "JoinResult",
    "JoinRole",
    "JoinTokenBurned",
    "JoinTokenConfirmed",
    "JoinTokenIdRequest",
    "JoinTokenInfo",
    "JoinTokenList",
    "ListCertificatesRequest",
    "ListJoinTokensRequest",
    "ListJoinsRequest",
    "RevokeAttempt",
    "RevokeCertificateRequest",
    "RevokeJoinTokenRequest",
    "RevokedAttempt",
    "RewrapResult",
    "TokenState",
    "Verified",
    "VerifyRequest",
    "decode_cert_event",
    "decode_join_event",
]

SERVICE: Final = "pki"
"""The service token of every route: ``bc.api.pki.<resource>.<verb>``."""

JOIN_EVENTS: Final = "join"
"""The kind of join events: ``bc.events.join.<join token id>`` (``unknown`` when the token is not
known) (``JoinEvent``)."""
CERT_EVENTS: Final = "cert"
"""The kind of certificate events: ``bc.events.cert.<cert id>`` (``CertEvent``)."""

BURN_PURPOSE: Final = "tokens.burn"
"""What a site agent signs a ``BurnJoinTokenRequest`` for (``better_compute.crypto``)."""
BURN_REASONS: Final = ("boot-entry-fetched-twice", "second-join", "boot-medium-fetched-twice")
"""Why a node-bound token was burned: a site agent served its one-time boot entry and then
saw that MAC (or another MAC of the same entry) ask again; or a second join tried it; or the
token's virtual medium was asked for again, or by another address than the BMC's."""

CONFIRM_PURPOSE: Final = "tokens.confirm"
"""What a site agent signs a ``ConfirmJoinTokenRequest`` for."""

JoinRole = Literal["node", "site", "provisioned", "discovery"]
TokenState = Literal["active", "expired", "used", "revoked"]
CertState = Literal["valid", "pending", "expired", "revoked"]
"""``pending``: issued with a ``held`` token whose boot entry has not closed clean yet; it signs
nothing that counts (no command, no secret, no ``wait.agentJoined``) until it is ``valid``."""

Claim = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Mac = Annotated[str, msgspec.Meta(pattern=r"^[0-9A-Fa-f]{2}([:-]?[0-9A-Fa-f]{2}){5}$")]
Reason = Annotated[str, msgspec.Meta(max_length=200)]
IdempotencyKey = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Limit = Annotated[int, msgspec.Meta(ge=1, le=1000)]

MAX_TTL_SECONDS: Final = 30 * 24 * 3600


# -- claims -------------------------------------------------------------------


class JoinExpect(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """Hardware claims a join must show; unset fields are not checked."""

    mac: Mac | None = None
    product_uuid: Claim | None = None
    serial: Claim | None = None
    gpu_uuid: Claim | None = None


class JoinClaims(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """What a joining machine says about itself."""

    macs: Annotated[list[Mac], msgspec.Meta(max_length=64)] = []
    product_uuid: Claim | None = None
    serial: Claim | None = None
    gpu_uuids: Annotated[list[Claim], msgspec.Meta(max_length=64)] = []
    hostname: Claim | None = None


# -- requests -----------------------------------------------------------------


class IssueJoinTokenRequest(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    tenant_id: Name
    role: JoinRole
    site_id: Name
    ttl_seconds: Annotated[int, msgspec.Meta(ge=1, le=MAX_TTL_SECONDS)]
    max_uses: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 1
    expect: JoinExpect = JoinExpect()
    idempotency_key: IdempotencyKey | None = None
    note: Reason | None = None
    node_id: str | None = None
    """Roles ``node`` and ``provisioned`` only: the node the token is for. The agent that
    joins with it gets the node id as its agent id (commands for a node's bcd are
    addressed to the node id); without it a join mints a new ``agent_…`` id."""
    mint_secret: Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)] | None = None
    """With ``idempotency_key``: a secret only the caller keeps (the engine keeps one per step
    attempt). The token is derived from it and bc-pki's token key, so issuing again under the
    same key gives the token back only to a caller with the same mint secret; anyone else gets
    ``CONFLICT`` (``already-issued``). Without it a keyed token is shown once, never again."""
    held: bool = False
    """Node tokens only: the token travels on the boot network (a node's one-time boot entry). A
    join with it gets a certificate held ``pending`` until the site agent that served the entry
    confirms it closed clean (``tokens.confirm``); a burn revokes it instead."""

    def __repr__(self) -> str:
        return f"IssueJoinTokenRequest(idempotency_key={self.idempotency_key!r}, mint_secret=[redacted])"


class ListJoinTokensRequest(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    tenant_id: Name | None = None
    site_id: Name | None = None
    state: TokenState | None = None
    limit: Limit = DEFAULT_LIMIT
    cursor: Cursor | None = None
    """The ``next`` of the page before (newest first)."""


class JoinTokenIdRequest(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    join_token_id: str


class RevokeJoinTokenRequest(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    join_token_id: str
    reason: Reason | None = None


class RevokeAttempt(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """Revoke what one attempt of a workflow step minted (its idempotency key is
    ``attempt_key(...)`` or under it), and refuse anything minted under it from now on: the
    engine supersedes the attempt (a retry, a resume, an abort)."""

    workflow_id: Annotated[str, msgspec.Meta(pattern=r"^wf_[0-9A-Za-z]{1,40}$")]
    step: Annotated[int, msgspec.Meta(ge=0, le=511)]
    attempt: Annotated[int, msgspec.Meta(ge=1)]
    reason: Reason | None = None


class RevokedAttempt(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """What a ``RevokeAttempt`` revoked now (ids); none when it was done before."""

    revoked: list[str]


class BurnJoinTokenRequest(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """A site agent's report that a node-bound token it served is no longer the node's alone
    (``reason``), signed by the agent (``BURN_PURPOSE`` over every field but the signature).
    bc-pki revokes the token and every certificate issued with it, and publishes
    ``JoinTokenBurned``, from which the engine quarantines the node."""

    token_sha256: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
    """sha256 of the token, hex: the site agent needs not send the token itself."""
    mac: Annotated[str, msgspec.Meta(max_length=17)]
    reason: Literal["boot-entry-fetched-twice", "boot-medium-fetched-twice"]
    signer_id: str
    signed_at_ms: int
    nonce: Annotated[str, msgspec.Meta(max_length=64)]
    signature: Annotated[str, msgspec.Meta(max_length=1024)]


class BurnedJoinToken(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    join_token_id: str
    node_id: str | None = None
    revoked_cert_ids: list[str] = []


class ConfirmJoinTokenRequest(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """A site agent's report that the node entry carrying a ``held`` token closed clean: served
    to one address, and no other address asked within the quiet period after its last serve (and
    the agent's power-on of the node). Signed (``CONFIRM_PURPOSE``). bc-pki makes the
    certificates issued with the token valid, and a later join with it gets a valid one."""

    token_sha256: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
    mac: Annotated[str, msgspec.Meta(max_length=17)]
    signer_id: str
    signed_at_ms: int
    nonce: Annotated[str, msgspec.Meta(max_length=64)]
    signature: Annotated[str, msgspec.Meta(max_length=1024)]


class ConfirmedJoinToken(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    join_token_id: str
    node_id: str | None = None
    cert_ids: list[str] = []
    """The certificates made valid now (none on a repeat)."""


class JoinRequest(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    token: Annotated[str, msgspec.Meta(max_length=128)]
    claims: JoinClaims = JoinClaims()
    csr: Annotated[str, msgspec.Meta(min_length=1, max_length=16_384)]
    """PKCS#10 request in PEM, Ed25519 or ECDSA P-256 key."""
    site_id: Name | None = None
    """The site the machine boots in (the discovery ramdisk's ``bcd.site=``, which the site
    agent that served it adds): a token of another site is refused (``site-mismatch``)."""


class ListJoinsRequest(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    join_token_id: str | None = None
    outcome: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    limit: Limit = DEFAULT_LIMIT
    cursor: Cursor | None = None


class VerifyRequest(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    signer_id: str
    """A certificate id (``cert_…``), or an agent id (``agent_…``, or ``node_…`` for a node's
    bcd): then any valid certificate of that agent."""
    data: Annotated[bytes, msgspec.Meta(max_length=1 << 20)]
    signature: Annotated[bytes, msgspec.Meta(max_length=512)]
    once: bool = False
    """Refuse a second verification of the same signed data by the same signer."""
    signed_at_ms: int | None = None
    """With ``once``: when the data was signed (inside ``data``); must be recent."""


class CertIdRequest(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    cert_id: str


class ListCertificatesRequest(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    tenant_id: Name | None = None
    site_id: Name | None = None
    agent_id: str | None = None
    join_token_id: str | None = None
    include_revoked: bool = False
    limit: Limit = DEFAULT_LIMIT
    cursor: Cursor | None = None
    # Only these certificates (one page of agents' certificates at most): one call, not one each.
    cert_ids: Annotated[list[str], msgspec.Meta(min_length=1, max_length=1000)] | None = None
    role: JoinRole | None = None
    """Only certificates of this role (the engine's look for discovery joins)."""


class RevokeCertificateRequest(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    cert_id: str
    reason: Reason | None = None


# -- results ------------------------------------------------------------------


class IssuedJoinToken(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """A minted join token. ``token`` is the secret; it is shown here and never again."""

    join_token_id: str
    token: str
    tenant_id: str
    role: JoinRole
    site_id: str
    max_uses: int
    expires_at: datetime

    @property
    def id(self) -> str:
        """The token's id (``tok_…``): safe to store and to put in step results."""
        return self.join_token_id

    def __repr__(self) -> str:
        return f"IssuedJoinToken(join_token_id={self.join_token_id!r}, token=[redacted])"


class JoinTokenInfo(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    join_token_id: str
    tenant_id: str
    role: JoinRole
    site_id: str
    node_id: str | None
    max_uses: int
    uses: int
    state: TokenState
    expires_at: datetime
    created_at: datetime
    expect: JoinExpect = JoinExpect()
    idempotency_key: str | None = None
    revoked_at: datetime | None = None
    revoke_reason: str | None = None
    note: str | None = None


class JoinTokenList(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    tokens: list[JoinTokenInfo]
    next: str | None = None
    """The cursor of the next page; None after the last."""


class JoinResult(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """The certificate a join earned; ``agent_id`` is the agent's identity from now on."""

    cert_id: str
    agent_id: str
    tenant_id: str
    site_id: str
    role: JoinRole
    join_token_id: str
    certificate_pem: str
    ca_pem: str
    not_after: datetime


class JoinAudit(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    id: int
    at: datetime
    outcome: str
    """``joined``, or why not: ``token-unknown``, ``token-expired``, ``claims-mismatch``, …"""
    code: str | None = None
    join_token_id: str | None = None
    cert_id: str | None = None
    agent_id: str | None = None
    claims: JoinClaims | None = None
    detail: str | None = None


class JoinAuditList(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    joins: list[JoinAudit]
    next: str | None = None


class CertificateInfo(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    cert_id: str
    agent_id: str
    tenant_id: str
    site_id: str
    role: JoinRole
    join_token_id: str | None
    serial: str
    key_type: str
    state: CertState
    not_before: datetime
    not_after: datetime
    created_at: datetime
    certificate_pem: str
    revoked_at: datetime | None = None
    revoke_reason: str | None = None
    claims: JoinClaims | None = None
    """The hardware claims the agent showed when it joined."""


class CertificateList(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    certificates: list[CertificateInfo]
    next: str | None = None


class Verified(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """Whose key made a signature that checked out."""

    cert_id: str
    agent_id: str
    tenant_id: str
    site_id: str
    role: JoinRole
    join_token_id: str | None = None


class CaInfo(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    certificate_pem: str
    fingerprint_sha256: str
    created_at: datetime


class RewrapResult(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    key_id: str
    rewrapped: int


# -- events on bc.events.join.<token id> and bc.events.cert.<cert id> --------------------------


class _Event(msgspec.Struct, frozen=True, kw_only=True, rename="camel", tag_field="event"):
    pass


class JoinAccepted(_Event, frozen=True, kw_only=True, tag="joined"):
    """An agent joined with the token: its certificate was issued."""

    join_token_id: str
    agent_id: str
    cert_id: str
    role: str
    site_id: str | None = None
    at: float | None = None


class JoinRefused(_Event, frozen=True, kw_only=True, tag="refused"):
    """A join was refused (the token was not spent): ``reason`` is the join audit's outcome
    (``token-unknown``, ``token-expired``, ``claims-mismatch``, ``malformed``, …)."""

    join_token_id: str | None = None
    reason: str
    code: str
    at: float | None = None


class JoinTokenBurned(_Event, frozen=True, kw_only=True, tag="burned"):
    """A node-bound token was seen twice (``reason``, one of ``BURN_REASONS``): it is revoked,
    with every certificate issued with it, and the engine quarantines ``node_id``."""

    join_token_id: str
    node_id: str | None = None
    reason: str
    mac: str | None = None
    revoked_cert_ids: list[str] = []
    at: float | None = None


class JoinTokenConfirmed(_Event, frozen=True, kw_only=True, tag="confirmed"):
    """A ``held`` token's boot entry closed clean: the certificates issued with it (``cert_ids``)
    are valid from now on, and so is a later join's."""

    join_token_id: str
    node_id: str | None = None
    cert_ids: list[str] = []
    at: float | None = None


JoinEvent = JoinAccepted | JoinRefused | JoinTokenBurned | JoinTokenConfirmed


class CertRevoked(_Event, frozen=True, kw_only=True, tag="revoked"):
    """The certificate was revoked: its agent is refused from now on."""

    cert_id: str
    state: str = "revoked"
    at: float | None = None


CertEvent = CertRevoked

_join_events = msgspec.json.Decoder(JoinEvent)
_cert_events = msgspec.json.Decoder(CertEvent)


def decode_join_event(data: bytes) -> JoinEvent | None:
    """The event in ``data``, or None for anything that is not one."""
    try:
        return _join_events.decode(data)
    except msgspec.MsgspecError:
        return None


def decode_cert_event(data: bytes) -> CertEvent | None:
    """The event in ``data``, or None for anything that is not one."""
    try:
        return _cert_events.decode(data)
    except msgspec.MsgspecError:
        return None
