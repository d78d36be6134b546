"""Replies never outgrow the bus (issue 8, item 4), on a real nats-server and PostgreSQL.

Every list pages with ``limit`` and an opaque ``cursor`` (the reply's ``next``); free fields are
bounded where they enter; a reply the bus cannot carry is a typed error, never silence.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ClassVar

import asyncpg
import msgspec
import pytest_asyncio

from bc_command_queue.service import CommandQueueService
from bc_engine.service import EngineService
from bc_pki.service import PkiService
from bc_secrets.service import SecretsService
from better_compute.clients import EngineClient
from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.pki import PkiClient
from better_compute.clients.secrets import SecretsClient
from better_compute.config import Settings
from better_compute.core.errors import ErrorCode
from better_compute.core.ids import new_id
from better_compute.crypto import make_csr, new_agent_key
from better_compute.service import ApiClient, ApiRequest, Handler, Service
from better_compute.testing import refused
from better_compute.testing.workflows import wait_workflow
from better_compute.wire.pki import JoinClaims
from engine_test_app import TABLES

ONE_MB = 1_000_000


@pytest_asyncio.fixture(loop_scope="session")
async def db(bc_settings: Settings) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(bc_settings.database_url)
    yield conn
    await conn.close()


@pytest_asyncio.fixture(loop_scope="session")
async def engine(bc_settings: Settings, db: asyncpg.Connection) -> AsyncIterator[EngineService]:
    await db.execute(TABLES)
    svc = EngineService(msgspec.structs.replace(bc_settings, app="engine_test_app:app"))
    async with svc:
        run = asyncio.create_task(svc.run())
        yield svc
        svc.request_stop()
        await asyncio.wait_for(run, 10)


async def walk(
    call: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]], field: str, limit: int
) -> tuple[list[Any], int]:
    """Every item of a list, following ``next``; and how many pages it took."""
    items: list[Any] = []
    cursor: str | None = None
    pages = 0
    while True:
        got = await call({"limit": limit, "cursor": cursor})
        pages += 1
        assert len(got[field]) <= limit
        items += got[field]
        cursor = got["next"]
        if cursor is None:
            return items, pages
        assert pages < 1000, "the cursor never ends"


# -- the issue's case: nine nodes with a 1 MB label ----------------------------------------


async def test_nine_nodes_with_a_1mb_label_each_list_in_pages(
    engine: EngineService, bc_api: ApiClient, db: asyncpg.Connection
) -> None:
    # Rows stored before labels were bounded (or written by hand): nine times 1 MB is more
    # than the bus carries in one message (8 MB here), which used to leave the caller
    # waiting for a reply that was never sent.
    ids = sorted(new_id("node") for _ in range(9))
    await db.executemany(
        "INSERT INTO engine.nodes (id, site_id, labels) VALUES ($1, 'site-a', $2)",
        [(i, json.dumps({"rack": "r" * ONE_MB})) for i in ids],
    )
    first = await EngineClient(bc_api).list_nodes()
    assert first.nodes
    assert first.next is not None
    listed, pages = await walk(lambda p: bc_api.call("engine", "nodes.list", p, timeout=5), "nodes", 100)
    assert [n["id"] for n in listed] == ids
    assert all(len(n["labels"]["rack"]) == ONE_MB for n in listed)
    assert pages > 1  # the reply was cut by size, not by the limit


async def test_a_1mb_label_is_refused_with_its_path_and_the_bounds_hold(
    engine: EngineService, bc_api: ApiClient
) -> None:
    engine_api = EngineClient(bc_api)

    async def create(labels: dict[str, str]) -> dict[str, Any]:
        return await engine_api.create_node(site_id="site-a", labels=labels)

    err = await refused(create({"rack": "r" * ONE_MB}))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "labels.rack")
    err = await refused(create({"bad key!": "x"}))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "labels")
    err = await refused(create({f"k{i}": "v" for i in range(65)}))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "labels")
    err = await refused(engine_api.create_node(site_id="a.b"))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "siteId")
    # the largest labels allowed still list: nine nodes at the bounds
    big = {f"key{i:02d}": "v" * 256 for i in range(64)}
    for _ in range(9):
        await create(big)
    got = await engine_api.list_nodes()
    assert len(got.nodes) == 9
    assert got.next is None


async def test_profile_documents_step_inputs_and_reasons_are_bounded(
    engine: EngineService, bc_api: ApiClient
) -> None:
    engine_api = EngineClient(bc_api)

    def doc(**kw: Any) -> dict[str, Any]:
        return {"id": "big", "version": 1, "target": "metal", "role": "host",
                "steps": [{"use": "test.noop"}], **kw}  # fmt: skip

    # each step's input within its bound, the document beyond its own
    huge = doc(steps=[{"use": "test.noop", "with": {"x": "w" * 40_000}} for _ in range(8)])
    err = await refused(engine_api.create_profile(document=huge))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "document")
    err = await refused(engine_api.validate_profile(document=huge))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "document")
    wide = doc(steps=[{"use": "test.noop"}, {"use": "test.noop", "with": {"x": "w" * 70_000}}])
    err = await refused(engine_api.create_profile(document=wide))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "document.steps[1].with")
    wf = await engine_api.start_workflow(profile_id="test-chain")
    err = await refused(engine_api.abort_workflow(id=wf.id, reason="r" * 2000))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "reason")


# -- pagination: every item exactly once, with inserts while walking ------------------------


async def test_walking_nodes_sees_each_exactly_once_while_nodes_are_added(
    engine: EngineService, bc_api: ApiClient
) -> None:
    engine_api = EngineClient(bc_api)

    async def create(node_id: str | None = None) -> str:
        got = await engine_api.create_node(site_id="site-a", id=node_id)
        return str(got.id)

    before = set(await asyncio.gather(*(create() for _ in range(45))))
    seen: list[str] = []
    added_ahead: set[str] = set()
    cursor: str | None = None
    while True:
        got = await engine_api.list_nodes(limit=7, cursor=cursor)
        seen += [n.id for n in got.nodes]
        cursor = got.next
        if cursor is None:
            break
        # between pages, others add nodes: some sort before the cursor (an old timestamp),
        # some after it (new ones); neither may repeat or hide what was there
        behind = "node_0000000000" + new_id("node")[-16:]
        await asyncio.gather(create(behind), *(create() for _ in range(2)))
        ahead = await create()
        added_ahead.add(ahead)
    assert len(seen) == len(set(seen)), "an item was listed twice"
    assert before <= set(seen), "an item that was there all along was skipped"
    assert added_ahead <= set(seen), "an item added past the cursor was skipped"
    assert seen == sorted(seen)


async def test_workflows_and_profiles_page_with_a_cursor(engine: EngineService, bc_api: ApiClient) -> None:
    engine_api = EngineClient(bc_api)
    started = [(await engine_api.start_workflow(profile_id="test-chain")).id for _ in range(5)]
    listed, pages = await walk(lambda p: bc_api.call("engine", "workflows.list", p), "workflows", 2)
    assert [w["id"] for w in listed] == sorted(started, reverse=True)
    assert pages == 3
    err = await refused(engine_api.list_workflows(cursor="not-a-cursor"))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "cursor")
    err = await refused(engine_api.list_nodes(limit=100_000))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "limit")

    for i in range(4):
        doc = {"id": f"p-{i}", "version": 1, "target": "metal", "role": "host",
               "steps": [{"use": "test.noop"}]}  # fmt: skip
        await engine_api.create_profile(document=doc)
    everything = await engine_api.list_profiles(limit=1000)
    listed, pages = await walk(lambda p: bc_api.call("engine", "profiles.list", p), "profiles", 3)
    key = [(p["id"], p["version"], p["tenantId"]) for p in listed]
    assert key == [(p.id, p.version, p.tenant_id) for p in everything.profiles]
    assert len(key) == len(set(key))
    assert {f"p-{i}" for i in range(4)} <= {k[0] for k in key}
    assert pages > 1


async def test_a_workflow_whose_step_results_outgrow_the_bus_reads_in_pages(
    engine: EngineService, bc_api: ApiClient, db: asyncpg.Connection
) -> None:
    engine_api = EngineClient(bc_api)
    wf = await engine_api.start_workflow(profile_id="test-chain")
    await wait_workflow(bc_api, wf.id)
    # six results of 2 MB: 12 MB, more than one message carries
    await db.execute(
        "UPDATE engine.workflow_steps SET result = $2 WHERE workflow_id = $1",
        wf.id, json.dumps({"blob": "b" * 2 * ONE_MB}),
    )  # fmt: skip
    got = await engine_api.get_workflow(id=wf.id)
    steps = list(got.steps)
    assert got.steps_next is not None
    while got.steps_next is not None:
        got = await engine_api.get_workflow(id=wf.id, steps_cursor=got.steps_next)
        steps += got.steps
    assert [s.index for s in steps] == list(range(6))
    assert all(len(s.result["blob"]) == 2 * ONE_MB for s in steps)


# -- the skeleton: a reply or a request the bus cannot carry -----------------------------


class _Size(msgspec.Struct, kw_only=True):
    size: int


class BigService(Service):
    """Answers with as many bytes as asked for."""

    name: ClassVar[str] = "bc-big"
    api_name: ClassVar[str] = "big"

    def routes(self) -> dict[str, Handler]:
        return {"blob.get": self.blob}

    async def blob(self, req: ApiRequest) -> dict[str, Any]:
        return {"blob": "x" * req.decode(_Size).size}


async def test_a_reply_larger_than_max_payload_is_a_typed_error(
    bc_settings: Settings, bc_api: ApiClient
) -> None:
    limit = bc_api.nc.max_payload
    async with BigService(bc_settings):
        assert len((await bc_api.call("big", "blob.get", {"size": 1000}))["blob"]) == 1000
        err = await refused(bc_api.call("big", "blob.get", {"size": limit + 1}, timeout=5))
        assert err.code is ErrorCode.INTERNAL
        assert err.reason == "reply-too-large"
        assert err.details["maxPayload"] == limit
        assert err.details["size"] > limit
        # the service carries on
        assert len((await bc_api.call("big", "blob.get", {"size": 10}))["blob"]) == 10


async def test_a_request_larger_than_max_payload_is_refused_before_it_is_sent(
    bc_settings: Settings, bc_api: ApiClient
) -> None:
    limit = bc_api.nc.max_payload
    async with BigService(bc_settings):
        err = await refused(bc_api.call("big", "blob.get", {"size": 1, "pad": "p" * limit}, timeout=5))
        assert err.code is ErrorCode.INVALID_INPUT
        assert err.reason == "request-too-large"
        assert err.details["maxPayload"] == limit
        assert bc_api.nc.is_connected


# -- the other services' lists -----------------------------------------------------------------


async def test_pki_tokens_and_certificates_page(bc_settings: Settings, bc_api: ApiClient) -> None:
    pki = PkiClient(bc_api)
    async with PkiService(bc_settings):
        tokens = [
            await pki.issue_join_token(tenant_id="root", role="node", site_id="site-a", ttl_seconds=600)
            for _ in range(5)
        ]
        listed, pages = await walk(lambda p: bc_api.call("pki", "tokens.list", p), "tokens", 2)
        assert sorted(t["joinTokenId"] for t in listed) == sorted(t.id for t in tokens)
        assert pages == 3
        shared = await pki.issue_join_token(
            tenant_id="root", role="discovery", site_id="site-a", ttl_seconds=600, max_uses=3
        )
        for i in range(3):
            claims = JoinClaims(macs=[f"aa:bb:cc:00:00:0{i}"])
            await pki.join(token=shared.token, csr=make_csr(new_agent_key()), claims=claims)
        certs, pages = await walk(lambda p: bc_api.call("pki", "certs.list", p), "certificates", 2)
        assert len({c["certId"] for c in certs}) == 3
        assert pages == 2
        joins, _ = await walk(lambda p: bc_api.call("pki", "joins.list", p), "joins", 2)
        assert len({j["id"] for j in joins}) == 3
        page = await pki.join_tokens_page(limit=2)
        assert len(page.tokens) == 2
        assert page.next is not None


async def test_secrets_page(bc_settings: Settings, bc_api: ApiClient) -> None:
    secrets = SecretsClient(bc_api)
    wf = new_id("wf")
    async with SecretsService(bc_settings):
        refs = [
            (await secrets.put(value=b"v", tenant_id="root", workflow_id=wf, step=i)).ref for i in range(5)
        ]
        listed, pages = await walk(lambda p: bc_api.call("secrets", "secrets.list", p), "secrets", 2)
        assert sorted(s["ref"] for s in listed) == sorted(refs)
        assert pages == 3
        page = await secrets.secrets_page(limit=4)
        assert len(page.secrets) == 4
        assert page.next is not None


async def test_command_queue_agents_and_batches_page(
    bc_settings: Settings, bc_api: ApiClient, db: asyncpg.Connection
) -> None:
    cq = CommandQueueClient(bc_api)
    async with CommandQueueService(bc_settings):
        agents = [new_id("agent") for _ in range(5)]
        await db.executemany(
            "INSERT INTO cmdq.agents (id, site_id, tenant_id, role, cert_id)"
            " VALUES ($1, $2, 'root', 'site', $3)",
            [(a, f"site-{i % 2}", new_id("cert")) for i, a in enumerate(agents)],
        )
        listed, pages = await walk(lambda p: bc_api.call("command-queue", "agents.list", p), "agents", 2)
        assert sorted(a["id"] for a in listed) == sorted(agents)
        assert pages == 3
        # batches carry their node lists: big ones are cut by size
        nodes = [new_id("node") for _ in range(10_000)]
        batches = [(await cq.create_batch(kinds=["node.wipe"], nodes=nodes)).id for _ in range(15)]
        listed, pages = await walk(lambda p: bc_api.call("command-queue", "batches.list", p), "batches", 1000)
        assert [b["id"] for b in listed] == sorted(batches, reverse=True)
        assert pages > 1
        page = await cq.batches_page(limit=1)
        assert len(page.batches) == 1
        assert page.next is not None
        agent_page = await cq.agents_page(limit=2)
        assert len(agent_page.agents) == 2
        assert agent_page.next is not None
