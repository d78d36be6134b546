"""The secrets service's contract: its requests, replies and routes (the client is
``better_compute.clients.SecretsClient``; sealing is in ``better_compute.crypto``).

Every route is ``bc.api.secrets.<resource>.<verb>`` (``SERVICE``):

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

from datetime import datetime
from typing import Annotated, Final, Literal

import msgspec

from ..core.names import Name
from .paging import DEFAULT_LIMIT, Cursor
from .pki import IdempotencyKey, Limit, RevokeAttempt, RevokedAttempt

__all__ = [
    "FETCH_PURPOSE",
    "MAX_SECRET_BYTES",
    "SERVICE",
    "FetchAudit",
    "FetchAuditList",
    "FetchSecretRequest",
    "ListFetchesRequest",
    "ListSecretsRequest",
    "PutSecretRequest",
    "RefRequest",
    "RevokeAttempt",
    "RevokedAttempt",
    "SealedValue",
    "SecretInfo",
    "SecretList",
    "SecretValue",
    "SecretsRewrapResult",
]

SERVICE: Final = "secrets"
"""The service token of every route: ``bc.api.secrets.<resource>.<verb>``."""
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
    for_node: str | None = None
    """With ``workflowId``: the node the workflow runs on, when the value is meant for it (its
    rendered user data). Then a live command of *any* step of that workflow, delivered to that
    node itself and carrying the reference, opens it to that node too, and to no other agent."""
    template: bool = False
    """Instead of either: a credential the engine copies into the standing secret of each node an
    enrollment rule enrolls (the rule's BMC credential). No agent ever fetches it itself."""
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
    for_node: str | None = None
    """A workflow step's value meant for that workflow's node (its user data): see
    ``PutSecretRequest.for_node``."""


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
