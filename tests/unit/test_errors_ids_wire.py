from __future__ import annotations

import pickle
import time

import msgspec
import pytest

from better_compute.core.errors import BcError, ErrorCode, join_path
from better_compute.core.ids import id_time_ms, new_id, parse_id
from better_compute.core.keys import any_workflow_command_prefix, attempt_key, workflow_command_prefix
from better_compute.core.names import parse_name
from better_compute.wire import Err, Ok, Subjects, decode_reply, encode_error, encode_ok, unwrap
from better_compute.wire.codec import MAX_DEPTH, check_nesting, decode


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


def test_decode_refuses_nul_depth_and_int64_with_the_path_even_in_unknown_fields() -> None:
    class Req(msgspec.Struct):
        a: int = 0

    cases = {
        b'{"a": 1, "zz": {"k": ["x\\u0000"]}}': "zz.k[0]",
        b'{"zz": {"\\u0000": 1}}': "zz",
        b'{"a": 9223372036854775808}': "a",
        b'{"zz": [-9223372036854775809]}': "zz[0]",
        b'{"q": {"r": ' + b"[" * 10_000 + b"]" * 10_000 + b"}}": "q.r" + "[0]" * 62,
        b'{"q": ' + b"[" * 70 + b"]" * 70 + b"}": "q" + "[0]" * 63,
    }
    for data, path in cases.items():
        with pytest.raises(BcError) as info:
            decode(data, Req)
        assert (info.value.code, info.value.path) == (ErrorCode.INVALID_INPUT, path), data[:60]
    # the bounds themselves, and nesting up to the limit, still decode
    assert decode(b'{"a": 9223372036854775807}', Req).a == 2**63 - 1
    assert decode(b'{"zz": ' + b"[" * 63 + b"]" * 63 + b"}", Req).a == 0


def test_the_byte_gate_before_the_walk_lets_nothing_through() -> None:
    """decode walks a request only when its bytes could fail the check (codec._suspect): brackets
    and quotes inside strings, escaped quotes, exponents must not hide what the walk refuses."""

    class Req(msgspec.Struct):
        a: int = 0

    # 70 deep, but brackets inside strings make the raw bytes look 60 deep at most
    masked = b'{"zz": ' + b"[" * 60 + b'"' + b"]" * 60 + b'", ' + b"[" * 10 + b"]" * 10
    masked += b', "' + b"[" * 60 + b'"' + b"]" * 60 + b"}"
    cases = {
        masked: "zz" + "[0]" * 59 + "[1]" + "[0]" * 3,
        b'{"zz": ["\\"[[", ' + b"[" * 70 + b"]" * 70 + b"]}": "zz[1]" + "[0]" * 62,
        b'{"zz": ' + b'[{"b": ' * 33 + b"1" + b"}]" * 33 + b"}": "zz" + "[0].b" * 31 + "[0]",
        b'{"zz": ["x", 1.5e400]}': "",
        b'{"zz": "x\\\\", "q": [123456789012345678901]}': "q[0]",
    }
    for data, path in cases.items():
        with pytest.raises(BcError) as info:
            decode(data, Req)
        assert (info.value.code, info.value.path) == (ErrorCode.INVALID_INPUT, path), data[:60]
    # long digit runs, exponents and brackets inside strings are only text
    fine = b'{"a": 5, "zz": ["12345678901234567890", "e+999", "[[[{{{", "]]]}}}", 1e300, -12345]}'
    assert decode(fine, Req).a == 5


def test_ids_and_names_are_refused_with_the_field_and_an_example() -> None:
    with pytest.raises(BcError) as info:
        parse_id("lab 1!", "node", path="nodeId")
    assert info.value.path == "nodeId"
    assert "e.g. node_" in info.value.message
    parse_id(info.value.message.split("e.g. ")[1].split(";")[0], "node")  # the example is an id
    for bad in ("", "lab 1!", "a.b", "-x", "s" * 65, None):
        with pytest.raises(BcError) as info:
            parse_name(bad, path="siteId")
        assert (info.value.code, info.value.path) == (ErrorCode.INVALID_INPUT, "siteId")
        assert "e.g. 'lab-1'" in info.value.message
    assert parse_name("lab-1", path="siteId") == "lab-1"


def _under(key: str, prefix: str) -> bool:
    # the command queue's "key under a prefix" (the prefix itself, or it then ':' or '#')
    return key == prefix or key.startswith(prefix + ":") or key.startswith(prefix + "#")


def test_every_workflows_command_keys_are_under_one_prefix() -> None:
    # bc-secrets opens a node's standing secret to any workflow's live command for the node
    wf = new_id("wf")
    every = any_workflow_command_prefix()
    assert _under(workflow_command_prefix(wf), every)
    assert _under(attempt_key(wf, 3, 1), every)
    assert _under(attempt_key(wf, 0, 2, "boot-device"), every)
    # the engine's own node commands (host section, discovery inventory) are not a workflow's
    assert not _under("host:g3", every)
    assert not _under("discovery:cert_1", every)


def test_check_nesting_refuses_only_json_nested_past_the_limit() -> None:
    """Issue 23 L6: an agent's result bytes are read as JSON later; too deep is refused at entry."""
    ok = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    check_nesting(ok, "result")
    check_nesting(b'{"a": "' + b"[" * 500 + b'"}', "result")  # brackets in a string
    check_nesting(b"[" * 500 + b" not json", "result")  # opaque bytes: not JSON, not judged
    check_nesting(b"root-password=hunter2", "result")
    deep = b'{"a": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    with pytest.raises(BcError) as caught:
        check_nesting(deep, "result")
    assert caught.value.code == ErrorCode.INVALID_INPUT
    assert caught.value.path == "result.a" + "[0]" * (MAX_DEPTH - 1)
