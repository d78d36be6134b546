"""The client of bc-pki: ``PkiClient``, and ``StepPki`` (what a step sees as ``ctx.pki``).

The routes and their Structs are ``better_compute.wire.pki``.
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from ..core.errors import BcError, ErrorCode
from ..crypto import AgentIdentity
from ..logging import register_secret
from ..wire.paging import DEFAULT_LIMIT
from ..wire.pki import (
    BURN_PURPOSE,
    CONFIRM_PURPOSE,
    SERVICE,
    BurnedJoinToken,
    BurnJoinTokenRequest,
    CaInfo,
    CertIdRequest,
    CertificateInfo,
    CertificateList,
    ConfirmedJoinToken,
    ConfirmJoinTokenRequest,
    IssuedJoinToken,
    JoinAudit,
    JoinAuditList,
    JoinClaims,
    JoinExpect,
    JoinRequest,
    JoinResult,
    JoinRole,
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
    TokenState,
    Verified,
    VerifyRequest,
)
from ._base import ServiceClient

__all__ = ["PkiClient", "StepPki"]


class PkiClient(ServiceClient):
    """Calls to bc-pki over NATS; raises the service's ``BcError``s."""

    service = SERVICE
    unavailable_as = "bc-pki"

    def for_step(
        self,
        *,
        idempotency_key: str,
        node_id: str | None = None,
        before_mint: Callable[[], Awaitable[bytes | None]] | None = None,
        issued: MutableMapping[str, IssuedJoinToken] | None = None,
    ) -> StepPki:
        """The client a step sees as ``ctx.pki``: tokens keyed by the step's idempotency key,
        and ``node``/``provisioned`` tokens bound to the workflow's node. ``before_mint`` runs
        before the first token is minted (the engine records that the attempt minted) and
        returns the attempt's mint secret: the same one on every run of the attempt, kept
        where only the engine reads it. Only with it does a re-run get its tokens back.
        ``issued``: the tokens earlier runs of the attempt got, by idempotency key (the
        engine's memo, in memory only); a token found there is returned without a request."""
        return StepPki(
            self, idempotency_key=idempotency_key, node_id=node_id, before_mint=before_mint, issued=issued
        )

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
        held: bool = False,
    ) -> IssuedJoinToken:
        """Mint a join token (``tokens.issue``); ``held``: see ``IssueJoinTokenRequest.held``.

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
        if held:
            payload["held"] = True
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

    async def get_join_token(self, *, join_token_id: str) -> JoinTokenInfo:
        req = JoinTokenIdRequest(join_token_id=join_token_id)
        return await self._call("tokens.get", req, JoinTokenInfo)

    async def revoke_join_token(self, *, join_token_id: str, reason: str | None = None) -> JoinTokenInfo:
        req = RevokeJoinTokenRequest(join_token_id=join_token_id, reason=reason)
        return await self._call("tokens.revoke", req, JoinTokenInfo)

    async def burn_join_token(
        self, *, identity: AgentIdentity, token_sha256: str, mac: str, reason: str
    ) -> BurnedJoinToken:
        """A site agent's signed report that a node-bound token it served was asked for again
        (``tokens.burn``): bc-pki revokes it and what it issued; safe to repeat."""
        body = identity.signed_request(BURN_PURPOSE, tokenSha256=token_sha256, mac=mac, reason=reason)
        return await self._call("tokens.burn", BurnJoinTokenRequest(**_snake(body)), BurnedJoinToken)

    async def confirm_join_token(
        self, *, identity: AgentIdentity, token_sha256: str, mac: str
    ) -> ConfirmedJoinToken:
        """A site agent's signed report that the node entry carrying a ``held`` token closed clean
        (``tokens.confirm``): its certificates become valid; safe to repeat."""
        body = identity.signed_request(CONFIRM_PURPOSE, tokenSha256=token_sha256, mac=mac)
        return await self._call("tokens.confirm", ConfirmJoinTokenRequest(**_snake(body)), ConfirmedJoinToken)

    async def revoke_attempt(
        self, *, workflow_id: str, step: int, attempt: int, reason: str | None = None
    ) -> RevokedAttempt:
        """Revoke the tokens one step attempt minted and refuse new ones under its key
        (``tokens.revoke_attempt``); safe to repeat."""
        req = RevokeAttempt(workflow_id=workflow_id, step=step, attempt=attempt, reason=reason)
        return await self._call("tokens.revoke_attempt", req, RevokedAttempt)

    async def join(
        self, *, token: str, csr: str, claims: JoinClaims | None = None, site_id: str | None = None
    ) -> JoinResult:
        """Trade a join token and hardware claims for a certificate (``agents.join``);
        ``site_id``: the site the machine boots in (a token of another site is refused)."""
        register_secret(token)
        req = JoinRequest(token=token, csr=csr, claims=claims or JoinClaims(), site_id=site_id)
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

    async def get_certificate(self, *, cert_id: str) -> CertificateInfo:
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
        role: JoinRole | None = None,
    ) -> list[CertificateInfo]:
        """The first page; ``certificates_page`` gives the cursor of the rest."""
        page = await self.certificates_page(
            tenant_id=tenant_id,
            site_id=site_id,
            agent_id=agent_id,
            join_token_id=join_token_id,
            include_revoked=include_revoked,
            limit=limit,
            role=role,
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
        role: JoinRole | None = None,
    ) -> CertificateList:
        """One page of certificates, newest first; pass its ``next`` as ``cursor`` for the next.

        ``cert_ids`` (1 to 1000) keeps only those certificates: one call for a page of agents.
        """
        req = ListCertificatesRequest(
            tenant_id=tenant_id,
            site_id=site_id,
            agent_id=agent_id,
            join_token_id=join_token_id,
            include_revoked=include_revoked,
            limit=limit,
            cursor=cursor,
            cert_ids=cert_ids,
            role=role,
        )
        return await self._call("certs.list", req, CertificateList)

    async def revoke_certificate(self, *, cert_id: str, reason: str | None = None) -> CertificateInfo:
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
        *,
        idempotency_key: str,
        node_id: str | None = None,
        before_mint: Callable[[], Awaitable[bytes | None]] | None = None,
        issued: MutableMapping[str, IssuedJoinToken] | None = None,
    ):
        self.client = client
        self._issued = issued
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
        held: bool = False,
    ) -> IssuedJoinToken:
        """Mint (or, on a re-run, find again) this step's token named ``key``; ``held``: the
        token goes on the boot network (``IssueJoinTokenRequest.held``)."""
        ikey = self.idempotency_key if key is None else f"{self.idempotency_key}:{key}"
        if ikey in self._used:
            raise BcError(
                ErrorCode.INVALID_STATE,
                "this step already minted a token under that key; pass another key=",
                {"path": "key", "reason": "idempotency-key-reused"},
            )
        self._used.add(ikey)
        if self._issued is not None and (known := self._issued.get(ikey)) is not None:
            return known  # an earlier run of this attempt got it: the same token, no request
        if self._before_mint is not None:
            before, self._before_mint = self._before_mint, None
            self._mint_secret = await before()
        token = await self.client.issue_join_token(
            tenant_id=tenant_id,
            role=role,
            site_id=site_id,
            ttl_seconds=ttl_seconds,
            max_uses=max_uses,
            expect=expect,
            idempotency_key=ikey,
            node_id=self.node_id if role in ("node", "provisioned") else None,
            mint_secret=self._mint_secret,
            held=held,
        )
        if self._issued is not None:
            self._issued[ikey] = token
        return token

    async def certificates(self, *, agent_id: str) -> list[CertificateInfo]:
        """The agent's valid certificates, newest first (``wait.agentJoined`` reads them)."""
        return await self.client.list_certificates(agent_id=agent_id)


def _snake(doc: Mapping[str, Any]) -> dict[str, Any]:
    return {"".join(f"_{c.lower()}" if c.isupper() else c for c in k): v for k, v in doc.items()}
