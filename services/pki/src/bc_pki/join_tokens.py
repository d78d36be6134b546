"""``tokens.*``: issuing, listing, reading and revoking join tokens, and fencing a step attempt's mints."""

from __future__ import annotations

import datetime as dt
from typing import Any

from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id, parse_id
from better_compute.logging import register_secret
from better_compute.service import ApiRequest, Database
from better_compute.service.fences import attempt_superseded
from better_compute.wire.paging import decode_cursor, take_page
from better_compute.wire.pki import (
    IssuedJoinToken,
    IssueJoinTokenRequest,
    JoinTokenIdRequest,
    JoinTokenInfo,
    JoinTokenList,
    ListJoinTokensRequest,
    RevokeAttempt,
    RevokedAttempt,
    RevokeJoinTokenRequest,
)

from . import store
from .tokens import derived_token, normalize_expect, random_token, same_token, token_hash

__all__ = ["JoinTokens"]


class JoinTokens:
    """The ``tokens.*`` routes; ``token_key`` derives a minted token (see ``tokens``)."""

    def __init__(self, *, db: Database, log: Any, token_key: bytes) -> None:
        self.db = db
        self.log = log
        self._token_key = token_key

    async def issue_token(self, req: ApiRequest) -> IssuedJoinToken:
        body = req.decode(IssueJoinTokenRequest)
        if body.node_id is not None:
            if body.role not in ("node", "provisioned"):
                raise BcError(
                    ErrorCode.INVALID_INPUT,
                    "only node and provisioned tokens are bound to a node",
                    {"path": "nodeId"},
                )
            parse_id(body.node_id, "node", path="nodeId")
        if body.held and (body.role != "node" or body.node_id is None):
            raise BcError(
                ErrorCode.INVALID_INPUT, "only a node token bound to a node is held", {"path": "held"}
            )
        expect = normalize_expect(body.expect)
        ikey, mint_secret = body.idempotency_key, body.mint_secret
        if mint_secret is not None and ikey is None:
            raise BcError(
                ErrorCode.INVALID_INPUT, "mintSecret goes with an idempotencyKey", {"path": "mintSecret"}
            )
        # Derived only from the token key (here) and the caller's mint secret (there): the
        # idempotency key a listing shows gives nobody the token.
        token = derived_token(self._token_key, ikey, mint_secret) if ikey and mint_secret else random_token()
        register_secret(token)
        row = await self.db.fetchrow(
            store.TOKEN_INSERT,
            new_id("tok"),
            token_hash(token),
            ikey,
            body.tenant_id,
            body.role,
            body.site_id,
            body.node_id,
            store.json_of(expect),
            body.ttl_seconds,
            body.max_uses,
            body.note,
            body.held,
        )
        found = row is None
        if found:
            row = await self.db.fetchrow(store.TOKEN_SELECT_BY_IDEMPOTENCY_KEY, ikey)
            if row is None:  # a random 256-bit token collided: never in practice
                raise BcError(ErrorCode.CONFLICT, "token collision; issue again")
            self._same_parameters(store.token_info(row), body, expect)
        if ikey is not None and await store.FENCES.revoke_if_fenced(
            self.db, ikey, row["id"], "minted by a superseded step attempt"
        ):
            self.log.warning("join_token_refused_superseded", join_token_id=row["id"])
            raise attempt_superseded("mints")
        if found and not same_token(token, row["token_hash"]):
            # Issued before, and this caller cannot make the same token: it is not the step
            # attempt that minted it (another mint secret, or none). It gets the id, never the token.
            self.log.warning("join_token_refused_already_issued", join_token_id=row["id"])
            raise BcError(
                ErrorCode.CONFLICT,
                "a join token was already issued under this idempotency key; it is shown once,"
                " and again only to the workflow step attempt that minted it",
                {"path": "idempotencyKey", "reason": "already-issued", "joinTokenId": row["id"]},
            )
        info = store.token_info(row)
        self.log.info(
            "join_token_issued",
            join_token_id=info.join_token_id,
            tenant_id=info.tenant_id,
            role=info.role,
            site_id=info.site_id,
            max_uses=info.max_uses,
            again=found,
        )
        return IssuedJoinToken(
            join_token_id=info.join_token_id,
            token=token,
            tenant_id=info.tenant_id,
            role=info.role,
            site_id=info.site_id,
            max_uses=info.max_uses,
            expires_at=info.expires_at,
        )

    @staticmethod
    def _same_parameters(info: JoinTokenInfo, body: IssueJoinTokenRequest, expect: Any) -> None:
        first = (info.tenant_id, info.role, info.site_id, info.node_id, info.max_uses, info.expect)
        again = (body.tenant_id, body.role, body.site_id, body.node_id, body.max_uses, expect)
        if first != again:
            raise BcError(
                ErrorCode.CONFLICT,
                "idempotency key already used for a token with other parameters",
                {"path": "idempotencyKey", "joinTokenId": info.join_token_id},
            )

    async def list_tokens(self, req: ApiRequest) -> JoinTokenList:
        body = req.decode(ListJoinTokensRequest)
        at, ident = decode_cursor(body.cursor, dt.datetime, str) or (None, None)
        rows = await self.db.fetch(
            store.TOKEN_LIST, body.tenant_id, body.site_id, body.state, at, ident, body.limit + 1
        )
        tokens, next_ = take_page(
            [store.token_info(r) for r in rows], limit=body.limit,
            key=lambda t: (t.created_at, t.join_token_id), budget=req.page_budget,
        )  # fmt: skip
        return JoinTokenList(tokens=tokens, next=next_)

    async def get_token(self, req: ApiRequest) -> JoinTokenInfo:
        body = req.decode(JoinTokenIdRequest)
        tok_id = parse_id(body.join_token_id, "tok", path="joinTokenId")
        row = await self.db.fetchrow(store.TOKEN_SELECT_BY_ID, tok_id)
        if row is None:
            raise BcError(ErrorCode.NOT_FOUND, "no such join token", {"path": "joinTokenId"})
        return store.token_info(row)

    async def revoke_token(self, req: ApiRequest) -> JoinTokenInfo:
        body = req.decode(RevokeJoinTokenRequest)
        tok_id = parse_id(body.join_token_id, "tok", path="joinTokenId")
        row = await self.db.fetchrow(store.TOKEN_REVOKE, tok_id, body.reason)
        if row is None:
            row = await self.db.fetchrow(store.TOKEN_SELECT_BY_ID, tok_id)
            if row is None:
                raise BcError(ErrorCode.NOT_FOUND, "no such join token", {"path": "joinTokenId"})
        else:
            self.log.info("join_token_revoked", join_token_id=tok_id)
        return store.token_info(row)

    async def revoke_attempt(self, req: ApiRequest) -> RevokedAttempt:
        """Revoke every token one workflow step attempt minted, and fence its key."""
        body = req.decode(RevokeAttempt)
        prefix, revoked = await store.FENCES.fence(
            self.db, workflow_id=body.workflow_id, step=body.step, attempt=body.attempt, reason=body.reason
        )
        if revoked:
            self.log.info("join_tokens_revoked", key=prefix, join_token_ids=revoked)
        return RevokedAttempt(revoked=revoked)
