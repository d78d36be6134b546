from __future__ import annotations

import pickle
import time

import msgspec
import pytest

from better_compute.core.errors import BcError, ErrorCode, join_path
from better_compute.core.ids import id_time_ms, new_id, parse_id
from better_compute.wire import Err, Ok, Subjects, decode_reply, encode_error, encode_ok, unwrap
from better_compute.wire.codec import decode


def test_error_keeps_code_message_details_and_path() -> None:
    err = BcError("INVALID_INPUT", "port out of range", {"path": "steps[2].with.port"})
    assert err.code is ErrorCode.INVALID_INPUT
    assert err.path == "steps[2].with.port"
    assert str(err) == "INVALID_INPUT: port out of range (at steps[2].with.port)"


def test_unknown_code_is_refused() -> None:
    with pytest.raises(ValueError, match="NOPE"):
        BcError("NOPE", "x")


def test_error_round_trips_over_the_wire() -> None:
    err = BcError(ErrorCode.INVALID_STATE, "needs a batch", {"reason": "batch-required"})
    with pytest.raises(BcError) as e:
        unwrap(encode_error(err))
    got = e.value
    assert (got.code, got.message, got.reason) == (
        ErrorCode.INVALID_STATE,
        "needs a batch",
        "batch-required",
    )


def test_error_pickles_for_process_boundaries() -> None:
    err = pickle.loads(pickle.dumps(BcError("NOT_FOUND", "gone", {"path": "id"})))
    assert (err.code, err.path) == (ErrorCode.NOT_FOUND, "id")


@pytest.mark.parametrize(
    ("prefix", "path", "want"),
    [
        ("steps[2]", "with.port", "steps[2].with.port"),
        ("a", "[0]", "a[0]"),
        ("", "x", "x"),
        ("x", "", "x"),
    ],
)
def test_join_path(prefix: str, path: str, want: str) -> None:
    assert join_path(prefix, path) == want


def test_with_path_prefix_nests_the_path() -> None:
    err = BcError("INVALID_CONFIG", "bad", {"path": "port"}).with_path_prefix("steps[1].with")
    assert err.path == "steps[1].with.port"


def test_ids_are_prefixed_unique_and_time_sorted() -> None:
    ids = [new_id("wf") for _ in range(2000)]
    assert len(set(ids)) == 2000
    assert ids == sorted(ids)
    assert all(i.startswith("wf_") and len(i) == 29 for i in ids)
    assert abs(id_time_ms(ids[0]) - time.time() * 1000) < 5000


def test_bad_ids_and_prefixes_are_invalid_input() -> None:
    with pytest.raises(BcError) as e:
        parse_id("node_123", "node", path="nodeId")
    assert (e.value.code, e.value.path) == (ErrorCode.INVALID_INPUT, "nodeId")
    with pytest.raises(BcError) as e:
        parse_id(new_id("wf"), "node")
    assert e.value.code is ErrorCode.INVALID_INPUT
    with pytest.raises(BcError):
        new_id("nonsense")


def test_reply_union_decodes_both_arms() -> None:
    assert decode_reply(encode_ok({"a": 1})) == Ok(result={"a": 1})
    reply = decode_reply(encode_error(BcError("TIMEOUT", "slow")))
    assert isinstance(reply, Err)
    assert reply.error.code == "TIMEOUT"


def test_a_malformed_reply_is_internal_not_a_crash() -> None:
    with pytest.raises(BcError) as e:
        unwrap(b"<html>")
    assert e.value.code is ErrorCode.INTERNAL


class _Req(msgspec.Struct, kw_only=True):
    node_id: str
    port: int


def test_decode_gives_invalid_input_with_the_path() -> None:
    with pytest.raises(BcError) as e:
        decode(b'{"node_id": "n", "port": "x"}', _Req)
    assert (e.value.code, e.value.path) == (ErrorCode.INVALID_INPUT, "port")
    with pytest.raises(BcError) as e:
        decode(b'{"node_id": ', _Req)
    assert e.value.code is ErrorCode.INVALID_INPUT
    with pytest.raises(BcError) as e:
        decode(b'{"node_id": "n"}', _Req)
    assert (e.value.code, e.value.path) == (ErrorCode.INVALID_INPUT, "port")


def test_subjects_follow_the_design() -> None:
    s = Subjects()
    assert s.api("engine", "profiles", "get") == "bc.api.engine.profiles.get"
    assert s.site_cmd("eu1", "agent7") == "bc.site.eu1.cmd.agent7"
    assert s.agent_event("eu1", "agent7", "heartbeat") == "bc.agent.eu1.agent7.heartbeat"
    assert s.event("workflow", "wf_1") == "bc.events.workflow.wf_1"
    assert Subjects(root="t1").event("command", "c") == "t1.events.command.c"


def test_urls_in_messages_lose_their_credentials() -> None:
    from better_compute.logging import safe_url

    assert safe_url("nats://engine:hunter22@nats-1:4222") == "nats://nats-1:4222"
    assert safe_url("postgresql://bc:pw@db/bc") == "postgresql://db/bc"
    assert safe_url("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"
