"""The client of bc-secrets: ``SecretsClient``, and ``StepSecrets`` (what a step sees as
``ctx.secrets``).

The routes and their Structs are ``better_compute.wire.secrets``; sealing a fetched value is
``better_compute.crypto``.
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Literal

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from ..core.errors import BcError, ErrorCode
from ..core.keys import attempt_key
from ..crypto import AgentIdentity, open_sealed
from ..logging import register_secret
from ..wire.paging import DEFAULT_LIMIT
from ..wire.secrets import (
    FETCH_PURPOSE,
    SERVICE,
    FetchAudit,
    FetchAuditList,
    ListFetchesRequest,
    ListSecretsRequest,
    PutSecretRequest,
    RefRequest,
    RevokeAttempt,
    RevokedAttempt,
    SecretInfo,
    SecretList,
    SecretsRewrapResult,
    SecretValue,
)
from ._base import ServiceClient

__all__ = ["SecretsClient", "StepSecrets"]


class SecretsClient(ServiceClient):
    """Calls to bc-secrets over NATS; raises the service's ``BcError``s.

    Values that pass through are registered with the log redactor of this process.
    """

    service = SERVICE
    unavailable_as = "bc-secrets"

    def for_step(
        self,
        *,
        tenant_id: str,
        workflow_id: str,
        step: int,
        attempt: int | None = None,
        before_put: Callable[[], Awaitable[None]] | None = None,
        node_id: str | None = None,
        stored: MutableMapping[tuple[str, str], str] | None = None,
    ) -> StepSecrets:
        """The client a step sees as ``ctx.secrets``: values belong to that workflow step and,
        with ``attempt``, are keyed under that attempt (so a later attempt can revoke them).
        ``before_put`` runs before the first value is stored; ``node_id`` is the workflow's node
        (what ``put(for_node=True)`` stores a value for). ``stored``: the refs earlier runs of
        the attempt got, by idempotency key and a digest of what was put (the engine's memo, in
        memory only); a keyed ``put`` found there returns its ref without a request."""
        return StepSecrets(
            self, tenant_id=tenant_id, workflow_id=workflow_id, step=step, attempt=attempt,
            before_put=before_put, node_id=node_id, stored=stored,
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
        *,
        value: bytes,
        tenant_id: str,
        workflow_id: str,
        step: int,
        idempotency_key: str | None = None,
        label: str | None = None,
        for_node: str | None = None,
    ) -> SecretInfo:
        """Store ``value``; the same ``idempotency_key`` returns the first call's ref. With
        ``for_node`` (the workflow's node) the value is meant for that node: a live command of
        any step of the workflow delivered to the node opens it to the node."""
        register_secret(value)
        req = PutSecretRequest(
            tenant_id=tenant_id,
            workflow_id=workflow_id,
            step=step,
            value=value,
            idempotency_key=idempotency_key,
            label=label,
            for_node=for_node,
        )
        return await self._call("secrets.put", req, SecretInfo)

    async def put_for_node(
        self,
        value: bytes,
        *,
        tenant_id: str,
        node_id: str,
        label: str | None = None,
        idempotency_key: str | None = None,
    ) -> SecretInfo:
        """Store a node's standing secret (its BMC credential): an agent reads it only while a
        live command of some workflow for that node carries the reference."""
        register_secret(value)
        req = PutSecretRequest(
            tenant_id=tenant_id, node_id=node_id, value=value, label=label, idempotency_key=idempotency_key
        )
        return await self._call("secrets.put", req, SecretInfo)

    async def put_template(self, value: bytes, *, tenant_id: str, label: str | None = None) -> SecretInfo:
        """Store an enrollment rule's BMC credential: no agent reads it; the engine copies it into
        the standing secret of each node the rule enrolls."""
        register_secret(value)
        req = PutSecretRequest(tenant_id=tenant_id, template=True, value=value, label=label)
        return await self._call("secrets.put", req, SecretInfo)

    async def get(self, *, ref: str) -> bytes:
        """The value behind ``ref``: control plane only."""
        got = await self._call("secrets.get", RefRequest(ref=ref), SecretValue)
        register_secret(got.value)
        return got.value

    async def fetch(self, *, ref: str, identity: AgentIdentity) -> bytes:
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

    async def describe(self, *, ref: str) -> SecretInfo:
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
        node_id: str | None = None,
        stored: MutableMapping[tuple[str, str], str] | None = None,
    ) -> None:
        self.client = client
        self._stored = stored
        self.node_id = node_id
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

    async def put(
        self,
        value: bytes,
        *,
        idempotency_key: str | None = None,
        label: str | None = None,
        for_node: bool = False,
    ) -> str:
        """Store ``value`` for this workflow step and return its SecretRef (``sec_…``).

        The same ``idempotency_key`` returns the same ref within one attempt of the step, so a
        re-run stores nothing twice; a new attempt (retry, resume) stores anew, and the values
        of the attempt it superseded are revoked. With ``for_node`` the value is meant for the
        workflow's node (its user data): another step's command to that node may carry the
        reference, and the node, and only it, may then fetch it.
        """
        if for_node and self.node_id is None:
            raise BcError(
                ErrorCode.INVALID_CONFIG,
                "a value for the workflow's node needs a workflow with a node",
                {"path": "nodeId"},
            )
        key = self._key(idempotency_key)
        memo: tuple[str, str] | None = None
        if self._stored is not None and idempotency_key is not None and key is not None:
            digest = hashlib.sha256(value)
            digest.update(f"\0{label or ''}\0{for_node}".encode())
            memo = (key, digest.hexdigest())
            if (ref := self._stored.get(memo)) is not None:
                return ref  # an earlier run of this attempt stored it: the same ref, no request
        if self._before_put is not None:
            before, self._before_put = self._before_put, None
            await before()
        info = await self.client.put(
            value=value,
            tenant_id=self.tenant_id,
            workflow_id=self.workflow_id,
            step=self.step,
            idempotency_key=key,
            label=label,
            for_node=self.node_id if for_node else None,
        )
        if memo is not None and self._stored is not None:
            self._stored[memo] = info.ref
        return info.ref
