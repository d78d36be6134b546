"""Issue 23 in milliseconds: what a quarantined node still takes, the CLI's word on it, and the
``tokens.burn`` request's shape (the e2e tests are tests/e2e/test_metal_boot_identity.py and
test_metal_enrollment_rules.py)."""

from __future__ import annotations

import base64
import json

import msgspec
import pytest

from bc_engine.metal.quarantine import QUARANTINE_EXITS, refuse_quarantined
from better_compute.cli.metal_commands import show_lines
from better_compute.core.errors import ErrorCode
from better_compute.crypto import AgentIdentity, new_agent_key, signing_payload
from better_compute.metal.lifecycle import VERBS
from better_compute.wire.engine import NodeView
from better_compute.wire.pki import BURN_PURPOSE, BurnJoinTokenRequest

QUARANTINE = {"reason": "second-join", "message": "a second join tried it", "joinTokenId": "tok_1"}


@pytest.mark.parametrize("verb", VERBS)
def test_only_inspect_and_retire_start_on_a_quarantined_node(verb: str) -> None:
    node = {"id": "node_1", "quarantine": json.dumps(QUARANTINE)}
    refused = refuse_quarantined(node, verb)
    if verb in QUARANTINE_EXITS:
        assert refused is None
    else:
        assert refused is not None
        assert (refused.code, refused.reason) == (ErrorCode.INVALID_STATE, "node-quarantined")
        assert "a second join tried it" in refused.message
    assert refuse_quarantined({"id": "node_1", "quarantine": None}, verb) is None


def test_bcx_nodes_show_names_the_quarantine_and_a_discovery_conflict() -> None:
    node = NodeView(
        id="node_1", tenant_id="root", site_id="lab1", labels={}, generation=1, observed_generation=1,
        created_at=None, quarantine={**QUARANTINE, "mac": "52:54:00:00:00:01"},
        discovery_conflict={"certId": "cert_9", "claims": {"macs": ["52:54:00:66:66:01"], "serial": "X"}},
    )  # fmt: skip
    text = "\n".join(show_lines(node))
    assert "quarantine  second-join: a second join tried it (token tok_1, mac 52:54:00:00:00:01)" in text
    assert "conflict    a discovery showed this hardware with macs 52:54:00:66:66:01 serial X" in text


def test_a_burn_request_is_signed_over_every_field_but_its_signature() -> None:
    key = new_agent_key()
    identity = AgentIdentity(cert_id="cert_1", agent_id="agent_1", private_key=key)
    body = identity.signed_request(BURN_PURPOSE, tokenSha256="a" * 64, mac="52:54:00:00:00:01",
                                   reason="boot-entry-fetched-twice")  # fmt: skip
    req = msgspec.convert(body, BurnJoinTokenRequest)
    doc = {k: v for k, v in body.items() if k != "signature"}
    data = signing_payload(BURN_PURPOSE, doc)
    key.public_key().verify(base64.b64decode(req.signature), data)  # raises if it does not verify
