"""Malformed requests get ``INVALID_INPUT`` with ``details.path``, never ``INTERNAL`` (issue 10,
items 1 and 2), on a real nats-server and PostgreSQL.

The issue's cases: strings with NUL bytes that reach PostgreSQL, JSON nested 10,000 deep,
integers beyond int64, and ids or names that only failed at the node's first command.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest_asyncio
from nats.aio.client import Client as Nats

from bc_command_queue.service import CommandQueueService
from bc_engine.service import EngineService
from bc_pki.service import PkiService
from better_compute.config import Settings
from better_compute.core.errors import ErrorCode
from better_compute.core.ids import new_id
from better_compute.service import ApiClient
from better_compute.testing import refused
from better_compute.wire import Subjects
from engine_test_app import create_tables

DEEP = 10_000


@pytest_asyncio.fixture(loop_scope="session")
async def engine(bc_settings: Settings) -> AsyncIterator[EngineService]:
    await create_tables(bc_settings.database_url)
    svc = EngineService(msgspec.structs.replace(bc_settings, app="engine_test_app:app"))
    async with svc:
        run = asyncio.create_task(svc.run())
        yield svc
        svc.request_stop()
        await asyncio.wait_for(run, 10)


async def raw_call(nc: Nats, subjects: Subjects, route: str, data: bytes) -> dict[str, Any]:
    """Send raw bytes (what ``ApiClient`` cannot build) and return the reply envelope."""
    resource, _, verb = route.partition(".")
    msg = await nc.request(subjects.api("engine", resource, verb), data, timeout=5)
    reply: dict[str, Any] = msgspec.json.decode(msg.data)
    return reply


def invalid(reply: dict[str, Any]) -> tuple[str, str | None]:
    error = reply.get("error") or {}
    return error.get("code"), (error.get("details") or {}).get("path")


async def test_a_nul_byte_in_a_string_is_invalid_input_with_its_path(
    engine: EngineService, bc_api: ApiClient
) -> None:
    err = await refused(bc_api.call("engine", "nodes.get", {"id": "node_\x00"}, timeout=5))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "id")
    err = await refused(bc_api.call("engine", "profiles.get", {"id": "p\x00"}, timeout=5))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "id")
    # deep in a document, and in an object key
    doc = {"id": "x", "version": 1, "steps": [{"use": "test.noop", "with": {"a\x00b": 1}}]}
    err = await refused(bc_api.call("engine", "profiles.validate", {"document": doc}, timeout=5))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "document.steps[0].with")
    assert "NUL" in err.message


async def test_json_nested_10000_deep_is_invalid_input_with_its_path(
    engine: EngineService, bc_nats: Nats, bc_subjects: Subjects
) -> None:
    deep = b'{"document": {"steps": ' + b"[" * DEEP + b"]" * DEEP + b"}}"
    reply = await raw_call(bc_nats, bc_subjects, "profiles.validate", deep)
    code, path = invalid(reply)
    assert code == ErrorCode.INVALID_INPUT
    assert path is not None
    assert path.startswith("document.steps[0][0]")
    # an unknown field is skipped, but not when it is too deep to skip
    reply = await raw_call(bc_nats, bc_subjects, "nodes.list", b'{"zz": ' + b"[" * DEEP + b"]" * DEEP + b"}")
    assert invalid(reply)[0] == ErrorCode.INVALID_INPUT


async def test_an_integer_beyond_int64_is_invalid_input_with_its_path(
    engine: EngineService, bc_api: ApiClient
) -> None:
    err = await refused(
        bc_api.call(
            "engine", "workflows.start", {"profileId": "test-chain", "profileVersion": 2**63}, timeout=5
        )
    )
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "profileVersion")
    err = await refused(
        bc_api.call("engine", "profiles.get", {"id": "test-chain", "version": -(2**64)}, timeout=5)
    )
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "version")
    # a version is a PostgreSQL int: beyond it is refused at entry too, not by the store
    err = await refused(
        bc_api.call("engine", "profiles.get", {"id": "test-chain", "version": 2**31}, timeout=5)
    )
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "version")
    doc = {
        "id": "big-version",
        "version": 2**40,
        "target": "metal",
        "role": "host",
        "steps": [{"use": "test.noop"}],
    }
    err = await refused(bc_api.call("engine", "profiles.create", {"document": doc}, timeout=5))
    # (a document that does not validate is INVALID_CONFIG, as for any other field of it)
    assert (err.code, err.path) == (ErrorCode.INVALID_CONFIG, "document.version")
    # the bound itself is still a version a request may carry
    err = await refused(
        bc_api.call("engine", "profiles.get", {"id": "test-chain", "version": 2**31 - 1}, timeout=5)
    )
    assert err.code == ErrorCode.NOT_FOUND


async def test_ids_and_names_are_refused_at_entry_with_the_field_and_an_example(
    engine: EngineService, bc_settings: Settings, bc_api: ApiClient
) -> None:
    """Issue 10 item 2: ``nodes.create`` took these site ids, and the node failed only at its
    first command. Every service refuses a bad name at entry with the same words."""
    node = new_id("node")
    async with PkiService(bc_settings), CommandQueueService(bc_settings):
        for site in ("", "lab 1!", "s" * 1_000_000):
            calls = {
                "engine": ("nodes.create", {"siteId": site}),
                "pki": ("tokens.issue", {"tenantId": "t", "role": "site", "siteId": site, "ttlSeconds": 60}),
                "command-queue": (
                    "commands.enqueue",
                    {"nodeId": node, "siteId": site, "kind": "k", "key": "k"},
                ),
            }
            messages = set()
            for service, (route, payload) in calls.items():
                err = await refused(bc_api.call(service, route, payload, timeout=5))
                assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "siteId"), (service, err)
                assert "siteId must be" in err.message
                assert "e.g. 'lab-1'" in err.message
                messages.add(err.message)
            assert len(messages) == 1, messages
        # an id names the field and shows one that would do
        err = await refused(bc_api.call("engine", "nodes.create", {"siteId": "lab-1", "id": "n1"}, timeout=5))
        assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "id")
        assert "e.g. node_" in err.message
        err = await refused(
            bc_api.call(
                "command-queue",
                "commands.enqueue",
                {"nodeId": "lab 1!", "siteId": "lab-1", "kind": "k", "key": "k"},
            )
        )
        assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "nodeId")
        assert "nodeId must be an id" in err.message
        assert "e.g. node_" in err.message


async def test_a_malformed_node_or_workflow_id_is_invalid_input_with_an_example(
    engine: EngineService, bc_api: ApiClient
) -> None:
    cases = [("nodes.get", "lab 1!"), ("nodes.get", "wf_01JAAAAAAAAAAAAAAAAAAAAAAA"),
             ("workflows.get", "nope"), ("workflows.get", "node_01JAAAAAAAAAAAAAAAAAAAAAAA")]  # fmt: skip
    for route, bad in cases:
        err = await refused(bc_api.call("engine", route, {"id": bad}, timeout=5))
        assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "id"), (route, bad)
        assert "e.g. " in err.message, err.message
    # a well-formed id that names nothing is still NOT_FOUND
    for route, prefix in (("nodes.get", "node"), ("workflows.get", "wf")):
        err = await refused(bc_api.call("engine", route, {"id": new_id(prefix)}, timeout=5))
        assert err.code is ErrorCode.NOT_FOUND, route
