"""The PKI service over NATS: its messages, a client, and what an agent needs to sign.

``PkiClient`` is what ``ctx.pki`` is (through ``PkiClient.for_step``); bcx and the other
services use it too. Every route is ``bc.api.pki.<resource>.<verb>``:

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

import base64
import re
import secrets as _random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Annotated, Any, Final, Literal, TypeAlias, TypeVar

import msgspec
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import NameOID

from .core.errors import BcError, ErrorCode, ServiceUnavailableError
from .core.keys import attempt_key
from .core.names import Name
from .logging import register_secret
from .service.client import ApiClient
from .wire.paging import DEFAULT_LIMIT, Cursor

__all__ = [
    "AgentIdentity",
    "AgentKey",
    "CaInfo",
    "CertIdRequest",
    "CertificateInfo",
    "CertificateList",
    "IssueJoinTokenRequest",
    "IssuedJoinToken",
    "JoinAudit",
    "JoinAuditList",
    "JoinClaims",
    "JoinExpect",
    "JoinRequest",
    "JoinResult",
    "JoinRole",
    "JoinTokenIdRequest",
    "JoinTokenInfo",
    "JoinTokenList",
    "ListCertificatesRequest",
    "ListJoinTokensRequest",
    "ListJoinsRequest",
    "PkiClient",
    "RevokeAttempt",
    "RevokeCertificateRequest",
    "RevokeJoinTokenRequest",
    "RevokedAttempt",
    "RewrapResult",
    "StepPki",
    "Verified",
    "VerifyRequest",
    "attempt_key",
    "make_csr",
    "new_agent_key",
    "sign_bytes",
    "signing_payload",
    "unavailable",
]

T = TypeVar("T")

JoinRole = Literal["node", "site", "provisioned", "discovery"]
TokenState = Literal["active", "expired", "used", "revoked"]
CertState = Literal["valid", "expired", "revoked"]

Claim = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Mac = Annotated[str, msgspec.Meta(pattern=r"^[0-9A-Fa-f]{2}([:-]?[0-9A-Fa-f]{2}){5}$")]
Reason = Annotated[str, msgspec.Meta(max_length=200)]
IdempotencyKey = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Limit = Annotated[int, msgspec.Meta(ge=1, le=1000)]

MAX_TTL_SECONDS: Final = 30 * 24 * 3600
SIGNATURE_DOMAIN: Final = b"bc-sig-v1"
_PURPOSE_RE: Final = re.compile(r"^[a-z][a-z0-9._-]{0,63}$")
_WAIT_CODES: Final = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT})


def unavailable(err: BcError, service: str) -> ServiceUnavailableError | None:
    """``err`` marked as our own ``service``'s unavailability, when it is one (``UNAVAILABLE``
    or ``TIMEOUT``, see ``ServiceUnavailableError``); None for any other error."""
    if err.code in _WAIT_CODES and not isinstance(err, ServiceUnavailableError):
        return ServiceUnavailableError(err, service=service)
    return None


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


class JoinRequest(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    token: Annotated[str, msgspec.Meta(max_length=128)]
    claims: JoinClaims = JoinClaims()
    csr: Annotated[str, msgspec.Meta(min_length=1, max_length=16_384)]
    """PKCS#10 request in PEM, Ed25519 or ECDSA P-256 key."""


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


# -- signing ------------------------------------------------------------------

AgentKey: TypeAlias = ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey


def signing_payload(purpose: str, doc: Mapping[str, Any]) -> bytes:
    """The canonical bytes an agent signs: domain, purpose, then ``doc`` as sorted JSON.

    The purpose (``secrets.fetch``, ``agent.event``, …) is inside the signed bytes, so a
    signature made for one purpose never verifies for another.
    """
    if _PURPOSE_RE.match(purpose) is None:
        raise BcError(ErrorCode.INVALID_INPUT, f"bad signing purpose {purpose!r}", {"path": "purpose"})
    return b"\x00".join((SIGNATURE_DOMAIN, purpose.encode(), msgspec.json.encode(doc, order="sorted")))


def new_agent_key(kind: Literal["ed25519", "p256"] = "ed25519") -> AgentKey:
    """A new agent key: Ed25519 (default) or ECDSA P-256."""
    if kind == "p256":
        return ec.generate_private_key(ec.SECP256R1())
    return ed25519.Ed25519PrivateKey.generate()


def make_csr(key: AgentKey, *, common_name: str = "bc-agent") -> str:
    """A PKCS#10 request (PEM) for ``key``; the CA sets the subject itself."""
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    )
    algorithm = None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()
    return builder.sign(key, algorithm).public_bytes(serialization.Encoding.PEM).decode()


def sign_bytes(key: AgentKey, data: bytes) -> bytes:
    """Ed25519 signature, or a DER ECDSA-SHA256 signature for a P-256 key."""
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.sign(data)
    return key.sign(data, ec.ECDSA(hashes.SHA256()))


@dataclass(frozen=True)
class AgentIdentity:
    """An agent's certificate id and private key: what it signs events and requests with."""

    cert_id: str
    agent_id: str
    private_key: AgentKey = field(repr=False)

    @classmethod
    def from_join(cls, result: JoinResult, private_key: AgentKey) -> AgentIdentity:
        return cls(cert_id=result.cert_id, agent_id=result.agent_id, private_key=private_key)

    def sign(self, purpose: str, doc: Mapping[str, Any]) -> tuple[bytes, bytes]:
        """``(data, signature)`` for ``doc`` under ``purpose``."""
        data = signing_payload(purpose, doc)
        return data, sign_bytes(self.private_key, data)

    def signed_request(self, purpose: str, **fields: Any) -> dict[str, Any]:
        """``fields`` plus ``signerId``, ``signedAtMs``, ``nonce`` and a ``signature`` over them.

        The service rebuilds the document from the same fields, so nothing travels twice.
        """
        doc = {
            **fields,
            "signerId": self.cert_id,
            "signedAtMs": time.time_ns() // 1_000_000,
            "nonce": _random.token_hex(16),
        }
        _data, signature = self.sign(purpose, doc)
        return {**doc, "signature": base64.b64encode(signature).decode()}


# -- the client ---------------------------------------------------------------


class PkiClient:
    """Calls to bc-pki over NATS; raises the service's ``BcError``s.

    Args:
        api: an ``ApiClient`` on the deployment's subject root.
        timeout: seconds to wait for each answer.
    """

    service: Final = "pki"

    def __init__(self, api: ApiClient, *, timeout: float = 10.0) -> None:
        self.api = api
        self.timeout = timeout

    async def _call(self, route: str, payload: Any, typ: type[T]) -> T:
        try:
            return await self.api.call_as(self.service, route, payload, typ, timeout=self.timeout)
        except BcError as err:
            if (marked := unavailable(err, "bc-pki")) is not None:
                raise marked from err
            raise

    def for_step(
        self,
        idempotency_key: str,
        *,
        node_id: str | None = None,
        before_mint: Callable[[], Awaitable[bytes | None]] | None = None,
    ) -> StepPki:
        """The client a step sees as ``ctx.pki``: tokens keyed by the step's idempotency key,
        and ``node``/``provisioned`` tokens bound to the workflow's node. ``before_mint`` runs
        before the first token is minted (the engine records that the attempt minted) and
        returns the attempt's mint secret: the same one on every run of the attempt, kept
        where only the engine reads it. Only with it does a re-run get its tokens back."""
        return StepPki(self, idempotency_key, node_id=node_id, before_mint=before_mint)

    async def issue_join_token(
        self,
        *,
        tenant_id: str,
        role: JoinRole,
        site_id: str | None = None,
        ttl_seconds: int,
        max_uses: int = 1,
        expect: JoinExpect | Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
        note: str | None = None,
        node_id: str | None = None,
        mint_secret: bytes | None = None,
    ) -> IssuedJoinToken:
        """Mint a join token (``tokens.issue``).

        The same ``idempotency_key`` mints nothing new: with the same ``mint_secret`` (a
        step re-run after a crash) it gives back the same token and id; without it, or with
        another, it is ``CONFLICT`` with ``details.reason`` ``already-issued`` and the
        ``joinTokenId``, never the token. With other parameters it is ``CONFLICT`` too.
        """
        payload: dict[str, Any] = {
            "tenantId": tenant_id,
            "role": role,
            "siteId": site_id,
            "ttlSeconds": ttl_seconds,
            "maxUses": max_uses,
            "idempotencyKey": idempotency_key,
            "note": note,
            "nodeId": node_id,
        }
        if mint_secret is not None:
            register_secret(base64.b64encode(mint_secret).decode())
            payload["mintSecret"] = mint_secret
        if isinstance(expect, JoinExpect):
            payload["expect"] = expect
        elif expect is not None:
            payload["expect"] = dict(expect)
        issued = await self._call("tokens.issue", payload, IssuedJoinToken)
        register_secret(issued.token)
        return issued

    async def list_join_tokens(
        self,
        *,
        tenant_id: str | None = None,
        site_id: str | None = None,
        state: TokenState | None = None,
        limit: int = DEFAULT_LIMIT,
    ) -> list[JoinTokenInfo]:
        """The first page; ``join_tokens_page`` gives the cursor of the rest."""
        return (
            await self.join_tokens_page(tenant_id=tenant_id, site_id=site_id, state=state, limit=limit)
        ).tokens

    async def join_tokens_page(
        self,
        *,
        tenant_id: str | None = None,
        site_id: str | None = None,
        state: TokenState | None = None,
        limit: int = DEFAULT_LIMIT,
        cursor: str | None = None,
    ) -> JoinTokenList:
        """One page of join tokens, newest first; pass its ``next`` as ``cursor`` for the next."""
        req = ListJoinTokensRequest(
            tenant_id=tenant_id, site_id=site_id, state=state, limit=limit, cursor=cursor
        )
        return await self._call("tokens.list", req, JoinTokenList)

    async def get_join_token(self, join_token_id: str) -> JoinTokenInfo:
        req = JoinTokenIdRequest(join_token_id=join_token_id)
        return await self._call("tokens.get", req, JoinTokenInfo)

    async def revoke_join_token(self, join_token_id: str, *, reason: str | None = None) -> JoinTokenInfo:
        req = RevokeJoinTokenRequest(join_token_id=join_token_id, reason=reason)
        return await self._call("tokens.revoke", req, JoinTokenInfo)

    async def revoke_attempt(
        self, *, workflow_id: str, step: int, attempt: int, reason: str | None = None
    ) -> RevokedAttempt:
        """Revoke the tokens one step attempt minted and refuse new ones under its key
        (``tokens.revoke_attempt``); safe to repeat."""
        req = RevokeAttempt(workflow_id=workflow_id, step=step, attempt=attempt, reason=reason)
        return await self._call("tokens.revoke_attempt", req, RevokedAttempt)

    async def join(self, *, token: str, csr: str, claims: JoinClaims | None = None) -> JoinResult:
        """Trade a join token and hardware claims for a certificate (``agents.join``)."""
        register_secret(token)
        req = JoinRequest(token=token, csr=csr, claims=claims or JoinClaims())
        return await self._call("agents.join", req, JoinResult)

    async def list_joins(
        self, *, join_token_id: str | None = None, outcome: str | None = None, limit: int = 100
    ) -> list[JoinAudit]:
        req = ListJoinsRequest(join_token_id=join_token_id, outcome=outcome, limit=limit)
        return (await self._call("joins.list", req, JoinAuditList)).joins

    async def verify(
        self,
        *,
        signer_id: str,
        data: bytes,
        signature: bytes,
        once: bool = False,
        signed_at_ms: int | None = None,
    ) -> Verified:
        """Check ``signature`` over ``data`` against the signer's certificate.

        Raises ``UNAUTHENTICATED`` (``details.reason``: ``bad-signature``, ``cert-revoked``,
        ``cert-expired``, ``unknown-signer``, ``signature-replayed``, ``stale-signature``).
        """
        req = VerifyRequest(
            signer_id=signer_id,
            data=data,
            signature=signature,
            once=once,
            signed_at_ms=signed_at_ms,
        )
        return await self._call("signatures.verify", req, Verified)

    async def get_certificate(self, cert_id: str) -> CertificateInfo:
        return await self._call("certs.get", CertIdRequest(cert_id=cert_id), CertificateInfo)

    async def list_certificates(
        self,
        *,
        tenant_id: str | None = None,
        site_id: str | None = None,
        agent_id: str | None = None,
        join_token_id: str | None = None,
        include_revoked: bool = False,
        limit: int = DEFAULT_LIMIT,
    ) -> list[CertificateInfo]:
        """The first page; ``certificates_page`` gives the cursor of the rest."""
        page = await self.certificates_page(
            tenant_id=tenant_id,
            site_id=site_id,
            agent_id=agent_id,
            join_token_id=join_token_id,
            include_revoked=include_revoked,
            limit=limit,
        )
        return page.certificates

    async def certificates_page(
        self,
        *,
        tenant_id: str | None = None,
        site_id: str | None = None,
        agent_id: str | None = None,
        join_token_id: str | None = None,
        include_revoked: bool = False,
        limit: int = DEFAULT_LIMIT,
        cursor: str | None = None,
        cert_ids: list[str] | None = None,
    ) -> CertificateList:
        """One page of certificates, newest first; pass its ``next`` as ``cursor`` for the next.
        ``cert_ids`` (at most 1000) keeps only those."""
        req = ListCertificatesRequest(
            tenant_id=tenant_id,
            site_id=site_id,
            agent_id=agent_id,
            join_token_id=join_token_id,
            include_revoked=include_revoked,
            limit=limit,
            cursor=cursor,
            cert_ids=cert_ids,
        )
        return await self._call("certs.list", req, CertificateList)

    async def revoke_certificate(self, cert_id: str, *, reason: str | None = None) -> CertificateInfo:
        req = RevokeCertificateRequest(cert_id=cert_id, reason=reason)
        return await self._call("certs.revoke", req, CertificateInfo)

    async def ca(self) -> CaInfo:
        return await self._call("ca.get", {}, CaInfo)

    async def rewrap_keys(self) -> RewrapResult:
        """Re-seal the CA and token keys under the key file's current key."""
        return await self._call("keys.rewrap", {}, RewrapResult)


class StepPki:
    """``ctx.pki``: a ``PkiClient`` whose tokens are keyed by one step run's idempotency key.

    A re-run of the step gets the same tokens back: they are derived from the attempt's mint
    secret (``before_mint`` returns it), which no other caller has. A step that mints several
    tokens tells them apart with ``key=``; minting twice under one key in a run is
    ``INVALID_STATE``.
    With ``node_id`` (the workflow's node), ``node`` and ``provisioned`` tokens are bound to
    that node, so the agent that joins with one is addressed by the node id.
    """

    def __init__(
        self,
        client: PkiClient,
        idempotency_key: str,
        *,
        node_id: str | None = None,
        before_mint: Callable[[], Awaitable[bytes | None]] | None = None,
    ):
        self.client = client
        self.idempotency_key = idempotency_key
        self.node_id = node_id
        self._before_mint = before_mint
        self._mint_secret: bytes | None = None
        self._used: set[str] = set()

    async def issue_join_token(
        self,
        *,
        tenant_id: str,
        role: JoinRole,
        site_id: str | None = None,
        ttl_seconds: int,
        max_uses: int = 1,
        expect: JoinExpect | Mapping[str, str] | None = None,
        key: str | None = None,
    ) -> IssuedJoinToken:
        """Mint (or, on a re-run, find again) this step's token named ``key``."""
        ikey = self.idempotency_key if key is None else f"{self.idempotency_key}:{key}"
        if ikey in self._used:
            raise BcError(
                ErrorCode.INVALID_STATE,
                "this step already minted a token under that key; pass another key=",
                {"path": "key", "reason": "idempotency-key-reused"},
            )
        self._used.add(ikey)
        if self._before_mint is not None:
            before, self._before_mint = self._before_mint, None
            self._mint_secret = await before()
        return await self.client.issue_join_token(
            tenant_id=tenant_id,
            role=role,
            site_id=site_id,
            ttl_seconds=ttl_seconds,
            max_uses=max_uses,
            expect=expect,
            idempotency_key=ikey,
            node_id=self.node_id if role in ("node", "provisioned") else None,
            mint_secret=self._mint_secret,
        )
