"""The bc-secrets service process: sealed values, and the gate agents fetch them through.

Over 400 lines on purpose: every path that turns a sealed value into plaintext (an operator's
``get``, an agent's ``fetch`` with its signature check, live-command check and audit) is in this
one file, so a security review reads them side by side; the SQL is in ``store``.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, ClassVar, NoReturn

import msgspec

from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.pki import PkiClient
from better_compute.config import Settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id, parse_id
from better_compute.core.keys import any_workflow_command_prefix, step_key_prefix, workflow_command_prefix
from better_compute.crypto import fetch_document, reply_public_key, seal_value, signing_payload
from better_compute.keyring import Keyring, load_service_keyring
from better_compute.logging import register_secret
from better_compute.service import ApiRequest, Handler, Service
from better_compute.service.fences import attempt_superseded
from better_compute.wire.cmdq import LiveWithRefReply
from better_compute.wire.paging import decode_cursor, take_page
from better_compute.wire.pki import RevokeAttempt, RevokedAttempt, Verified
from better_compute.wire.secrets import (
    FETCH_PURPOSE,
    FetchAuditList,
    FetchSecretRequest,
    ListFetchesRequest,
    ListSecretsRequest,
    PutSecretRequest,
    RefRequest,
    SecretInfo,
    SecretList,
    SecretsRewrapResult,
    SecretValue,
)

from . import metrics, store

__all__ = ["SecretsService"]

_REWRAP_BATCH = 500
# One message for every refusal after authentication, so an agent cannot tell an unknown
# ref from one it may not read; the audit row keeps the real reason.
_DENIED = "no live command for this agent carries this reference"


class SecretsService(Service):
    """Secrets: encrypted values behind SecretRefs"""

    name: ClassVar[str] = "bc-secrets"
    api_name: ClassVar[str] = "secrets"
    schema: ClassVar[str | None] = "secrets"
    migrations_package: ClassVar[str | None] = "bc_secrets.migrations"
    description: ClassVar[str] = "Secrets: encrypted values behind SecretRefs"
    audit_routes: ClassVar[Mapping[str, tuple[str, ...]]] = {
        # never "value": the whitelist keeps what was stored out of the audit
        "secrets.put": ("tenantId", "workflowId", "step", "nodeId", "label"),
        "secrets.get": ("ref",),  # an operator's reveal (bcx secrets show --reveal)
        "keys.rewrap": (),
    }

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.keyring: Keyring | None = None

    async def on_start(self) -> None:
        key_file = self.settings.secrets.key_file
        self.keyring = load_service_keyring(self.settings, key_file, "secrets", self.log)
        self.log.info(
            "keyring_loaded",
            current_key_id=self.keyring.current_key_id,
            keys=len(self.keyring.key_ids),
        )

    def routes(self) -> Mapping[str, Handler]:
        return {
            "secrets.put": self.put,
            "secrets.get": self.get,
            "secrets.fetch": self.fetch,
            "secrets.describe": self.describe,
            "secrets.list": self.list_secrets,
            "fetches.list": self.list_fetches,
            "keys.rewrap": self.rewrap,
            "secrets.revoke_attempt": self.revoke_attempt,
        }

    @property
    def _ring(self) -> Keyring:
        if self.keyring is None:
            raise BcError(ErrorCode.UNAVAILABLE, "the keyring is not loaded yet")
        return self.keyring

    # -- control plane ------------------------------------------------------------

    async def put(self, req: ApiRequest) -> SecretInfo:
        assert self.db is not None
        body = req.decode(PutSecretRequest)
        register_secret(body.value)
        owners = (body.workflow_id is not None) + (body.node_id is not None) + body.template
        if owners != 1:
            raise BcError(
                ErrorCode.INVALID_INPUT,
                "a secret belongs to a workflow step (workflowId), a node (nodeId) or is a template"
                " (an enrollment rule's credential), one of them",
                {"path": "workflowId"},
            )
        workflow_id = parse_id(body.workflow_id, "wf", path="workflowId") if body.workflow_id else None
        node_id = parse_id(body.node_id, "node", path="nodeId") if body.node_id else None
        if body.for_node is not None and workflow_id is None:
            raise BcError(
                ErrorCode.INVALID_INPUT,
                "forNode names the node a workflow step's value is for: give workflowId with it",
                {"path": "forNode"},
            )
        for_node = parse_id(body.for_node, "node", path="forNode") if body.for_node else None
        ref = new_id("sec")
        ring = self._ring
        row = await self.db.fetchrow(
            store.SECRET_INSERT,
            ref,
            body.tenant_id,
            workflow_id,
            body.step,
            body.idempotency_key,
            body.label,
            len(body.value),
            ring.current_key_id,
            ring.seal(body.value, aad=ref.encode()),
            node_id,
            for_node,
        )
        again = row is None
        if again:
            # First write wins: a re-run gets the ref the first run may already have sent.
            row = await self.db.fetchrow(store.SECRET_SELECT_BY_IDEMPOTENCY_KEY, body.idempotency_key)
            if row is None:
                raise BcError(ErrorCode.CONFLICT, "secret ref collision; put again")
            first = (row["tenant_id"], row["workflow_id"], row["step"], row["node_id"], row["for_node"])
            if first != (body.tenant_id, workflow_id, body.step, node_id, for_node):
                raise BcError(
                    ErrorCode.CONFLICT,
                    "idempotency key already used for another workflow step's secret",
                    {"path": "idempotencyKey"},
                )
        if body.idempotency_key is not None and await store.FENCES.revoke_if_fenced(
            self.db, body.idempotency_key, row["ref"], "stored by a superseded step attempt"
        ):
            self.log.warning("secret_refused_superseded", ref=row["ref"])
            raise attempt_superseded("stores")
        info = store.secret_info(row)
        self.log.info(
            "secret_stored",
            ref=info.ref,
            tenant_id=info.tenant_id,
            workflow_id=info.workflow_id,
            step_index=info.step,
            size=info.size,
            again=again,
        )
        return info

    async def revoke_attempt(self, req: ApiRequest) -> RevokedAttempt:
        """Revoke every value one workflow step attempt stored, and fence its key."""
        assert self.db is not None
        body = req.decode(RevokeAttempt)
        prefix, revoked = await store.FENCES.fence(
            self.db, workflow_id=body.workflow_id, step=body.step, attempt=body.attempt, reason=body.reason
        )
        if revoked:
            self.log.info("secrets_revoked", key=prefix, refs=revoked)
        return RevokedAttempt(revoked=revoked)

    async def _row(self, ref: str) -> Any:
        assert self.db is not None
        row = await self.db.fetchrow(store.SECRET_SELECT, ref)
        if row is None:
            raise BcError(ErrorCode.NOT_FOUND, "no such secret", {"path": "ref"})
        return row

    def _open(self, row: Any) -> bytes:
        value = self._ring.open(row["sealed"], aad=row["ref"].encode())
        register_secret(value)
        return value

    async def get(self, req: ApiRequest) -> SecretValue:
        ref = parse_id(req.decode(RefRequest).ref, "sec", path="ref")
        row = await self._row(ref)
        if row["revoked_at"] is not None:
            raise BcError(
                ErrorCode.INVALID_STATE,
                "the secret was revoked: the step attempt that stored it was superseded",
                {"path": "ref", "reason": "secret-revoked"},
            )
        value = self._open(row)
        self.log.info("secret_read", ref=ref, workflow_id=row["workflow_id"])
        return SecretValue(ref=ref, value=value)

    async def describe(self, req: ApiRequest) -> SecretInfo:
        ref = parse_id(req.decode(RefRequest).ref, "sec", path="ref")
        return store.secret_info(await self._row(ref))

    async def list_secrets(self, req: ApiRequest) -> SecretList:
        assert self.db is not None
        body = req.decode(ListSecretsRequest)
        at, ref = decode_cursor(body.cursor, datetime, str) or (None, None)
        rows = await self.db.fetch(
            store.SECRET_LIST, body.tenant_id, body.workflow_id, at, ref, body.limit + 1
        )
        found, next_ = take_page(
            [store.secret_info(r) for r in rows], limit=body.limit, key=lambda s: (s.created_at, s.ref),
            budget=req.page_budget,
        )  # fmt: skip
        return SecretList(secrets=found, next=next_)

    async def list_fetches(self, req: ApiRequest) -> FetchAuditList:
        assert self.db is not None
        body = req.decode(ListFetchesRequest)
        (before,) = decode_cursor(body.cursor, int) or (None,)
        rows = await self.db.fetch(store.FETCH_AUDIT_LIST, body.ref, body.outcome, before, body.limit + 1)
        fetches, next_ = take_page(
            [store.fetch_audit(r) for r in rows], limit=body.limit, key=lambda f: (f.id,),
            budget=req.page_budget,
        )  # fmt: skip
        return FetchAuditList(fetches=fetches, next=next_)

    async def rewrap(self, _req: ApiRequest) -> SecretsRewrapResult:
        """Re-seal every value sealed under an older key with the current one."""
        assert self.db is not None
        ring = self._ring
        total = 0
        while True:
            async with self.db.transaction() as conn:
                rows = await conn.fetch(store.SECRET_SELECT_STALE_KEY, ring.current_key_id, _REWRAP_BATCH)
                for row in rows:
                    sealed = ring.reseal(row["sealed"], aad=row["ref"].encode())
                    await conn.execute(store.SECRET_RESEAL, row["ref"], sealed, ring.current_key_id)
            total += len(rows)
            if len(rows) < _REWRAP_BATCH:
                break
        self.log.info("secrets_rewrapped", key_id=ring.current_key_id, rewrapped=total)
        return SecretsRewrapResult(key_id=ring.current_key_id, rewrapped=total)

    # -- agents -------------------------------------------------------------------

    async def fetch(self, req: ApiRequest) -> SecretValue:
        """An agent's fetch: signed by its certificate key, gated on a live command.

        Every refusal is audited before it is returned.
        """
        try:
            body = req.decode(FetchSecretRequest)
            ref = parse_id(body.ref, "sec", path="ref")
            reply_public_key(body.reply_key)  # the answer is sealed to it: check it first
        except BcError as err:
            named_ref, named_signer = _named(req.data)
            await self._deny(err, reason="malformed", ref=named_ref, signer_id=named_signer)
        verified = await self._authenticate(body, ref)
        assert self.db is not None
        row = await self.db.fetchrow(store.SECRET_SELECT, ref)
        if row is None:
            await self._deny(
                BcError(ErrorCode.PERMISSION_DENIED, _DENIED, {"reason": "no-live-command"}),
                reason="unknown-ref",
                ref=ref,
                body=body,
                verified=verified,
            )
        if row["revoked_at"] is not None:
            await self._deny(
                BcError(ErrorCode.PERMISSION_DENIED, _DENIED, {"reason": "no-live-command"}),
                reason="revoked",
                ref=ref,
                body=body,
                verified=verified,
            )
        if row["workflow_id"] is None and row["node_id"] is None:
            # a template (an enrollment rule's credential): the engine copies it, agents never read it
            await self._deny(
                BcError(ErrorCode.PERMISSION_DENIED, _DENIED, {"reason": "no-live-command"}),
                reason="template",
                ref=ref,
                body=body,
                verified=verified,
            )
        command_id = await self._live_command(row, ref, body, verified)
        value = self._open(row)
        await self._audit("granted", ref=ref, body=body, verified=verified, command_id=command_id)
        self.log.info("secret_fetched", ref=ref, agent_id=verified.agent_id, command_id=command_id)
        # sealed to the key the agent signed into its request: others on the bus see ciphertext
        return SecretValue(ref=ref, sealed=seal_value(body.reply_key, ref, value))

    async def _authenticate(self, body: FetchSecretRequest, ref: str) -> Verified:
        assert self.api is not None
        doc = fetch_document(
            ref=ref,
            signer_id=body.signer_id,
            signed_at_ms=body.signed_at_ms,
            nonce=body.nonce,
            reply_key=body.reply_key,
        )
        try:
            return await PkiClient(self.api, timeout=5.0).verify(
                signer_id=body.signer_id,
                data=signing_payload(FETCH_PURPOSE, doc),
                signature=body.signature,
                once=True,
                signed_at_ms=body.signed_at_ms,
            )
        except BcError as err:
            if err.code in (ErrorCode.UNAUTHENTICATED, ErrorCode.INVALID_INPUT):
                refusal = BcError(err.code, f"fetch refused: {err.message}", err.details)
                await self._deny(refusal, reason=err.reason or "invalid", ref=ref, body=body)
            await self._deny(
                BcError(ErrorCode.UNAVAILABLE, "cannot check the agent's signature now"),
                reason="pki-unavailable",
                ref=ref,
                body=body,
            )

    async def _live_command(
        self, row: Any, ref: str, body: FetchSecretRequest, verified: Verified
    ) -> str | None:
        assert self.api is not None
        answer = await self._ask_live(
            agent_id=verified.agent_id,
            ref=ref,
            # a node's standing secret: any workflow's live command for that node
            key_prefix=(
                step_key_prefix(row["workflow_id"], row["step"])
                if row["workflow_id"]
                else any_workflow_command_prefix()
            ),
            node_id=row["node_id"],
            body=body,
            verified=verified,
        )
        if not answer.live and row["for_node"] is not None and verified.agent_id == row["for_node"]:
            # A value meant for the workflow's node (its user data): another step of the same
            # workflow may hand the reference to that node, in a command delivered to the node
            # itself (the deploy step's image write). Never to another agent, a site agent that
            # acts for the node included, and never from another workflow's command.
            answer = await self._ask_live(
                agent_id=verified.agent_id,
                ref=ref,
                key_prefix=workflow_command_prefix(row["workflow_id"]),
                node_id=row["for_node"],
                body=body,
                verified=verified,
            )
        if not answer.live:
            await self._deny(
                BcError(ErrorCode.PERMISSION_DENIED, _DENIED, {"reason": "no-live-command"}),
                reason="no-live-command",
                ref=ref,
                body=body,
                verified=verified,
            )
        return answer.command_id

    async def _ask_live(
        self,
        *,
        agent_id: str,
        ref: str,
        key_prefix: str,
        node_id: str | None,
        body: FetchSecretRequest,
        verified: Verified,
    ) -> LiveWithRefReply:
        assert self.api is not None
        try:
            return await CommandQueueClient(self.api, timeout=5.0).live_with_ref(
                agent_id=agent_id, ref=ref, key_prefix=key_prefix, node_id=node_id
            )
        except BcError:
            # Fail closed: without the command queue's word, nobody reads the value.
            await self._deny(
                BcError(ErrorCode.UNAVAILABLE, "cannot check the agent's commands now"),
                reason="command-queue-unavailable",
                ref=ref,
                body=body,
                verified=verified,
            )

    async def _audit(
        self,
        outcome: str,
        *,
        ref: str | None,
        body: FetchSecretRequest | None,
        verified: Verified | None = None,
        code: str | None = None,
        reason: str | None = None,
        command_id: str | None = None,
        signer_id: str | None = None,
    ) -> None:
        assert self.db is not None
        metrics.FETCHES.labels(outcome, reason or "").inc()
        await self.db.execute(
            store.FETCH_AUDIT_INSERT,
            outcome,
            ref,
            code,
            reason,
            body.signer_id[:64] if body is not None else signer_id,
            verified.agent_id if verified is not None else None,
            command_id,
            self.instance,
        )

    async def _deny(
        self,
        error: BcError,
        *,
        reason: str,
        ref: str | None = None,
        body: FetchSecretRequest | None = None,
        verified: Verified | None = None,
        signer_id: str | None = None,
    ) -> NoReturn:
        """Audit a refused fetch, log it, and raise ``error``."""
        await self._audit(
            "denied",
            ref=ref,
            body=body,
            verified=verified,
            code=error.code.value,
            reason=reason,
            signer_id=signer_id,
        )
        self.log.warning(
            "secret_fetch_denied",
            ref=ref,
            reason=reason,
            code=error.code.value,
            agent_id=verified.agent_id if verified is not None else None,
        )
        raise error


class _Names(msgspec.Struct, kw_only=True, rename="camel"):
    ref: Any = None
    signer_id: Any = None


def _named(data: bytes) -> tuple[str | None, str | None]:
    """What a fetch that failed to decode names, for its audit row: its ref and signer, each
    only when it is a well-formed id (anything else would be the caller's text in the audit)."""
    try:
        names = msgspec.json.decode(data, type=_Names)
    except (msgspec.DecodeError, RecursionError):
        return None, None
    return _well_formed(names.ref, "sec"), _well_formed(names.signer_id, "cert")


def _well_formed(value: Any, prefix: str) -> str | None:
    try:
        return parse_id(value, prefix)
    except BcError:
        return None
