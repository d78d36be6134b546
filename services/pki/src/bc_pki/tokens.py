"""Join tokens: how they are made, hashed and matched against a machine's claims.

A token is ``bcjt_`` and 43 base64url characters (256 bits). It is random, unless the caller
gives an idempotency key *and* a mint secret: then it is
``HMAC-SHA256(token key, idempotency key, mint secret)``, so the caller that holds the mint
secret (the engine, for one step attempt) gets the same token again on a re-run, and nobody
else can: the token key never leaves bc-pki, the mint secret never reaches it at rest. Only
``sha256(token)`` is stored; the token key is stored sealed under the key file.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets

from better_compute.wire.pki import JoinClaims, JoinExpect

__all__ = [
    "derived_token",
    "mismatched_claims",
    "normalize_claims",
    "normalize_expect",
    "random_token",
    "same_token",
    "token_hash",
    "well_formed",
]

_PREFIX = "bcjt_"
_TOKEN_RE = re.compile(r"^bcjt_[A-Za-z0-9_-]{43}$")


def _encode(raw: bytes) -> str:
    return _PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def random_token() -> str:
    return _encode(secrets.token_bytes(32))


def derived_token(token_key: bytes, idempotency_key: str, mint_secret: bytes) -> str:
    """The token for ``idempotency_key`` and ``mint_secret``: the same pair always gives the
    same token; the key alone gives nothing."""
    key = idempotency_key.encode()
    mac = hmac.new(
        token_key,
        b"bc-join-token-v2\x00" + len(key).to_bytes(4, "big") + key + mint_secret,
        hashlib.sha256,
    )
    return _encode(mac.digest())


def same_token(token: str, stored_hash: bytes) -> bool:
    """Whether ``token`` is the one whose hash is stored (constant time)."""
    return hmac.compare_digest(token_hash(token), stored_hash)


def token_hash(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def well_formed(token: str) -> bool:
    return bool(_TOKEN_RE.match(token))


def _mac(value: str) -> str:
    hexdigits = re.sub(r"[^0-9a-f]", "", value.lower())
    return ":".join(hexdigits[i : i + 2] for i in range(0, 12, 2))


def normalize_expect(expect: JoinExpect) -> JoinExpect:
    """MACs as ``aa:bb:…``, UUIDs in lower case, surrounding blanks dropped."""
    return JoinExpect(
        mac=_mac(expect.mac) if expect.mac else None,
        product_uuid=expect.product_uuid.strip().lower() if expect.product_uuid else None,
        serial=expect.serial.strip() if expect.serial else None,
        gpu_uuid=expect.gpu_uuid.strip().lower() if expect.gpu_uuid else None,
    )


def normalize_claims(claims: JoinClaims) -> JoinClaims:
    return JoinClaims(
        macs=sorted({_mac(m) for m in claims.macs}),
        product_uuid=claims.product_uuid.strip().lower() if claims.product_uuid else None,
        serial=claims.serial.strip() if claims.serial else None,
        gpu_uuids=sorted({g.strip().lower() for g in claims.gpu_uuids}),
        hostname=claims.hostname,
    )


def mismatched_claims(expect: JoinExpect, claims: JoinClaims) -> list[str]:
    """The expected claims (camelCase names) that ``claims`` does not show; both normalized."""
    wrong: list[str] = []
    if expect.mac is not None and expect.mac not in claims.macs:
        wrong.append("mac")
    if expect.product_uuid is not None and expect.product_uuid != claims.product_uuid:
        wrong.append("productUuid")
    if expect.serial is not None and expect.serial != claims.serial:
        wrong.append("serial")
    if expect.gpu_uuid is not None and expect.gpu_uuid not in claims.gpu_uuids:
        wrong.append("gpuUuid")
    return wrong
