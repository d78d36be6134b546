"""The secrets service over NATS: its messages and a client.

``SecretsClient`` is what ``ctx.secrets`` is (through ``SecretsClient.for_step``). Every
route is ``bc.api.secrets.<resource>.<verb>``:

=====================  ======================  ==========================================
route                  request                 result
=====================  ======================  ==========================================
``secrets.put``        ``PutSecretRequest``    ``SecretInfo``
``secrets.get``        ``RefRequest``          ``SecretValue`` (control plane only)
``secrets.fetch``      ``FetchSecretRequest``  ``SecretValue`` (an agent, signed request)
``secrets.describe``   ``RefRequest``          ``SecretInfo``
``secrets.list``       ``ListSecretsRequest``  ``SecretList`` (metadata only)
``fetches.list``       ``ListFetchesRequest``  ``FetchAuditList``
``keys.rewrap``        ``{}``                  ``SecretsRewrapResult``
``secrets.revoke_attempt````RevokeAttempt``     ``RevokedAttempt`` (control plane only)
=====================  ======================  ==========================================

``secrets.get`` trusts the caller to be the control plane: deployments deny agents that
subject with NATS permissions. Agents use ``secrets.fetch``, which proves who asks (a
signature by the agent's certificate key) and is answered only while a live command of the
secret's workflow step for that agent carries the reference.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Annotated, Any, Final, Literal, TypeVar

import msgspec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from .core.errors import BcError, ErrorCode
from .core.names import Name
from .logging import register_secret
from .pki_client import (
    AgentIdentity,
    IdempotencyKey,
    Limit,
    RevokeAttempt,
    RevokedAttempt,
    attempt_key,
    unavailable,
)
from .service.client import ApiClient
from .wire.paging import DEFAULT_LIMIT, Cursor

__all__ = [
    "FETCH_PURPOSE",
    "MAX_SECRET_BYTES",
    "FetchAudit",
    "FetchAuditList",
    "FetchSecretRequest",
    "ListFetchesRequest",
    "ListSecretsRequest",
    "PutSecretRequest",
    "RefRequest",
    "SealedValue",
    "SecretInfo",
    "SecretList",
    "SecretValue",
    "SecretsClient",
    "SecretsRewrapResult",
    "StepSecrets",
    "fetch_document",
    "open_sealed",
    "reply_public_key",
    "seal_value",
]

T = TypeVar("T")

FETCH_PURPOSE: Final = "secrets.fetch"
MAX_SECRET_BYTES: Final = 512 * 1024
"""Base64 on the wire makes this about 700 KB: under NATS's default 1 MB payload."""

Label = Annotated[str, msgspec.Meta(max_length=200)]


class PutSecretRequest(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    tenant_id: Name
    workflow_id: str | None = None
    step: Annotated[int, msgspec.Meta(ge=0, le=511)] = 0
    """Index of the creating step in its workflow: agents read the value only while a live
    command keyed ``wf:<workflowId>:<step>…`` carries the reference."""
    node_id: str | None = None
    """Instead of a workflow step: a node's standing secret (its BMC credential), read only while
    a live command of any workflow for that node carries the reference."""
    value: Annotated[bytes, msgspec.Meta(max_length=MAX_SECRET_BYTES)]
    idempotency_key: IdempotencyKey | None = None
    label: Label | None = None

    def __repr__(self) -> str:
        return f"PutSecretRequest(workflow_id={self.workflow_id!r}, value=[redacted])"


class RefRequest(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    ref: str


class FetchSecretRequest(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """An agent's signed request for a value; the signature covers ``fetch_document``.

    ``reply_key`` (base64 of a raw X25519 public key, fresh for each fetch, inside the signed
    document) is required: the value goes back sealed to that key, so another subscriber that
    sees the reply on the bus (an agent of the same site sharing ``_INBOX``) sees only
    ciphertext. A request without it is ``INVALID_INPUT`` at ``replyKey``; nothing is ever
    answered in the clear.
    """

    ref: str
    signer_id: str
    signed_at_ms: int
    nonce: Annotated[str, msgspec.Meta(min_length=16, max_length=64)]
    signature: Annotated[bytes, msgspec.Meta(max_length=512)]
    reply_key: Annotated[str, msgspec.Meta(min_length=40, max_length=48)]


class ListSecretsRequest(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    tenant_id: Name | None = None
    workflow_id: str | None = None
    limit: Limit = DEFAULT_LIMIT
    cursor: Cursor | None = None
    """The ``next`` of the page before (newest first)."""


class ListFetchesRequest(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    ref: str | None = None
    outcome: Literal["granted", "denied"] | None = None
    limit: Limit = DEFAULT_LIMIT
    cursor: Cursor | None = None


class SecretInfo(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """What is known about a secret without its value."""

    ref: str
    tenant_id: str
    workflow_id: str | None
    step: int
    size: int
    key_id: str
    created_at: datetime
    label: str | None = None
    idempotency_key: str | None = None
    revoked_at: datetime | None = None
    """Set once the step attempt that stored it was superseded: nobody reads it any more."""
    node_id: str | None = None
    """A node's standing secret (no workflow): its BMC credential."""


class SecretList(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    secrets: list[SecretInfo]
    next: str | None = None
    """The cursor of the next page; None after the last."""


class SealedValue(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """A value sealed to a fetch's reply key: X25519 with a one-time server key, HKDF-SHA256,
    AES-256-GCM with the ref as associated data."""

    ephemeral_key: bytes
    nonce: bytes
    ciphertext: bytes


class SecretValue(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    ref: str
    value: bytes = b""
    sealed: SealedValue | None = None

    def __repr__(self) -> str:
        return f"SecretValue(ref={self.ref!r}, value=[redacted])"


class FetchAudit(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    id: int
    at: datetime
    outcome: Literal["granted", "denied"]
    ref: str | None = None
    code: str | None = None
    reason: str | None = None
    signer_id: str | None = None
    agent_id: str | None = None
    command_id: str | None = None


class FetchAuditList(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    fetches: list[FetchAudit]
    next: str | None = None


class SecretsRewrapResult(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    key_id: str
    rewrapped: int


def fetch_document(
    *, ref: str, signer_id: str, signed_at_ms: int, nonce: str, reply_key: str
) -> dict[str, Any]:
    """The document an agent signs (under ``FETCH_PURPOSE``) to fetch ``ref``."""
    return {
        "ref": ref,
        "signerId": signer_id,
        "signedAtMs": signed_at_ms,
        "nonce": nonce,
        "replyKey": reply_key,
    }


_SEAL_INFO: Final = b"bc-secrets-fetch-v1:"


def _seal_key(shared: bytes, ref: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_SEAL_INFO + ref.encode()).derive(
        shared
    )


def reply_public_key(reply_key: str) -> X25519PublicKey:
    """``replyKey`` as an X25519 public key; ``INVALID_INPUT`` at ``replyKey`` when it is not one."""
    try:
        return X25519PublicKey.from_public_bytes(base64.b64decode(reply_key, validate=True))
    except ValueError as exc:
        raise BcError(
            ErrorCode.INVALID_INPUT, "replyKey is not an X25519 public key", {"path": "replyKey"}
        ) from exc


def seal_value(reply_key: str, ref: str, value: bytes) -> SealedValue:
    """Seal ``value`` so that only the holder of ``reply_key``'s private half can open it."""
    peer = reply_public_key(reply_key)
    mine = X25519PrivateKey.generate()
    nonce = os.urandom(12)
    ciphertext = AESGCM(_seal_key(mine.exchange(peer), ref)).encrypt(nonce, value, ref.encode())
    return SealedValue(
        ephemeral_key=mine.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw),
        nonce=nonce,
        ciphertext=ciphertext,
    )


def open_sealed(private_key: X25519PrivateKey, ref: str, sealed: SealedValue) -> bytes:
    """The value inside ``sealed``, with the fetch's X25519 private key."""
    try:
        shared = private_key.exchange(X25519PublicKey.from_public_bytes(sealed.ephemeral_key))
        value: bytes = AESGCM(_seal_key(shared, ref)).decrypt(sealed.nonce, sealed.ciphertext, ref.encode())
    except (ValueError, InvalidTag) as exc:
        raise BcError(ErrorCode.INTERNAL, "the sealed value from bc-secrets does not open") from exc
    return value


class SecretsClient:
    """Calls to bc-secrets over NATS; raises the service's ``BcError``s.

    Values that pass through are registered with the log redactor of this process.
    """

    service: Final = "secrets"

    def __init__(self, api: ApiClient, *, timeout: float = 10.0) -> None:
        self.api = api
        self.timeout = timeout

    async def _call(self, route: str, payload: Any, typ: type[T]) -> T:
        try:
            return await self.api.call_as(self.service, route, payload, typ, timeout=self.timeout)
        except BcError as err:
            if (marked := unavailable(err, "bc-secrets")) is not None:
                raise marked from err
            raise

    def for_step(
        self,
        *,
        tenant_id: str,
        workflow_id: str,
        step: int,
        attempt: int | None = None,
        before_put: Callable[[], Awaitable[None]] | None = None,
    ) -> StepSecrets:
        """The client a step sees as ``ctx.secrets``: values belong to that workflow step and,
        with ``attempt``, are keyed under that attempt (so a later attempt can revoke them).
        ``before_put`` runs before the first value is stored."""
        return StepSecrets(
            self, tenant_id=tenant_id, workflow_id=workflow_id, step=step, attempt=attempt,
            before_put=before_put,
        )  # fmt: skip

    async def revoke_attempt(
        self, *, workflow_id: str, step: int, attempt: int, reason: str | None = None
    ) -> RevokedAttempt:
        """Revoke the values one step attempt stored and refuse new ones under its key
        (``secrets.revoke_attempt``); safe to repeat."""
        req = RevokeAttempt(workflow_id=workflow_id, step=step, attempt=attempt, reason=reason)
        return await self._call("secrets.revoke_attempt", req, RevokedAttempt)

    async def put(
        self,
        value: bytes,
        *,
        tenant_id: str,
        workflow_id: str,
        step: int,
        idempotency_key: str | None = None,
        label: str | None = None,
    ) -> SecretInfo:
        """Store ``value``; the same ``idempotency_key`` returns the first call's ref."""
        register_secret(value)
        req = PutSecretRequest(
            tenant_id=tenant_id,
            workflow_id=workflow_id,
            step=step,
            value=value,
            idempotency_key=idempotency_key,
            label=label,
        )
        return await self._call("secrets.put", req, SecretInfo)

    async def put_for_node(
        self, value: bytes, *, tenant_id: str, node_id: str, label: str | None = None
    ) -> SecretInfo:
        """Store a node's standing secret (its BMC credential): an agent reads it only while a
        live command of some workflow for that node carries the reference."""
        register_secret(value)
        req = PutSecretRequest(tenant_id=tenant_id, node_id=node_id, value=value, label=label)
        return await self._call("secrets.put", req, SecretInfo)

    async def get(self, ref: str) -> bytes:
        """The value behind ``ref``: control plane only."""
        got = await self._call("secrets.get", RefRequest(ref=ref), SecretValue)
        register_secret(got.value)
        return got.value

    async def fetch(self, ref: str, *, identity: AgentIdentity) -> bytes:
        """The value behind ``ref``, asked for as the agent ``identity`` (signed afresh), sealed
        on the way to a key made for this one fetch."""
        reply = X25519PrivateKey.generate()
        raw = reply.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        reply_key = base64.b64encode(raw).decode()
        request = identity.signed_request(FETCH_PURPOSE, ref=ref, replyKey=reply_key)
        got = await self._call("secrets.fetch", request, SecretValue)
        if got.sealed is None:
            raise BcError(ErrorCode.INTERNAL, "bc-secrets answered a sealed fetch in the clear")
        value = open_sealed(reply, ref, got.sealed)
        register_secret(value)
        return value

    async def describe(self, ref: str) -> SecretInfo:
        return await self._call("secrets.describe", RefRequest(ref=ref), SecretInfo)

    async def list_secrets(
        self, *, tenant_id: str | None = None, workflow_id: str | None = None, limit: int = DEFAULT_LIMIT
    ) -> list[SecretInfo]:
        """The first page; ``secrets_page`` gives the cursor of the rest."""
        return (await self.secrets_page(tenant_id=tenant_id, workflow_id=workflow_id, limit=limit)).secrets

    async def secrets_page(
        self,
        *,
        tenant_id: str | None = None,
        workflow_id: str | None = None,
        limit: int = DEFAULT_LIMIT,
        cursor: str | None = None,
    ) -> SecretList:
        """One page of secrets (metadata only), newest first; pass its ``next`` as ``cursor``."""
        req = ListSecretsRequest(tenant_id=tenant_id, workflow_id=workflow_id, limit=limit, cursor=cursor)
        return await self._call("secrets.list", req, SecretList)

    async def list_fetches(
        self,
        *,
        ref: str | None = None,
        outcome: Literal["granted", "denied"] | None = None,
        limit: int = 100,
    ) -> list[FetchAudit]:
        req = ListFetchesRequest(ref=ref, outcome=outcome, limit=limit)
        return (await self._call("fetches.list", req, FetchAuditList)).fetches

    async def rewrap_keys(self) -> SecretsRewrapResult:
        """Re-seal every stored value under the key file's current key."""
        return await self._call(
            "keys.rewrap",
            {},
            SecretsRewrapResult,
        )


class StepSecrets:
    """``ctx.secrets``: a ``SecretsClient`` bound to one workflow step (and attempt)."""

    def __init__(
        self,
        client: SecretsClient,
        *,
        tenant_id: str,
        workflow_id: str,
        step: int,
        attempt: int | None = None,
        before_put: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.client = client
        self.tenant_id = tenant_id
        self.workflow_id = workflow_id
        self.step = step
        self.attempt = attempt
        self._before_put = before_put

    def _key(self, idempotency_key: str | None) -> str | None:
        """Keys live under the attempt's key (``wf:<id>:<step>#<attempt>``), so what an attempt
        stored is revoked with it; an unkeyed value gets a key of its own there."""
        if self.attempt is None:
            return idempotency_key
        base = attempt_key(self.workflow_id, self.step, self.attempt)
        if idempotency_key is None:
            return f"{base}:~{os.urandom(8).hex()}"
        if idempotency_key == base or idempotency_key.startswith(base + ":"):
            return idempotency_key
        return f"{base}:{idempotency_key}"

    async def put(self, value: bytes, *, idempotency_key: str | None = None, label: str | None = None) -> str:
        """Store ``value`` for this workflow step and return its SecretRef (``sec_…``).

        The same ``idempotency_key`` returns the same ref within one attempt of the step, so a
        re-run stores nothing twice; a new attempt (retry, resume) stores anew, and the values
        of the attempt it superseded are revoked.
        """
        if self._before_put is not None:
            before, self._before_put = self._before_put, None
            await before()
        info = await self.client.put(
            value,
            tenant_id=self.tenant_id,
            workflow_id=self.workflow_id,
            step=self.step,
            idempotency_key=self._key(idempotency_key),
            label=label,
        )
        return info.ref
