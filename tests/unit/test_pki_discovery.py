"""bc-pki's discovery checks without a database: a token of another site, a join with no hardware."""

from __future__ import annotations

from bc_pki.discovery import refusal
from better_compute.core.errors import ErrorCode
from better_compute.wire.pki import JoinClaims

TOKEN = {"site_id": "lab1", "role": "discovery"}


def test_a_discovery_join_is_refused_for_another_site_or_without_hardware() -> None:
    claims = JoinClaims(product_uuid="u-1")
    assert refusal(TOKEN, claims, None) is None
    assert refusal(TOKEN, claims, "lab1") is None
    other = refusal(TOKEN, claims, "lab2")
    assert other is not None
    assert (other.code, other.reason, other.path) == (ErrorCode.PERMISSION_DENIED, "site-mismatch", "siteId")
    assert "the token was not spent" in other.message
    bare = refusal(TOKEN, JoinClaims(), "lab1")
    assert bare is not None
    assert (bare.code, bare.path) == (ErrorCode.INVALID_INPUT, "claims")
    assert refusal(TOKEN, JoinClaims(macs=["52:54:00:00:00:01"]), None) is None
    # a node token needs no claims of its own here (its expect claims are checked before)
    assert refusal({**TOKEN, "role": "node"}, JoinClaims(), None) is None
