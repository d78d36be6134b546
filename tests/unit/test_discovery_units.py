"""Discovery without services: bc-pki's refusals (a token of another site, a join with no
hardware), bcx enrolling a discovered node by its id."""

from __future__ import annotations

import asyncio

import pytest

from bc_pki.discovery import refusal
from better_compute.cli.main import build_parser
from better_compute.cli.metal_commands import nodes_enroll
from better_compute.config import Settings
from better_compute.core.errors import BcError, ErrorCode
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


def test_bcx_enrolls_a_discovered_node_by_its_id_and_a_new_one_needs_its_site() -> None:
    args = build_parser().parse_args(
        ["nodes", "enroll", "node_01JDISCOVERED0000000000000", "--bmc", "sim://b"]
    )
    assert (args.node, args.site, args.bmc) == ("node_01JDISCOVERED0000000000000", None, "sim://b")
    bare = build_parser().parse_args(["nodes", "enroll", "--bmc", "sim://b"])
    with pytest.raises(BcError) as err:
        asyncio.run(nodes_enroll(bare, Settings()))
    assert (err.value.code, err.value.path) == (ErrorCode.INVALID_INPUT, "site")
