"""Every endpoint of the four services, fed malformed requests by ``hypothesis`` (issue 10, item 3).

The services run as OS processes on a real nats-server and PostgreSQL. The endpoints come from
``$SRV.INFO``, so a new route is fuzzed without touching this file. Every request must get a
typed reply (a result, or an error with a known code other than ``INTERNAL``) in time, and every
service must still be alive and healthy afterwards.

Bounded for ``make test``: ``BC_FUZZ_EXAMPLES`` requests (default 1500) within
``BC_FUZZ_SECONDS`` (default 35) of sending; raise both for a longer sweep.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import msgspec
import nats.errors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as Nats

from better_compute.config import Settings
from better_compute.core.errors import ErrorCode
from better_compute.testing import ServiceProcesses, until

SERVICES = ["bc-engine", "bc-command-queue", "bc-pki", "bc-secrets"]
EXAMPLES = int(os.environ.get("BC_FUZZ_EXAMPLES", "1500"))
SECONDS = float(os.environ.get("BC_FUZZ_SECONDS", "35"))
REPLY_TIMEOUT = 10.0

# Field names the services read, so requests get past "missing field" into the handlers.
FIELDS = [
    "id", "ids", "siteId", "nodeId", "tenantId", "agentId", "profileId", "profileVersion",
    "version", "document", "labels", "limit", "cursor", "before", "state", "reason", "owner",
    "ref", "refs", "value", "workflowId", "step", "key", "keys", "kind", "kinds", "nodes",
    "payload", "target", "timeoutMs", "batchId", "approverId", "signature", "signerId",
    "signedAtMs", "nonce", "replyKey", "role", "ttlSeconds", "maxUses", "expect", "claims",
    "idempotencyKey", "mintSecret", "joinTokenId", "token", "csr", "certId", "data", "once",
    "public", "replace", "stepsCursor", "outcome", "note", "destructive", "result", "attempt",
]  # fmt: skip

_ID_PREFIXES = ["node", "wf", "cmd", "batch", "agent", "tok", "cert", "sec", "site"]


def _nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


def _text() -> st.SearchStrategy[str]:
    return st.one_of(
        st.text(max_size=40),
        st.text(alphabet=st.sampled_from("\x00ab-_. !/é\U0001f600"), max_size=12),
        st.sampled_from(["", "lab-1", "lab 1!", "a.b", "*", ">", "root", "x" * 300]),
        st.builds(
            lambda p, b: f"{p}_{b}",
            st.sampled_from(_ID_PREFIXES),
            st.text("0123456789ABCDEFGHJKMNPQRSTVWXYZ", min_size=26, max_size=26),
        ),
    )


_INTS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 2**64]),
)
_SCALARS = st.one_of(st.none(), st.booleans(), _INTS, st.floats(allow_nan=False), _text())
_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(FIELDS), _text()), inner, max_size=4),
    ),
    max_leaves=12,
)
_VALUES = st.one_of(_JSON, st.sampled_from([10, 63, 64, 65, 200]).map(_nested))
_REQUESTS = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), _VALUES, max_size=6).map(lambda d: json.dumps(d).encode()),
    _VALUES.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=64),
    st.sampled_from([b"", b"{", b'{"id": "\\ud800"}', b'{"limit": 1e400}', b"[" * 10_000 + b"]" * 10_000]),
)

ISSUE_CASES = [
    b'{"id": "a\\u0000b", "siteId": "\\u0000", "ref": "\\u0000"}',
    b"[" * 10_000 + b"]" * 10_000,
    json.dumps({"version": 2**64, "profileVersion": 2**63, "limit": 2**64}).encode(),
]
_TYPED = {code.value for code in ErrorCode} - {ErrorCode.INTERNAL.value}


async def endpoints(nc: Nats, root: str) -> dict[str, list[str]]:
    """``service name → subjects`` from ``$SRV.INFO``, once all four answer."""
    found: dict[str, list[str]] = {}
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)

    async def ask() -> bool:
        await nc.publish("$SRV.INFO", b"", reply=inbox)
        while True:
            try:
                msg = await sub.next_msg(timeout=0.2)
            except nats.errors.TimeoutError:
                break
            info = json.loads(msg.data)
            if (info.get("metadata") or {}).get("root") == root:
                found[info["name"]] = [e["subject"] for e in info.get("endpoints") or []]
        return set(found) >= set(SERVICES)

    try:
        await until(ask, timeout=30, what="all four services in $SRV.INFO")
    finally:
        await sub.unsubscribe()
    return found


async def test_every_endpoint_gives_a_typed_reply_to_malformed_input(
    bc_processes: ServiceProcesses, bc_settings: Settings, bc_nats: Nats
) -> None:
    procs = [bc_processes.start(name) for name in SERVICES]
    await bc_processes.wait_ready()
    by_service = await endpoints(bc_nats, bc_settings.subject_root)
    subjects = sorted({s for subs in by_service.values() for s in subs})
    assert len(subjects) > 40, by_service  # the issue counted 51

    loop = asyncio.get_running_loop()
    seen: dict[str, int] = {}
    bad: list[tuple[str, bytes, str]] = []
    stop_at = time.monotonic() + SECONDS

    async def send(subject: str, data: bytes) -> str | None:
        """What is wrong with the reply, or None when it is typed."""
        try:
            msg = await bc_nats.request(subject, data, timeout=REPLY_TIMEOUT)
        except nats.errors.TimeoutError:
            return "no reply (timeout)"
        try:
            reply = msgspec.json.decode(msg.data)
        except msgspec.DecodeError:
            return f"reply is not JSON: {msg.data[:200]!r}"
        error = reply.get("error") if isinstance(reply, dict) else None
        if error is None:
            return None if isinstance(reply, dict) and "result" in reply else f"untyped reply {reply!r:.200}"
        if error.get("code") not in _TYPED:
            return f"{error.get('code')}: {error.get('message')}"
        if error["code"] == ErrorCode.INVALID_INPUT.value and "path" not in (error.get("details") or {}):
            return f"INVALID_INPUT without details.path: {error.get('message')}"
        return None

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(subject=st.sampled_from(subjects), data=_REQUESTS)
    def fuzz(subject: str, data: bytes) -> None:
        if time.monotonic() > stop_at:
            return  # the time bound: the remaining examples are not sent
        problem = asyncio.run_coroutine_threadsafe(send(subject, data), loop).result(REPLY_TIMEOUT + 5)
        seen[subject] = seen.get(subject, 0) + 1
        if problem is not None:
            bad.append((subject, data[:300], problem))
        assert problem is None, f"{subject} <- {data[:300]!r}: {problem}"

    # every endpoint once with the issue's three cases, then hypothesis's draws
    for subject in subjects:
        for data in ISSUE_CASES:
            problem = await send(subject, data)
            assert problem is None, f"{subject} <- {data[:100]!r}: {problem}"
    await asyncio.to_thread(fuzz)

    print(f"fuzzed {sum(seen.values())} requests over {len(seen)} of {len(subjects)} endpoints")
    assert not bad, bad[:5]
    assert len(seen) > len(subjects) // 2, "the time bound left most endpoints unfuzzed"
    # every service is still there, and healthy
    for proc in procs:
        assert proc.alive(), f"{proc.service} exited:\n{proc.output()[-2000:]}"
    ready = await bc_processes.wait_ready(timeout=10)
    assert {d["name"] for d in ready} >= set(SERVICES)
    for name, subs in by_service.items():
        health = next(s for s in subs if s.endswith(".health.get"))
        reply = msgspec.json.decode((await bc_nats.request(health, b"{}", timeout=5)).data)
        assert reply["result"]["ok"] is True, (name, reply)
