"""``tokens.burn`` and ``tokens.confirm``: a node-bound join token seen twice is burned, with what
it issued; one whose boot entry closed clean is confirmed.

A node's ramdisk token travels in the clear on the boot network (the iPXE script of the node's
one-time boot entry), so whoever asks the site agent for that MAC's script first gets it. What
makes a stolen copy a detected denial instead of a silent identity (issue 23, H1):

* the site agent serves a one-time entry once, and a second ask for that MAC (or another MAC
  of the same entry) is answered with nothing and reported here, signed by the agent
  (``boot-entry-fetched-twice``);
* a second join with a single-use node token (``token-used-up``) is burned here too
  (``second-join``): the first join was either the machine or the thief, nobody can tell which.

Burning revokes the token (an unused one joins nobody any more) and every certificate issued
with it (a thief that joined first loses its identity at once: the command queue checks
signatures against bc-pki), and publishes ``JoinTokenBurned`` on ``bc.events.join.<token id>``;
the engine quarantines the node from it. A burn is idempotent: the site agent sends a report
again until bc-pki has answered, and a repeat changes and publishes nothing.

``tokens.confirm`` is the other outcome: a ``held`` token (metal's ramdisk token) joins with a
certificate that is ``pending`` (it signs nothing that counts) until the site agent that served
its entry reports that the entry closed clean (served to one address, and no other address
asked within its quiet period). Then every certificate issued with it becomes valid, a later
join gets a valid one, and ``JoinTokenConfirmed`` wakes the engine's ``wait.agentJoined``. So a
thief who asked before the machine holds a pending certificate until the machine's own ask
burns the token: it never joins as the node.
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

from better_compute.core.errors import BcError, ErrorCode
from better_compute.crypto import signing_payload
from better_compute.service import ApiRequest, Database
from better_compute.wire.pki import (
    BURN_PURPOSE,
    CERT_EVENTS,
    CONFIRM_PURPOSE,
    JOIN_EVENTS,
    BurnedJoinToken,
    BurnJoinTokenRequest,
    CertRevoked,
    ConfirmedJoinToken,
    ConfirmJoinTokenRequest,
    JoinTokenBurned,
    JoinTokenConfirmed,
    VerifyRequest,
)

from . import store
from .signatures import Signatures

__all__ = ["Burns", "burn_token"]

TOKEN_BY_HASH: Final = f"SELECT {store.TOKEN_COLUMNS} FROM join_tokens WHERE token_hash = $1"
REVOKE_CERTS_OF_TOKEN: Final = (
    "UPDATE certificates SET revoked_at = now(), revoke_reason = $2"
    " WHERE join_token_id = $1 AND revoked_at IS NULL RETURNING id"
)

TOKEN_LOCK: Final = "SELECT revoke_reason FROM join_tokens WHERE id = $1 FOR UPDATE"
CERTS_BURNED_WITH: Final = (
    "SELECT id FROM certificates WHERE join_token_id = $1 AND revoke_reason = $2 ORDER BY id"
)
TOKEN_BY_HASH_FOR_UPDATE: Final = f"{TOKEN_BY_HASH} FOR UPDATE"

Publish = Callable[[str, str, Any], Awaitable[None]]


async def burn_token(
    db: Database, publish_event: Publish, log: Any, token: Any, *, reason: str, mac: str | None
) -> BurnedJoinToken:
    """Revoke ``token`` (a join_tokens row) and its certificates; tell the engine. Idempotent: a
    token burned before gets the first burn's answer back and nothing is published again (a
    report sent twice must not quarantine a node an operator has since looked at)."""
    why = f"burned: {reason}"
    async with db.transaction() as conn:
        row = await conn.fetchrow(TOKEN_LOCK, token["id"])
        earlier = row["revoke_reason"] if row is not None else None
        if earlier is not None and earlier.startswith("burned: "):
            certs = [r["id"] for r in await conn.fetch(CERTS_BURNED_WITH, token["id"], earlier)]
            return BurnedJoinToken(
                join_token_id=token["id"], node_id=token["node_id"], revoked_cert_ids=certs
            )
        await conn.execute(store.TOKEN_REVOKE, token["id"], why)
        certs = [r["id"] for r in await conn.fetch(REVOKE_CERTS_OF_TOKEN, token["id"], why)]
    log.warning(
        "join_token_burned", join_token_id=token["id"], node_id=token["node_id"], reason=reason,
        revoked_cert_ids=certs,
    )  # fmt: skip
    now = time.time()
    for cert_id in certs:
        await publish_event(CERT_EVENTS, cert_id, CertRevoked(cert_id=cert_id, at=now))
    await publish_event(
        JOIN_EVENTS,
        token["id"],
        JoinTokenBurned(
            join_token_id=token["id"], node_id=token["node_id"], reason=reason, mac=mac,
            revoked_cert_ids=certs, at=now,
        ),
    )  # fmt: skip
    return BurnedJoinToken(join_token_id=token["id"], node_id=token["node_id"], revoked_cert_ids=certs)


class Burns:
    """The ``tokens.burn`` and ``tokens.confirm`` routes: only a site agent of the token's site,
    by its signature."""

    def __init__(self, *, db: Database, log: Any, signatures: Signatures, publish_event: Publish) -> None:
        self.db = db
        self.log = log
        self.signatures = signatures
        self.publish_event = publish_event

    async def burn(self, req: ApiRequest) -> BurnedJoinToken:
        body = req.decode(BurnJoinTokenRequest)
        doc = {
            "tokenSha256": body.token_sha256, "mac": body.mac, "reason": body.reason,
            "signerId": body.signer_id, "signedAtMs": body.signed_at_ms, "nonce": body.nonce,
        }  # fmt: skip
        verified = await self._verified_site_agent(BURN_PURPOSE, doc, body)
        token = await self._site_token(body.token_sha256, verified)
        return await burn_token(
            self.db, self.publish_event, self.log, token, reason=body.reason, mac=body.mac
        )

    async def _verified_site_agent(self, purpose: str, doc: dict[str, Any], body: Any) -> Any:
        try:
            signature = base64.b64decode(body.signature, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise BcError(ErrorCode.INVALID_INPUT, "signature is not base64", {"path": "signature"}) from exc
        verified = await self.signatures.check(
            VerifyRequest(
                signer_id=body.signer_id, data=signing_payload(purpose, doc), signature=signature,
                once=True, signed_at_ms=body.signed_at_ms,
            )
        )  # fmt: skip
        if verified.role != "site":
            raise BcError(
                ErrorCode.PERMISSION_DENIED, "only a site agent reports on the boot entries it served",
                {"path": "signerId", "reason": "not-a-site-agent"},
            )  # fmt: skip
        return verified

    async def _site_token(self, token_sha256: str, verified: Any, conn: Any = None) -> Any:
        query = TOKEN_BY_HASH if conn is None else TOKEN_BY_HASH_FOR_UPDATE
        token = await (conn or self.db).fetchrow(query, bytes.fromhex(token_sha256))
        if token is None or token["site_id"] != verified.site_id or token["node_id"] is None:
            # another site's token is none of this agent's business: as good as unknown
            raise BcError(ErrorCode.NOT_FOUND, "no node token of this site", {"path": "tokenSha256"})
        return token

    async def confirm(self, req: ApiRequest) -> ConfirmedJoinToken:
        """``tokens.confirm``: the boot entry of a held token closed clean; what joined with it
        becomes valid (and a later join gets a valid certificate). Safe to repeat."""
        body = req.decode(ConfirmJoinTokenRequest)
        doc = {
            "tokenSha256": body.token_sha256, "mac": body.mac, "signerId": body.signer_id,
            "signedAtMs": body.signed_at_ms, "nonce": body.nonce,
        }  # fmt: skip
        verified = await self._verified_site_agent(CONFIRM_PURPOSE, doc, body)
        async with self.db.transaction() as conn:
            token = await self._site_token(body.token_sha256, verified, conn)
            if token["revoked_at"] is not None:
                raise BcError(
                    ErrorCode.INVALID_STATE, "the token was revoked: nothing it issued is confirmed",
                    {"path": "tokenSha256", "reason": "token-revoked"},
                )  # fmt: skip
            first = token["confirmed_at"] is None
            await conn.execute(store.TOKEN_CONFIRM, token["id"])
            certs = [r["id"] for r in await conn.fetch(store.CERT_CONFIRM_OF_TOKEN, token["id"])]
        if first or certs:
            self.log.info(
                "join_token_confirmed", join_token_id=token["id"], node_id=token["node_id"], cert_ids=certs
            )
            await self.publish_event(
                JOIN_EVENTS,
                token["id"],
                JoinTokenConfirmed(
                    join_token_id=token["id"], node_id=token["node_id"], cert_ids=certs, at=time.time()
                ),
            )
        return ConfirmedJoinToken(join_token_id=token["id"], node_id=token["node_id"], cert_ids=certs)
