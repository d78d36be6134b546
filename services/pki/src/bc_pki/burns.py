"""``tokens.burn``: a node-bound join token seen twice is burned, with what it issued.

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
the engine quarantines the node from it.
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
    JOIN_EVENTS,
    BurnedJoinToken,
    BurnJoinTokenRequest,
    CertRevoked,
    JoinTokenBurned,
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

Publish = Callable[[str, str, Any], Awaitable[None]]


async def burn_token(
    db: Database, publish_event: Publish, log: Any, token: Any, *, reason: str, mac: str | None
) -> BurnedJoinToken:
    """Revoke ``token`` (a join_tokens row) and its certificates; tell the engine."""
    why = f"burned: {reason}"
    async with db.transaction() as conn:
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
    """The ``tokens.burn`` route: only a site agent of the token's site, by its signature."""

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
        try:
            signature = base64.b64decode(body.signature, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise BcError(ErrorCode.INVALID_INPUT, "signature is not base64", {"path": "signature"}) from exc
        verified = await self.signatures.check(
            VerifyRequest(
                signer_id=body.signer_id, data=signing_payload(BURN_PURPOSE, doc), signature=signature,
                once=True, signed_at_ms=body.signed_at_ms,
            )
        )  # fmt: skip
        if verified.role != "site":
            raise BcError(
                ErrorCode.PERMISSION_DENIED, "only a site agent reports a boot entry asked for twice",
                {"path": "signerId", "reason": "not-a-site-agent"},
            )  # fmt: skip
        token = await self.db.fetchrow(TOKEN_BY_HASH, bytes.fromhex(body.token_sha256))
        if token is None or token["site_id"] != verified.site_id or token["node_id"] is None:
            # another site's token is none of this agent's business: as good as unknown
            raise BcError(ErrorCode.NOT_FOUND, "no node token of this site", {"path": "tokenSha256"})
        return await burn_token(
            self.db, self.publish_event, self.log, token, reason=body.reason, mac=body.mac
        )
