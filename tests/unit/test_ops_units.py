"""Units of issue 15's operations pieces: ``--since``, the event lines, the audit's actor, target
and whitelisted detail."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from better_compute.cli.ops_commands import describe_event, parse_since
from better_compute.core.errors import BcError, ErrorCode
from better_compute.service.audit import actor_of, audit_detail, audit_target, requester
from better_compute.wire.cmdq import BatchEvent, CommandEvent
from better_compute.wire.engine import StepChange, StepChanged
from better_compute.wire.events import FEED_KINDS, decode_feed_event
from better_compute.wire.pki import JoinRefused


def test_since_takes_durations_times_and_all() -> None:
    assert parse_since(None) is None
    assert parse_since("all") == datetime.fromtimestamp(0, UTC)
    assert parse_since("10m", now=1_000_000.0) == datetime.fromtimestamp(1_000_000.0 - 600, UTC)
    assert parse_since("2026-12-01T06:30:00Z") == datetime(2026, 12, 1, 6, 30, tzinfo=UTC)
    assert parse_since("2026-12-01T06:30:00") == datetime(2026, 12, 1, 6, 30, tzinfo=UTC)
    with pytest.raises(BcError) as caught:
        parse_since("yesterday")
    assert caught.value.code is ErrorCode.INVALID_INPUT
    assert caught.value.path == "since"


def test_every_feed_kind_decodes_and_reads_as_a_line() -> None:
    assert FEED_KINDS == ("workflow", "node", "command", "batch", "join", "cert")
    step = StepChanged(
        workflow_id="wf_1", node_id="node_1", workflow_state="running", at=1.0,
        step=StepChange(index=2, action="power.setPower", state="failed", attempt=1,
                        error={"code": "TIMEOUT", "message": "late"}),
    )  # fmt: skip
    assert describe_event(step) == "step 2 power.setPower failed attempt 1 (workflow running)  TIMEOUT"
    cmd = CommandEvent(id="cmd_1", key="k", node_id="node_1", state="succeeded", kind="power.setPower")
    assert describe_event(cmd) == "power.setPower succeeded node node_1"
    batch = BatchEvent(id="batch_1", state="approved", approvals=2, threshold=2, approver_id="bob", at=1.0)
    assert describe_event(batch) == "batch approved 2/2 approval of bob"
    refused = JoinRefused(reason="token-expired", code="UNAUTHENTICATED")
    assert describe_event(refused) == "join refused: token-expired (UNAUTHENTICATED)"
    # an older command event (no kind, no time) still decodes; an unknown tag is passed over
    old = decode_feed_event("command", b'{"event":"command","id":"c","key":"k","nodeId":"n","state":"acked"}')
    assert isinstance(old, CommandEvent)
    assert old.kind is None
    assert decode_feed_event("command", b'{"event":"teleported","id":"c"}') is None
    assert decode_feed_event("weather", b"{}") is None


def test_the_actor_is_a_cleaned_bounded_claim() -> None:
    assert actor_of({}) is None
    assert actor_of({"Bc-Actor": "  alice@ops\x1b[31m "}) == "alice@ops[31m"
    assert actor_of({"Bc-Actor": "x" * 500}) == "x" * 128


def test_the_requester_is_the_user_the_server_named_else_a_claim() -> None:
    info = '{"acc":"OPS","user":"alice","rtt":3000,"kind":"Client"}'
    who = requester({"Nats-Request-Info": info, "Bc-Actor": "service:bc-engine"})
    # the server's word wins, the claim is kept beside it, and it is never a service's own
    assert (who.actor, who.verified, who.claimed, who.is_service) == (
        "alice",
        True,
        "service:bc-engine",
        False,
    )
    who = requester({"Nats-Request-Info": info, "Bc-Actor": "alice"})
    assert (who.actor, who.verified, who.claimed) == ("alice", True, None)
    # through an import without share (a site): the account only, so the claim, still recorded
    who = requester({"Nats-Request-Info": '{"acc":"SITE_EU1","rtt":1}', "Bc-Actor": "service:bc-pki"})
    assert (who.actor, who.verified, who.is_service) == ("service:bc-pki", False, False)
    # inside the services' account: the claim, and a service's own request is one
    who = requester({"Bc-Actor": "service:bc-engine"})
    assert (who.actor, who.verified, who.is_service) == ("service:bc-engine", False, True)
    assert requester(None) == requester({})
    assert requester({"Nats-Request-Info": "not json", "Bc-Actor": "bob"}).actor == "bob"
    assert audit_detail({"nodeId": "n"}, ("nodeId",), claimed="bob") == {"claimedActor": "bob", "nodeId": "n"}


def test_the_detail_keeps_only_whitelisted_fields_and_the_target_is_an_id() -> None:
    body = {
        "tenantId": "root",
        "nodeId": "node_1",
        "value": "c2VjcmV0",
        "document": {"id": "p", "version": 3},
    }
    assert audit_detail(body, ("tenantId", "nodeId", "document.version", "label")) == {
        "tenantId": "root", "nodeId": "node_1", "document.version": 3,
    }  # fmt: skip
    assert audit_detail({"note": "n" * 2000}, ("note",))["note"].endswith("…")
    assert audit_target(body, {"ref": "sec_1", "token": "t0ken"}) == "sec_1"
    assert audit_target({"document": {"id": "profile-x"}}, {}) == "profile-x"
    assert audit_target({"joinTokenId": "tok_1"}, None) == "tok_1"
