"""The compatibility rule (docs/compatibility.md): on the bus, unknown fields are ignored and new
fields have defaults, so an old client talks to a new service and a new client to an old one."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import Any

import msgspec
import pytest

from better_compute.core.errors import BcError, ErrorCode
from better_compute.wire.codec import Message, decode, encode

_PACKAGES = ("better_compute", "bc_engine", "bc_command_queue", "bc_pki", "bc_secrets")
_SETTINGS = "better_compute.config"  # written by people: an unknown key there is a typo


# Version 1 and version 2 of one request, as an old and a new build would define it.
class PutV1(Message, frozen=True, kw_only=True):
    node_id: str


class PutV2(Message, frozen=True, kw_only=True):
    node_id: str
    labels: dict[str, str] = msgspec.field(default_factory=dict)  # new in v2: has a default


def test_an_old_client_talks_to_a_new_service() -> None:
    got = decode(encode(PutV1(node_id="n1")), PutV2)
    assert got == PutV2(node_id="n1", labels={})


def test_a_new_client_talks_to_an_old_service() -> None:
    got = decode(encode(PutV2(node_id="n1", labels={"rack": "r7"})), PutV1)
    assert got == PutV1(node_id="n1")


def test_a_bad_known_field_is_still_refused_with_its_path() -> None:
    with pytest.raises(BcError) as info:
        decode(b'{"nodeId": 3, "somethingNew": true}', PutV2)
    assert (info.value.code, info.value.path) == (ErrorCode.INVALID_INPUT, "nodeId")


def _modules() -> list[ModuleType]:
    found = []
    for name in _PACKAGES:
        package = importlib.import_module(name)
        found.append(package)
        for info in pkgutil.walk_packages(package.__path__, f"{name}."):
            if ".migrations" in info.name or info.name.endswith(("__main__", "pytest_plugin")):
                continue
            found.append(importlib.import_module(info.name))
    return found


def _structs() -> list[type[msgspec.Struct]]:
    modules = {m.__name__ for m in _modules()}
    seen: list[type[msgspec.Struct]] = []
    todo: list[type[Any]] = [msgspec.Struct]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__ in modules and sub not in seen:
                seen.append(sub)
    return seen


def test_no_message_of_any_service_refuses_an_unknown_field() -> None:
    strict = sorted(
        f"{s.__module__}.{s.__qualname__}"
        for s in _structs()
        if s.__struct_config__.forbid_unknown_fields and s.__module__ != _SETTINGS
    )
    assert strict == []


@pytest.mark.parametrize(
    ("module", "name", "fields"),
    [
        ("better_compute.wire.engine", "CreateNode", {"siteId": "site-a"}),
        ("better_compute.wire.cmdq", "CommandIdRequest", {"id": "cmd_1"}),
        ("better_compute.wire.cmdq", "ListCommands", {"limit": 5}),
        (
            "better_compute.wire.cmdq",
            "EnqueueCommand",
            {"nodeId": "n", "siteId": "s", "kind": "k", "key": "k1"},
        ),
        ("better_compute.wire.pki", "JoinTokenIdRequest", {"joinTokenId": "tok_1"}),
        ("better_compute.wire.secrets", "RefRequest", {"ref": "secret://a"}),
        (
            "better_compute.wire.agent",
            "Heartbeat",
            {"site": "s", "agent": "a", "signerId": "c", "signedAtMs": 1},
        ),
        (
            "better_compute.wire.agent",
            "HelloReply",
            {"heartbeatMs": 200, "silentAfterMs": 900, "stream": "st", "consumer": "co"},
        ),
    ],
)
def test_each_service_takes_a_message_from_a_newer_peer(
    module: str, name: str, fields: dict[str, Any]
) -> None:
    typ = getattr(importlib.import_module(module), name)
    newer = msgspec.json.encode({**fields, "aFieldFromTheFuture": {"x": 1}})
    assert decode(newer, typ) == decode(msgspec.json.encode(fields), typ)
