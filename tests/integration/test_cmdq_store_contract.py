"""The command queue's two stores answer alike: one script of every ``Store`` operation runs on
``PgStore`` (real PostgreSQL, the statements the service runs) and on ``MemoryStore`` (what the unit
tests use), and both tell the same story. The SQL is the truth: when this fails, the in-memory
store has drifted from it.

Time passes for PostgreSQL by moving every stored time back (``now()`` cannot move), for the
memory store by moving its clock on: the same thing seen from the rows."""

from __future__ import annotations

import asyncio
import datetime
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import asyncpg
import msgspec
import pytest_asyncio

from bc_command_queue.rows import Beat, CommandRow
from bc_command_queue.storage import (
    AgentHello,
    Claim,
    NewBatch,
    NewCommand,
    PgStore,
    Published,
    Report,
    Said,
    Store,
    row_may_be_at_fault,
)
from bc_command_queue.testing import MemoryStore
from better_compute.core.ids import new_id
from better_compute.service import Database
from better_compute.service.groups import GroupCommit
from better_compute.wire.agent import payload_digest

SITE = "site-a"
PAYLOAD = msgspec.json.encode({}).decode()
DIGEST = bytes.fromhex(payload_digest("node.inventory", PAYLOAD.encode()))

# Every stored time, moved back to make time pass; expires_at_ms is the signed expiry.
_TIMES = {
    "commands": ("created_at", "updated_at", "not_after", "dispatched_at", "published_at", "acked_at",
                 "finished_at", "ended_at"),
    "batches": ("created_at", "expires_at", "approved_at", "closed_at", "expiry_published_at"),
    "approvals": ("created_at",),
    "agents": ("last_seen", "connected_at"),
    "journals": ("last_seen", "first_seen"),
    "boot_leases": ("expires_at",),
}  # fmt: skip


@dataclass
class Harness:
    store: Store
    age: Callable[[float], Awaitable[None]]
    agent_seen: Callable[[str, str], Awaitable[None]]


@pytest_asyncio.fixture(loop_scope="session")
async def pg(bc_database_url: str) -> AsyncIterator[Harness]:
    db = Database(bc_database_url, "cmdq")
    await db.open()

    async def age(seconds: float) -> None:
        async with db.transaction() as conn:
            for table, columns in _TIMES.items():
                moved = ", ".join(f"{c} = {c} - $1::interval" for c in columns)
                await conn.execute(f"UPDATE {table} SET {moved}", datetime.timedelta(seconds=seconds))
            await conn.execute("UPDATE batches SET expires_at_ms = expires_at_ms - $1", int(seconds * 1000))

    async def agent_seen(agent_id: str, role: str) -> None:
        await db.execute(
            "INSERT INTO agents (id, site_id, tenant_id, role, cert_id) VALUES ($1, $2, 'root', $3, 'cert_x')"
            " ON CONFLICT (id) DO UPDATE SET last_seen = now()",
            agent_id, SITE, role,
        )  # fmt: skip

    try:
        yield Harness(PgStore(db), age, agent_seen)
    finally:
        await db.close()


def memory() -> Harness:
    store = MemoryStore()

    async def age(seconds: float) -> None:
        store.advance(seconds)

    async def agent_seen(agent_id: str, role: str) -> None:
        store.agent_seen(agent_id, site_id=SITE, role=role, hello=False)  # pg's: last_seen only

    return Harness(store, age, agent_seen)


async def told_alike(pg: Harness, script: Callable[[Harness], Awaitable[list[Any]]]) -> dict[Any, Any]:
    """``script`` on PostgreSQL and on the memory store: each step answered alike, step by step
    (the SQL is the truth); what PostgreSQL told, by each step's first word."""
    on_pg = await script(pg)
    in_memory = await script(memory())
    for step_pg, step_mem in zip(on_pg, in_memory, strict=True):
        assert step_mem == step_pg
    return {step[0]: step[1:] for step in on_pg}


async def story(h: Harness) -> list[Any]:
    """Every operation once or more; what each answered, with ids replaced by names."""
    s = h.store
    names: dict[str | None, str] = {None: "-"}
    told: list[Any] = []

    def name(ident: str | None) -> str:
        return names.setdefault(ident, f"?{ident}")

    def say(what: str, rows: CommandRow | list[CommandRow] | None) -> None:
        if rows is None or isinstance(rows, CommandRow):
            rows = [] if rows is None else [rows]
        told.append(
            (what, sorted((name(r.id), r.state, r.reason, name(r.agent_id), r.progress) for r in rows))
        )

    now_ms = int(time.time() * 1000)

    async def insert(
        label: str, *, target: str = "node", timeout_s: int = 3600, node: str | None = None, **over: Any
    ) -> CommandRow | None:
        if node is None:
            node = new_id("node")
            names[node] = f"{label}.node"
        fields: dict[str, Any] = {
            "id": new_id("cmd"), "node_id": node, "site_id": SITE, "tenant_id": "root", "key": f"k-{label}",
            "kind": "node.inventory", "destructive": False, "target": target, "payload": PAYLOAD,
            "digest": DIGEST, "batch_id": None, "workflow_id": None, "step": None,
            "not_after_ms": now_ms + timeout_s * 1000, "may_dispatch": True, **over,
        }  # fmt: skip
        names[fields["id"]] = label
        row = await s.insert_command(NewCommand(**fields), silent_after_ms=15_000)
        say(f"insert {label}", row)
        return row

    async def batch(label: str, *, ttl_s: int, key: str | None = None) -> str:
        ident = new_id("batch")
        names[ident] = label
        new = NewBatch(
            id=ident, tenant_id="root", kinds=["node.wipe"], nodes=[], workflow_id=None, workflow_ids=[],
            note=None, idempotency_key=key, document=b"doc-" + label.encode(), threshold=1,
            expires_at_ms=now_ms + ttl_s * 1000,
        )  # fmt: skip
        row = await s.insert_batch(new)
        told.append((f"batch {label}", row is not None and (row.expired, row.approved_at, row.closed_at)))
        return ident

    await h.agent_seen("agent-a", "site")
    names["agent-a"] = "agent-a"
    n1 = await insert("n1")
    s1 = await insert("s1", target="site")
    s2 = await insert("s2", target="site", may_dispatch=False, timeout_s=30)
    assert n1
    assert s1
    assert s2
    same_key = NewCommand(**{**msgspec.structs.asdict(_new_from(n1)), "id": new_id("cmd")})
    say("insert again", await s.insert_command(same_key, silent_after_ms=15_000))

    # claims: a journal's generation, a wrong digest, a claim and the same journal again
    g1 = await s.journal_seen(n1.node_id, "ja", present=False)
    g2 = await s.journal_seen(n1.node_id, "jb", present=True)
    g1b = await s.journal_seen(n1.node_id, "ja", present=True)
    told.append(("journals", g1.generation < g2.generation, g1b.generation == g1.generation, g1b.present))
    say("ack wrong digest", await s.ack(n1.id, n1.node_id, b"x" * 32, "ja", 1, quorum=False))
    say("ack", await s.ack(n1.id, n1.node_id, DIGEST, "ja", 10, quorum=False))
    say("ack same journal", await s.ack(n1.id, n1.node_id, DIGEST, "ja", 11, quorum=False))
    say("ack other journal", await s.ack(n1.id, n1.node_id, DIGEST, "jb", 12, quorum=False))
    cs = await s.claim_state(n1.id)
    assert cs is not None
    told.append(("claim state", cs.state, cs.live, cs.claim_journal, cs.claim_signed_ms, cs.has_batch))
    p = await s.progress(n1.id, n1.node_id, "half")
    told.append(("progress", p and (p.old_state, p.command.state, p.command.progress)))
    p = await s.progress(n1.id, n1.node_id, None)
    told.append(("progress again", p and (p.old_state, p.command.state, p.command.progress)))
    say("rerun other journal", await s.claim_rerun(n1.id, n1.node_id, "jb"))
    say("rerun", await s.claim_rerun(n1.id, n1.node_id, "ja"))
    say("interrupted by older", await s.claim_interrupted(n1.id, n1.node_id, "jb", 5, 0, True))
    say("interrupted", await s.claim_interrupted(n1.id, n1.node_id, "jb", 13, g2.generation, True))
    say("late end", await s.late_end(n1.id, n1.node_id))
    say("late end again", await s.late_end(n1.id, n1.node_id))

    # runs: a cancelled claimed command, a result, a duplicate
    n2, n3 = await insert("n2"), await insert("n3")
    assert n2
    assert n3
    for row in (n2, n3):
        await s.ack(row.id, row.node_id, DIGEST, "ja", 20, quorum=False)
    say("cancel claimed", await s.cancel(n2.id, "operator"))
    say("result of cancelling", await s.result(
        n2.id, n2.node_id, status="succeeded", reason=None, result=b"{}", signature=None, attested=False,
        journal="ja"))  # fmt: skip
    say("result", await s.result(
        n3.id, n3.node_id, status="failed", reason="boom", result=b"{}", signature=None, attested=False,
        journal=""))  # fmt: skip
    say("result again", await s.result(
        n3.id, n3.node_id, status="succeeded", reason=None, result=b"{}", signature=None, attested=True,
        journal=""))  # fmt: skip
    st = await s.command_state(n3.id)
    told.append(("command state", st and (st.state, st.live, name(st.agent_id))))

    # batches and the quorum
    b1 = await batch("b1", ttl_s=3600, key="job-1")
    await batch("b1 again", ttl_s=3600, key="job-1")
    found = await s.batch_by_key("job-1")
    told.append(("by key", found and name(found.id)))
    told.append(
        ("approve", await s.insert_approval(b1, "alice", b"sig"), await s.insert_approval(b1, "alice", b"x"))
    )
    told.append(
        ("approvals", [(name(a.batch_id), a.approver_id, a.signature) for a in await s.approvals_of([b1])])
    )
    await s.set_batch_approved(b1, True)
    w1 = await insert("w1", destructive=True, batch_id=b1, may_dispatch=False)
    w2 = await insert("w2", destructive=True, batch_id=b1)
    w3 = await insert("w3", destructive=True)
    assert w1
    assert w2
    assert w3
    say("dispatch batch", await s.dispatch_pending(quorum=True, site_id=None, batch_id=b1, limit=10,
                                                   silent_after_ms=15_000))  # fmt: skip
    say("ack under quorum", await s.ack(w1.id, w1.node_id, DIGEST, "ja", 30, quorum=True))
    say("ack without batch", await s.ack(w3.id, w3.node_id, DIGEST, "ja", 30, quorum=True))
    cs = await s.claim_state(w3.id)
    told.append(("no batch", cs and (cs.has_batch, cs.batch_expired, cs.batch_approved, cs.destructive)))
    say("back to pending", await s.claim_back_to_pending(w3.id, w3.node_id, "ja"))
    await s.set_batch_approved(b1, False)
    say("undispatch", await s.undispatch_batch(b1))
    closed = await s.close_batch(b1, "failed")
    again = await s.close_batch(b1, "other")
    reopened = await s.reopen_batch(b1)
    told.append(("close", closed and closed.closed_reason, again and again.closed_reason,
                 reopened and (reopened.closed_at, reopened.closed_reason)))  # fmt: skip
    sizes = await s.batch_sizes(workflow_id=None, state="open", before=None, limit=10)
    told.append(("open batches", sorted((name(r.id), r.size) for r in sizes)))
    b2 = await batch("b2", ttl_s=10)
    w4 = await insert("w4", destructive=True, batch_id=b2, may_dispatch=False)
    assert w4
    by_ids = await s.batches_by_ids([b1, b2])
    told.append(("by ids", [name(b.id) for b in by_ids]))

    # finding, listing, cancelling under a key prefix, fences (a superseded step attempt)
    found_by_key = await s.command_by_key(n1.node_id, "k-n1")
    told.append(("by key", found_by_key and name(found_by_key.id)))
    states = await s.command_states([n1.id, n3.id, "cmd_unknown"])
    told.append(("states", sorted((name(i), st) for i, st in states.items())))
    failed = await s.list_commands(
        node_id=None, workflow_id=None, state="failed", kind="node.inventory", site_id=SITE, agent_id=None,
        batch_id=None, before=None, limit=10,
    )  # fmt: skip
    told.append(("list failed", sorted(name(r.id) for r in failed)))
    one = await s.list_commands(
        node_id=n3.node_id, workflow_id=None, state=None, kind=None, site_id=None, agent_id=None,
        batch_id=None, before=None, limit=10,
    )  # fmt: skip
    told.append(("list of a node", [name(r.id) for r in one]))
    told.append(("list before", await s.list_commands(
        node_id=n3.node_id, workflow_id=None, state=None, kind=None, site_id=None, agent_id=None,
        batch_id=None, before=n3.id, limit=10)))  # fmt: skip
    wf, node = new_id("wf"), new_id("node")
    names[node] = "f.node"
    await h.agent_seen(node, "node")
    f1 = await insert("f1", node=node, key=f"wf:{wf}:3#1:a", workflow_id=wf)
    f2 = await insert("f2", node=node, key=f"wf:{wf}:3#1:b", workflow_id=wf)
    f3 = await insert("f3", node=node, key=f"wf:{wf}:3#12:c", workflow_id=wf)
    assert f1
    assert f2
    assert f3
    await s.ack(f2.id, node, DIGEST, "ja", 50, quorum=False)
    told.append(("live under", sorted(name(i) for i, _ in await s.live_under(node, f"wf:{wf}:3#1", None))))
    told.append(("fenced before", await s.fenced(f"wf:{wf}:3#1:z")))
    await s.fence(f"wf:{wf}:3#1", wf, "superseded")
    told.append(("fenced", await s.fenced(f"wf:{wf}:3#1:z"), await s.fenced(f"wf:{wf}:3#1"),
                 await s.fenced(f"wf:{wf}:3#12:c"), await s.fenced(f"wf:{wf}:3")))  # fmt: skip
    say(
        "cancel under",
        await s.cancel_under(f"wf:{wf}:3#1", node_id=None, workflow_id=wf, reason="superseded"),
    )
    claimed = await s.claimed_under(f"wf:{wf}:3#1", node_id=node, workflow_id=None, lost_after_ms=120_000)
    told.append(("claimed under", [(name(r.id), name(r.agent_id), r.claim_journal) for r in claimed]))
    say("cancel superseded", await s.cancel_superseded(f3.id))
    say("cancel superseded again", await s.cancel_superseded(f3.id))

    # time passes: deadlines, an expired batch, a silent agent
    await h.age(31)
    say("expire due", await s.expire_due(quorum=True))
    say("expire batch", await s.expire_batch_expired())
    due = await s.batches_expiry_due()
    told.append(("expiry due", [(name(b.id), b.expired) for b in due]))
    await s.mark_expiry_published([b.id for b in due])
    told.append(("expiry due again", [name(b.id) for b in await s.batches_expiry_due()]))
    told.append(("unexpired", sorted(name(i) for i in await s.unexpired_batch_ids())))
    say("reassign silent", await s.reassign_silent(silent_after_ms=15_000))
    await h.agent_seen("agent-b", "site")
    names["agent-b"] = "agent-b"
    say("dispatch site", await s.dispatch_pending(quorum=True, site_id=SITE, batch_id=None, limit=10,
                                                  silent_after_ms=15_000))  # fmt: skip
    say("republish fresh", await s.republish_due(redeliver_after_ms=60_000, silent_after_ms=15_000))
    await s.mark_published(s1.id, "agent-b", 7)
    await h.age(61)
    await h.agent_seen("agent-b", "site")
    say("republish stale", await s.republish_due(redeliver_after_ms=60_000, silent_after_ms=15_000))
    after = await s.command_by_id(s1.id)
    told.append(("published", after and after.publishes))

    # a lost agent's claimed command, then retention
    n4 = await insert("n4")
    assert n4
    await h.agent_seen(n4.node_id, "node")
    await s.ack(n4.id, n4.node_id, DIGEST, "ja", 40, quorum=False)
    await h.age(121)
    # the whole site is silent (its link cut, or every agent stopped): unreachable, not lost
    say("fail lost, site silent", await s.fail_lost(lost_after_ms=120_000, silent_after_ms=15_000))
    await h.agent_seen("agent-b", "site")  # its site agent heard, connected since long before
    say("fail lost", await s.fail_lost(lost_after_ms=120_000, silent_after_ms=15_000))
    # the count of each command's state changes, which orders its events (the trigger on PostgreSQL)
    changes = [await s.command_by_id(c.id) for c in (n1, s1, w1, w2, n4)]
    told.append(("versions", sorted((name(r.id), r.state, r.version) for r in changes if r)))
    await h.age(2 * 86400)
    told.append(("purged", await s.purge_finished(retention_days=1)))
    told.append(
        ("left", sorted(name(r.id) for r in [await s.command_by_id(c.id) for c in (n1, s1, w1, w2)] if r))
    )
    return told


def _new_from(row: CommandRow) -> NewCommand:
    return NewCommand(
        id=row.id, node_id=row.node_id, site_id=row.site_id, tenant_id=row.tenant_id, key=row.key,
        kind=row.kind, destructive=row.destructive, target=row.target, payload=row.payload, digest=DIGEST,
        batch_id=row.batch_id, workflow_id=row.workflow_id, step=row.step,
        not_after_ms=int(row.not_after * 1000), may_dispatch=True,
    )  # fmt: skip


async def test_the_memory_store_tells_the_same_story_as_postgresql(pg: Harness) -> None:
    # the same story, and the one the queue's rules tell (a drift in both would pass the first)
    told = await told_alike(pg, story)
    assert told["ack other journal"] == ([],)
    assert ("n4", "failed", 2) in told["versions"][0]  # dispatched at insert, acked, lost
    assert told["interrupted"] == ([("n1", "failed", "interrupted", "n1.node", "half")],)
    assert told["result of cancelling"] == (
        [("n2", "cancelled", "operator", "n2.node", "the agent stopped: succeeded")],
    )
    assert told["expire due"] == ([("s2", "expired", "not-dispatched", "-", None)],)
    assert told["expire batch"] == ([("w4", "expired", "batch-expired", "w4.node", None)],)
    assert told["dispatch site"] == ([("s1", "dispatched", None, "agent-b", None)],)
    assert told["cancel under"] == (
        [
            ("f1", "cancelled", "superseded", "f.node", None),
            ("f2", "cancelling", "superseded", "f.node", None),
        ],
    )
    assert told["claimed under"] == ([("f2", "f.node", "ja")],)
    assert told["fail lost, site silent"] == ([],)
    assert told["fail lost"] == (  # f2 was cancelling when its node fell silent too
        [("f2", "failed", "agent-lost", "f.node", None), ("n4", "failed", "agent-lost", "n4.node", None)],
    )


async def presence(h: Harness) -> list[Any]:
    """Agents' operations once or more (hello, heartbeat, leaving, the boot lease, a revoked
    certificate, the checks and lists, the metrics' counts): what each answered."""
    s = h.store
    told: list[Any] = []
    at = iter(range(1_000, 10**9, 10))

    def hi(agent: str, cert: str, *, role: str = "site", signed: int | None = None) -> AgentHello:
        return AgentHello(
            agent_id=agent, site_id=SITE, tenant_id="root", role=role, cert_id=cert, incarnation="i1",
            version="1.0", kinds=None if role == "node" else ["node.inventory"],
            signed_at_ms=signed if signed is not None else next(at), status='{"drivers": ["sim"]}',
        )  # fmt: skip

    async def agents(**filters: Any) -> list[Any]:
        args: dict[str, Any] = {"site_id": None, "role": None, "connected": None, "after": None, **filters}
        rows = await s.list_agents(silent_after_ms=15_000, limit=10, **args)
        return [(r.id, r.role, r.connected, r.boot_lease, r.live, r.kinds, r.version, r.status) for r in rows]

    async def counts() -> Any:
        live = sorted((r.kind, r.state, r.site, r.n) for r in await s.live_counts())
        connected = sorted((r.site, r.role, r.n) for r in await s.agents_connected(silent_after_ms=15_000))
        return live, connected, await s.batches_waiting()

    told.append(
        ("hello", await s.agent_hello(hi("sa-1", "cert_1")), await s.agent_hello(hi("sa-2", "cert_2")))
    )
    told.append(("replayed hello", await s.agent_hello(hi("sa-1", "cert_1", signed=5))))
    told.append(("lease", await s.renew_lease(SITE, "sa-1", ttl_ms=15_000),
                 await s.renew_lease(SITE, "sa-2", ttl_ms=15_000),
                 await s.renew_lease(SITE, "sa-1", ttl_ms=15_000)))  # fmt: skip
    told.append(("pick", await s.pick_site_agent(SITE, silent_after_ms=15_000, kind="node.inventory"),
                 await s.pick_site_agent(SITE, silent_after_ms=15_000, kind="power.setPower"),
                 await s.pick_site_agent("elsewhere", silent_after_ms=15_000, kind=None)))  # fmt: skip
    node = "node-n1"  # an agent id, the same in both stories
    await s.agent_hello(hi(node, "cert_n", role="node"))
    told.append(("agents", await agents()))
    told.append(("site agents after sa-1", await agents(role="site", after=(SITE, "sa-1"))))
    hb = await s.agent_heartbeat(node, next(at), "cert_n", None, silent_after_ms=30_000)
    told.append(("heartbeat", hb and (hb.site_id, hb.role)))
    replayed = await s.agent_heartbeat(node, 5, "cert_n", None, silent_after_ms=30_000)
    told.append(("heartbeat replayed", replayed))
    unknown = await s.agent_heartbeat("nobody", next(at), "cert_n", None, silent_after_ms=30_000)
    told.append(("heartbeat unknown", unknown))
    again = await s.agent_by_id(node)
    told.append(("by id", again and again.role, await s.agent_by_id("nobody")))

    # commands out with the agents: live, claimed, cancelled, checked, to republish
    now_ms = int(time.time() * 1000)

    async def insert(target: str, node_id: str) -> CommandRow:
        new = NewCommand(
            id=new_id("cmd"), node_id=node_id, site_id=SITE, tenant_id="root", key=new_id("cmd"),
            kind="node.inventory", destructive=False, target=target, payload=PAYLOAD, digest=DIGEST,
            batch_id=None, workflow_id=None, step=None, not_after_ms=now_ms + 3_600_000, may_dispatch=True,
        )  # fmt: skip
        row = await s.insert_command(new, silent_after_ms=15_000)
        assert row is not None
        return row

    held, cancelled, out = await insert("node", node), await insert("node", node), await insert("node", node)
    site_cmd = await insert("site", new_id("node"))
    told.append(("site command to", site_cmd.agent_id))
    for row in (held, cancelled):
        await s.ack(row.id, node, DIGEST, "ja", next(at), quorum=False)
    await s.cancel(cancelled.id, "operator")
    told.append(("cancelling", [r == cancelled.id for r in await s.cancelling(node)]))
    stop = await s.must_stop([held.id, cancelled.id, out.id, "cmd_unknown"], node)
    told.append(("must stop", [i == held.id for i in stop], len(stop)))
    told.append(("to republish", sorted(r.id == held.id for r in await s.agent_commands_to_republish(node))))
    told.append(("site of node", await s.site_of_node(node), await s.site_of_node(site_cmd.node_id),
                 await s.site_of_node(new_id("node"))))  # fmt: skip
    for label, approved in (("waiting", False), ("approved", True)):
        batch = NewBatch(
            id=new_id("batch"), tenant_id="root", kinds=["node.wipe"], nodes=[], workflow_id=None,
            workflow_ids=[], note=label, idempotency_key=None, document=b"doc", threshold=1,
            expires_at_ms=now_ms + 3_600_000,
        )  # fmt: skip
        await s.insert_batch(batch)
        await s.set_batch_approved(batch.id, approved)
    told.append(("counts", await counts()))

    # leaving, then a revoked certificate
    left = await s.agent_leave("sa-2", next(at), silent_after_ms=15_000)
    told.append(("leave", left and left.role, await s.agent_leave("sa-2", 5, silent_after_ms=15_000)))
    await s.release_lease(SITE, "sa-2")  # not its lease: nothing happens
    told.append(("connected", await agents(connected=True)))
    cut = await s.cut_off("cert_1", silent_after_ms=15_000)
    told.append(("cut off", [(a.id, a.site_id, a.role) for a in cut.agents],
                 [(r.id == site_cmd.id, r.state, r.reason, r.agent_id) for r in cut.reassigned]))  # fmt: skip
    told.append(("after cut off", await agents(role="site")))
    told.append(("revoked hello", await s.agent_hello(hi("sa-1", "cert_1")),
                 await s.agent_heartbeat("sa-1", next(at), "cert_1", None, silent_after_ms=30_000),
                 await s.renew_lease(SITE, "sa-1", ttl_ms=15_000)))  # fmt: skip
    await s.agent_hello(hi("sa-2", "cert_2"))
    told.append(("lease free", await s.renew_lease(SITE, "sa-2", ttl_ms=15_000)))
    await s.release_lease(SITE, "sa-2")
    told.append(("released", await agents(role="site")))
    told.append(("counts after", await counts()))
    return told


async def test_the_memory_store_keeps_agents_as_postgresql_does(pg: Harness) -> None:
    told = await told_alike(pg, presence)
    assert told["lease"] == (True, False, True)
    assert told["pick"] == ("sa-1", None, None)
    assert told["must stop"] == ([False, False, False], 3)
    assert told["cut off"] == ([("sa-1", SITE, "site")], [(True, "pending", "agent-revoked", None)])
    assert told["revoked hello"] == (False, None, False)
    assert told["counts"][0][2] == 1  # one batch waits for approval


async def heard_together(h: Harness) -> list[Any]:
    """Node agents' heartbeats held in memory and written at once (``agents_heard``), and every
    agent's cancelled commands read at once (``all_cancelling``): what each answered."""
    s = h.store
    told: list[Any] = []
    at = iter(range(10**6, 10**9, 10))

    def hi(agent: str, cert: str) -> AgentHello:
        return AgentHello(
            agent_id=agent, site_id=SITE, tenant_id="root", role="node", cert_id=cert, incarnation="i1",
            version="1.0", kinds=None, signed_at_ms=next(at), status=None,
        )  # fmt: skip

    def beat(
        agent: str, cert: str, *, age_s: float = 0, journal: str = "", signed: int | None = None
    ) -> Beat:
        return Beat(
            agent_id=agent, signed_at_ms=signed if signed is not None else next(at), cert_id=cert,
            status='{"drivers": []}', journal_id=journal, age_ms=age_s * 1000,
        )  # fmt: skip

    async def connected() -> list[tuple[str, bool, Any]]:
        rows = await s.list_agents(
            site_id=SITE, role="node", connected=None, silent_after_ms=15_000, limit=10, after=None
        )
        return [(r.id, r.connected, r.status) for r in rows if r.id.startswith("hb-")]

    for n in ("hb-1", "hb-2", "hb-3"):
        await s.agent_hello(hi(n, f"cert_{n}"))
    await h.age(40)  # every one silent
    told.append(("silent", await connected()))
    applied = await s.agents_heard(
        [beat("hb-1", "cert_hb-1", journal="j1"), beat("hb-2", "cert_hb-2", age_s=20, journal="j2"),
         beat("hb-nobody", "cert_x")],
        silent_after_ms=15_000,
    )  # fmt: skip
    told.append(("applied", sorted(applied)))
    # hb-1 heard now; hb-2 heard 20 s ago, which is what it shows (silent), not when written
    told.append(("heard", await connected()))
    replay = beat("hb-1", "cert_hb-1", signed=5)
    told.append(("replay", await s.agents_heard([replay], silent_after_ms=15_000)))
    told.append(("journal present", (await s.journal_seen("hb-1", "j1", present=False)).present))
    await h.age(14)
    told.append(("still heard", await connected()))
    await h.age(2)
    told.append(("silent again", await connected()))
    await s.cut_off("cert_hb-3", silent_after_ms=15_000)
    told.append(("revoked", await s.agents_heard([beat("hb-3", "cert_hb-3")], silent_after_ms=15_000)))
    now_ms = int(time.time() * 1000)
    new = NewCommand(
        id=new_id("cmd"), node_id="hb-1", site_id=SITE, tenant_id="root", key=new_id("cmd"),
        kind="node.inventory", destructive=False, target="node", payload=PAYLOAD, digest=DIGEST,
        batch_id=None, workflow_id=None, step=None, not_after_ms=now_ms + 3_600_000, may_dispatch=True,
    )  # fmt: skip
    row = await s.insert_command(new, silent_after_ms=15_000)
    assert row is not None
    await s.ack(row.id, "hb-1", DIGEST, "j1", next(at), quorum=False)
    await s.cancel(row.id, "operator")
    told.append(("cancelling", {a: [i == row.id for i in ids] for a, ids in (await s.all_cancelling()).items()
                                if a.startswith("hb-")}))  # fmt: skip
    return told


async def test_heartbeats_written_together_count_from_when_they_were_heard(pg: Harness) -> None:
    told = {what: said[0] for what, said in (await told_alike(pg, heard_together)).items()}
    assert told["silent"] == [("hb-1", False, None), ("hb-2", False, None), ("hb-3", False, None)]
    assert told["applied"] == ["hb-1", "hb-2"]
    assert [(a, c) for a, c, _ in told["heard"]] == [("hb-1", True), ("hb-2", False), ("hb-3", False)]
    assert told["heard"][0][2] is not None  # its status was written
    assert told["replay"] == []
    assert told["journal present"] is True
    assert [c for _, c, _ in told["still heard"]] == [True, False, False]
    assert [c for _, c, _ in told["silent again"]] == [False, False, False]
    assert told["revoked"] == []
    assert told["cancelling"] == {"hb-1": [True]}


async def node_agents(s: Store, prefix: str, count: int) -> list[str]:
    """``count`` node agents that said hello (``<prefix>-000`` …), certificate ``cert_<prefix>``."""
    agents = [f"{prefix}-{i:03d}" for i in range(count)]
    for n in agents:
        await s.agent_hello(
            AgentHello(agent_id=n, site_id=SITE, tenant_id="root", role="node", cert_id=f"cert_{prefix}",
                       incarnation="i", version="1", kinds=None, signed_at_ms=1, status=None)
        )  # fmt: skip
    return agents


def heartbeats(agents: list[str], signed: int) -> list[Beat]:
    """A heartbeat of each agent of ``node_agents`` in this order, each naming journal ``j-<agent>``."""
    return [Beat(agent_id=n, signed_at_ms=signed, cert_id=f"cert_{n.rpartition('-')[0]}", status=None,
                 journal_id=f"j-{n}", age_ms=0) for n in agents]  # fmt: skip


async def test_two_instances_writing_heartbeats_at_once_keep_each_agents_newest(
    pg: Harness,
) -> None:
    """Each command-queue instance writes the heartbeats it heard; two writes over the same agents
    at once (in opposite orders) both go through, and each agent keeps its newest heartbeat (the
    statement locks its rows in id order first, so such writes wait rather than deadlock)."""
    s = pg.store
    agents = await node_agents(s, "two", 60)

    def beats(order: list[str], signed: int) -> list[Beat]:
        return heartbeats(order, signed)

    for round_ in range(10):
        first, second = 100 + 2 * round_, 101 + 2 * round_
        one, two = await asyncio.gather(
            s.agents_heard(beats(agents, first), silent_after_ms=15_000),
            s.agents_heard(beats(agents[::-1], second), silent_after_ms=15_000),
        )
        # whichever wrote second applied only what was newer than the first's
        assert set(two) == set(agents)
        assert set(one) in (set(agents), set())
    rows = await s.list_agents(site_id=SITE, role="node", connected=True, silent_after_ms=15_000, limit=100,
                               after=None)  # fmt: skip
    assert {r.id for r in rows} >= set(agents)
    newest = await s.agents_heard(beats(agents, 119), silent_after_ms=15_000)
    assert newest == []  # 119 is the last round's second write: nothing older or equal applies


async def together(h: Harness) -> list[Any]:
    """Claims, progress, results and publication marks of several commands in one statement each
    (``GroupCommit``'s groups): each row answered as the one-row statement would have."""
    s = h.store
    node, other = new_id("node"), new_id("node")
    now_ms = int(time.time() * 1000)
    rows: dict[str, CommandRow] = {}
    for label in ("c1", "c2", "c3", "c4", "c5", "c6"):
        new = NewCommand(
            id=new_id("cmd"), node_id=node, site_id=SITE, tenant_id="root", key=f"g-{label}",
            kind="node.inventory", destructive=False, target="node", payload=PAYLOAD, digest=DIGEST,
            batch_id=None, workflow_id=None, step=None, not_after_ms=now_ms + 3_600_000, may_dispatch=True,
        )  # fmt: skip
        row = await s.insert_command(new, silent_after_ms=15_000)
        assert row is not None
        rows[label] = row
    names = {r.id: label for label, r in rows.items()} | {"cmd_unknown": "unknown"}
    told: list[Any] = []

    def claim(label: str, journal: str | None, *, agent: str = node, digest: bytes = DIGEST) -> Claim:
        ident = rows[label].id if label in rows else "cmd_unknown"
        return Claim(command_id=ident, agent_id=agent, digest=digest, journal=journal, signed_at_ms=10,
                     quorum=False)  # fmt: skip

    def row_of(r: CommandRow | None) -> Any:
        return r and (names[r.id], r.state, r.reason, r.progress, r.attested)

    first = await s.claim_many([
        claim("c1", "ja"), claim("c2", "ja", digest=b"x" * 32), claim("c3", "ja", agent=other),
        claim("c4", None), claim("c5", "jnew"), claim("unknown", "ja"),
    ])  # fmt: skip
    told.append(("claims", [row_of(a.row) for a in first], [a.journal is not None for a in first]))
    ja, jnew = first[0].journal, first[4].journal
    assert ja is not None
    assert jnew is not None
    told.append(("journals", ja.generation < jnew.generation, ja.present, first[1].journal == ja))
    again = await s.claim_many([claim("c1", "ja"), claim("c5", "jb")])
    told.append(("claims again", [row_of(a.row) for a in again]))
    jb = again[1].journal
    told.append(("journal jb", jb is not None and jb.generation > jnew.generation))
    said = await s.progress_many([
        Said(command_id=rows["c1"].id, agent_id=node, message="half"),
        Said(command_id=rows["c4"].id, agent_id=node, message=None),
        Said(command_id=rows["c2"].id, agent_id=node, message="not claimed"),
        Said(command_id=rows["c5"].id, agent_id=other, message="not its agent"),
    ])  # fmt: skip
    told.append(("progress", [p and (row_of(p.command), p.old_state) for p in said]))
    await s.cancel(rows["c4"].id, "operator")

    def report(label: str, status: str, journal: str = "", reason: str | None = None) -> Report:
        return Report(command_id=rows[label].id, agent_id=node, status=status, reason=reason, result=b"{}",
                      signature=None, attested=label == "c1", journal=journal)  # fmt: skip

    settled = await s.result_many([
        report("c1", "succeeded"), report("c4", "succeeded", journal="ja"), report("c2", "succeeded"),
        report("c5", "failed", reason="boom", journal="jnew"),
    ])  # fmt: skip
    told.append(("results", [row_of(r) for r in settled]))
    told.append(("results again", [row_of(r) for r in await s.result_many([report("c1", "failed")])]))
    await s.mark_published_many([
        Published(command_id=rows["c6"].id, agent_id=node, stream_seq=5),
        Published(command_id=rows["c1"].id, agent_id=node, stream_seq=6),
        Published(command_id=rows["c2"].id, agent_id=other, stream_seq=7),
    ])  # fmt: skip
    published = [await s.command_by_id(rows[label].id) for label in ("c6", "c1", "c2")]
    told.append(("published", [r and r.publishes for r in published]))
    return told


async def test_statements_over_many_rows_answer_as_each_row_alone(pg: Harness) -> None:
    told = await told_alike(pg, together)  # its *_many apply each row with the one-row operation
    assert told["claims"] == (
        [("c1", "acked", None, None, False), None, None, ("c4", "acked", None, None, False),
         ("c5", "acked", None, None, False), None],
        [True, True, True, False, True, True],
    )  # fmt: skip
    assert told["journals"] == (True, False, True)
    assert told["claims again"] == ([("c1", "acked", None, None, False), None],)
    assert told["progress"] == (
        [(("c1", "running", None, "half", False), "acked"), (("c4", "running", None, None, False), "acked"),
         None, None],
    )  # fmt: skip
    assert told["results"] == (
        [("c1", "succeeded", None, "half", True),
         ("c4", "cancelled", "operator", "the agent stopped: succeeded", False),
         None, ("c5", "failed", "boom", None, False)],
    )  # fmt: skip
    assert told["results again"] == ([None],)
    assert told["published"] == ([1, 0, 0],)


async def claimed_with_ids(h: Harness) -> list[Any]:
    """Claims that name the id their journal made (``Ack.claim_id``), alone and in groups: taken,
    they mark the command running; taken again only from the same journal with the same id."""
    s = h.store
    node = new_id("node")
    now_ms = int(time.time() * 1000)
    rows: dict[str, CommandRow] = {}
    b = new_id("batch")
    await s.insert_batch(NewBatch(
        id=b, tenant_id="root", kinds=["node.wipe"], nodes=[], workflow_id=None, workflow_ids=[], note=None,
        idempotency_key=None, document=b"doc", threshold=1, expires_at_ms=now_ms + 3_600_000,
    ))  # fmt: skip
    for label in ("c1", "c2", "c3", "w1"):
        new = NewCommand(
            id=new_id("cmd"), node_id=node, site_id=SITE, tenant_id="root", key=f"i-{label}",
            kind="node.inventory", destructive=label == "w1", target="node", payload=PAYLOAD, digest=DIGEST,
            batch_id=b if label == "w1" else None, workflow_id=None, step=None,
            not_after_ms=now_ms + 3_600_000, may_dispatch=True,
        )  # fmt: skip
        row = await s.insert_command(new, silent_after_ms=15_000)
        assert row is not None
        rows[label] = row
    names = {r.id: label for label, r in rows.items()}
    told: list[Any] = []

    def claim(label: str, journal: str | None, claim_id: str | None) -> Claim:
        return Claim(command_id=rows[label].id, agent_id=node, digest=DIGEST, journal=journal,
                     signed_at_ms=10, quorum=False, claim_id=claim_id)  # fmt: skip

    def row_of(r: CommandRow | None) -> Any:
        return r and (names[r.id], r.state, r.version)

    first = await s.claim_many([claim("c1", "ja", "k1"), claim("c2", "ja", None), claim("w1", "ja", "kw")])
    told.append(("claims", [row_of(a.row) for a in first]))
    again = await s.claim_many([claim("c1", "ja", "k1"), claim("c2", "ja", None)])
    told.append(("same journal, same id", [row_of(a.row) for a in again]))
    told.append(("another id", row_of(await s.ack(rows["c1"].id, node, DIGEST, "ja", 11, quorum=False,
                                                  claim_id="k2"))))  # fmt: skip
    told.append(("no id", row_of(await s.ack(rows["c1"].id, node, DIGEST, "ja", 12, quorum=False))))
    told.append(("another journal", row_of(await s.ack(rows["c1"].id, node, DIGEST, "jb", 13, quorum=False,
                                                      claim_id="k1"))))  # fmt: skip
    cs = await s.claim_state(rows["c1"].id)
    told.append(("claim state", cs and (cs.state, cs.claim_journal, cs.claim_id)))
    # an older agent's acked claim, claimed again by a newer one of the same journal with an id
    told.append(("acked, then with an id", row_of(await s.ack(rows["c2"].id, node, DIGEST, "ja", 14,
                                                             quorum=False, claim_id="k3"))))  # fmt: skip
    p = await s.progress(rows["c1"].id, node, "half")
    told.append(("progress", p and (row_of(p.command), p.old_state)))
    # a destructive command's batch withdrawn between its claim and the same claim again
    told.append(("back to pending, another id", row_of(await s.claim_back_to_pending(
        rows["w1"].id, node, "ja", "kx"))))  # fmt: skip
    back = await s.claim_back_to_pending(rows["w1"].id, node, "ja", "kw")
    told.append(("back to pending", row_of(back), back and back.agent_id == node))
    cs = await s.claim_state(rows["w1"].id)
    told.append(("its claim forgotten", cs and (cs.state, cs.claim_journal, cs.claim_id)))
    await s.ack(rows["c3"].id, node, DIGEST, "ja", 15, quorum=False, claim_id="k4")
    told.append(("rerun", row_of(await s.claim_rerun(rows["c3"].id, node, "ja"))))
    return told


async def test_claims_with_ids_answer_alike(pg: Harness) -> None:
    story = await told_alike(pg, claimed_with_ids)
    assert story["claims"] == ([("c1", "running", 1), ("c2", "acked", 1), ("w1", "running", 1)],)
    assert story["same journal, same id"] == ([("c1", "running", 1), ("c2", "acked", 1)],)
    assert story["another id"] == (None,)  # a journal restored from an older copy
    assert story["no id"] == (None,)
    assert story["another journal"] == (None,)
    assert story["claim state"] == (("running", "ja", "k1"),)
    assert story["acked, then with an id"] == (("c2", "running", 2),)
    assert story["back to pending"] == (("w1", "pending", 2), True)
    assert story["its claim forgotten"] == (("pending", None, None),)


async def inserted_together(h: Harness) -> list[Any]:
    """Enqueues in one statement (``insert_many``): a site command dispatched to the site's agent
    picked for its kind, one of a site with no agent (pending), a node command, one held (its
    batch), one whose (node, key) exists (none); the payload kept as sent, byte for byte."""
    s = h.store
    tag = secrets.token_hex(3)
    site_b, site_none = f"site-ins-{tag}", f"site-none-{tag}"
    agent = f"agent_ins_{tag}"
    await s.agent_hello(
        AgentHello(agent_id=agent, site_id=site_b, tenant_id="root", role="site", cert_id="cert_ins",
                   incarnation="i", version="1", kinds=["node.inventory"], signed_at_ms=1, status=None)
    )  # fmt: skip
    node = new_id("node")
    now_ms = int(time.time() * 1000)
    payload = '{"b": 1,  "a": [2, 3]}'

    def new(key: str, *, site: str = site_b, target: str = "site", may: bool = True) -> NewCommand:
        return NewCommand(
            id=new_id("cmd"), node_id=node, site_id=site, tenant_id="root", key=key, kind="node.inventory",
            destructive=False, target=target, payload=payload, digest=DIGEST, batch_id=None,
            workflow_id=None, step=None, not_after_ms=now_ms + 60_000, may_dispatch=may,
        )  # fmt: skip

    first = await s.insert_command(new("ins-taken"), silent_after_ms=15_000)
    assert first is not None
    news = [new("ins-site"), new("ins-none", site=site_none), new("ins-node", target="node"),
            new("ins-held", may=False), new("ins-taken")]  # fmt: skip
    rows = await s.insert_many(news, silent_after_ms=15_000)
    told: list[Any] = [
        [r and (r.id == n.id, r.state, r.agent_id == agent, r.agent_id == node, r.payload) for r, n in
         zip(rows, news, strict=True)]
    ]  # fmt: skip
    told.append([await s.command_by_key(node, n.key) == r for n, r in zip(news[:4], rows[:4], strict=True)])
    return told


async def test_enqueues_in_one_statement_answer_as_each_alone(pg: Harness) -> None:
    on_pg = await inserted_together(pg)
    assert await inserted_together(memory()) == on_pg
    payload = '{"b": 1,  "a": [2, 3]}'
    assert on_pg == [
        [(True, "dispatched", True, False, payload), (True, "pending", False, False, payload),
         (True, "dispatched", False, True, payload), (True, "pending", False, False, payload), None],
        [True, True, True, True],
    ]  # fmt: skip


async def test_a_group_with_a_row_postgresql_refuses_applies_the_others(pg: Harness) -> None:
    """A progress whose text PostgreSQL cannot store (a NUL character, which JSON can carry) fails
    its own event; the others of its group are applied."""
    s = pg.store
    node = new_id("node")
    now_ms = int(time.time() * 1000)
    ids = []
    for i in range(3):
        new = NewCommand(
            id=new_id("cmd"), node_id=node, site_id=SITE, tenant_id="root", key=f"nul-{i}",
            kind="node.inventory", destructive=False, target="node", payload=PAYLOAD, digest=DIGEST,
            batch_id=None, workflow_id=None, step=None, not_after_ms=now_ms + 3_600_000, may_dispatch=True,
        )  # fmt: skip
        row = await s.insert_command(new, silent_after_ms=15_000)
        assert row is not None
        ids.append(row.id)
    claims = [Claim(command_id=i, agent_id=node, digest=DIGEST, journal="ja", signed_at_ms=1, quorum=False)
              for i in ids]  # fmt: skip
    assert all(a.row is not None for a in await s.claim_many(claims))
    group: GroupCommit[Said, Any] = GroupCommit(
        s.progress_many, key=lambda p: p.command_id, row_by_row=row_may_be_at_fault
    )
    messages = ["one", "t\x00wo", "three"]
    said = [Said(command_id=i, agent_id=node, message=m) for i, m in zip(ids, messages, strict=True)]
    got = await asyncio.gather(*(group(p) for p in said), return_exceptions=True)
    assert isinstance(got[1], asyncpg.PostgresError)
    assert [g.command.progress for g in (got[0], got[2])] == ["one", "three"]  # type: ignore[union-attr]
    states = await s.command_states(ids)
    assert [states[i] for i in ids] == ["running", "acked", "running"]


async def quiet_agents(h: Harness) -> list[Any]:
    """Issue 25: a machine's agent with nothing to do heartbeats every ``cmdq.idle_heartbeat``
    (30 s) and says so; every silence rule counts it from that gap (three of them), and a leave
    or a revocation still ends its presence at once. What each step answered."""
    s = h.store
    told: list[Any] = []
    at = iter(range(10**6, 10**9, 10))

    def hi(agent: str, role: str = "node", gap_ms: int = 0) -> AgentHello:
        return AgentHello(
            agent_id=agent, site_id=SITE, tenant_id="root", role=role, cert_id=f"cert_{agent}",
            incarnation="i1", version="1.0", kinds=None, signed_at_ms=next(at), status=None, gap_ms=gap_ms,
        )  # fmt: skip

    def beat(agent: str, gap_ms: int) -> Beat:
        return Beat(agent_id=agent, signed_at_ms=next(at), cert_id=f"cert_{agent}", status=None,
                    journal_id=f"j-{agent}", age_ms=0, gap_ms=gap_ms)  # fmt: skip

    async def connected() -> dict[str, bool]:
        rows = await s.list_agents(
            site_id=SITE, role=None, connected=None, silent_after_ms=15_000, limit=10, after=None
        )
        shown = {r.id: r.connected for r in rows}
        listed = await s.list_agents(
            site_id=SITE, role=None, connected=True, silent_after_ms=15_000, limit=10, after=None
        )
        counted = sum(r.n for r in await s.agents_connected(silent_after_ms=15_000))
        assert sorted(r.id for r in listed) == sorted(a for a, c in shown.items() if c)
        assert counted == len(listed)
        return shown

    async def connected_at(agent: str) -> float:
        rows = await s.list_agents(
            site_id=SITE, role=None, connected=None, silent_after_ms=15_000, limit=10, after=None
        )
        return next(r.connected_at for r in rows if r.id == agent)

    for agent in ("idle", "busy", "peer", "leaver", "revoked"):
        await s.agent_hello(hi(agent))
    await s.agents_heard(
        [beat("idle", 30_000), beat("busy", 0), beat("peer", 30_000), beat("leaver", 30_000),
         beat("revoked", 30_000)],
        silent_after_ms=15_000,
    )  # fmt: skip
    await s.agent_leave("leaver", next(at), silent_after_ms=15_000)
    await s.cut_off("cert_revoked", silent_after_ms=15_000)
    told.append(("left and revoked", await connected()))
    await h.age(40)
    told.append(("40 s later", await connected()))
    since = await connected_at("idle")
    await s.agents_heard([beat("idle", 30_000), beat("peer", 30_000)], silent_after_ms=15_000)
    told.append(("same connection", await connected_at("idle") == since))
    # the idle one gets a command and claims it; its next heartbeat says 5 s (the usual: 0)
    now_ms = int(time.time() * 1000)
    new = NewCommand(
        id=new_id("cmd"), node_id="idle", site_id=SITE, tenant_id="root", key="k-idle",
        kind="node.inventory", destructive=False, target="node", payload=PAYLOAD, digest=DIGEST,
        batch_id=None, workflow_id=None, step=None, not_after_ms=now_ms + 3_600_000, may_dispatch=True,
    )  # fmt: skip
    row = await s.insert_command(new, silent_after_ms=15_000)
    assert row is not None
    await s.ack(row.id, "idle", DIGEST, "j-idle", next(at), quorum=False)
    await h.age(70)  # the claim and the idle one's heartbeat 70 s old: lost after 60 s? not yet
    await s.agents_heard([beat("peer", 30_000)], silent_after_ms=15_000)
    await h.age(1)
    lost = await s.fail_lost(lost_after_ms=60_000, silent_after_ms=15_000)
    told.append(("quiet 71 s of 90", [r.reason for r in lost], await connected()))
    await h.age(20)
    lost = await s.fail_lost(lost_after_ms=60_000, silent_after_ms=15_000)
    told.append(("quiet 91 s", [r.reason for r in lost], await connected()))
    await s.agents_heard([beat("busy", 0)], silent_after_ms=15_000)
    told.append(("back after a silence", await connected_at("busy") > since))
    return told


async def test_an_idle_agent_is_silent_after_three_of_the_gaps_it_announced(pg: Harness) -> None:
    told = await told_alike(pg, quiet_agents)
    everyone = {"idle": True, "busy": True, "peer": True, "leaver": False, "revoked": False}
    assert told["left and revoked"] == (everyone,)
    assert told["40 s later"] == ({**everyone, "busy": False},)  # past 15 s; the idle ones within 90
    assert told["same connection"] == (True,)
    # claimed while idle, then silent: lost only after three of its 30 s gaps (more than lost_after)
    assert told["quiet 71 s of 90"] == ([], {**everyone, "busy": False})
    assert told["quiet 91 s"] == (["agent-lost"], {**everyone, "busy": False, "idle": False})
    assert told["back after a silence"] == (True,)


async def test_claims_and_heartbeats_over_the_same_journals_at_once_wait_rather_than_deadlock(
    pg: Harness,
) -> None:
    """A batch of claims (``claim_many``) marks each named journal seen; a batch of heartbeats
    (``agents_heard``) marks each agent's journal present. Both take the journals' rows, and two
    instances run them at once over the same agents: each takes the rows in (agent, journal) order,
    so one waits for the other and none is rolled back for a deadlock. (When the claims took them
    in the order their join gave, PostgreSQL found a deadlock at 10,000 machines; here, about one a
    round.)"""
    s = pg.store
    agents = await node_agents(s, "cj", 600)

    def beats(signed: int, order: list[str]) -> list[Beat]:
        return heartbeats(order, signed)

    def claims(order: list[str]) -> list[Claim]:
        return [Claim(command_id=f"cmd_cj_{n}", agent_id=n, digest=DIGEST, journal=f"j-{n}", signed_at_ms=10,
                      quorum=False) for n in order]  # fmt: skip

    await s.agents_heard(beats(100, agents), silent_after_ms=15_000)  # every journal known
    for round_ in range(15):
        await pg.age(2.0)  # every journal's last_seen is old enough for a claim to move it
        one, two, odd, even = await asyncio.gather(
            s.claim_many(claims(agents)),
            s.claim_many(claims(agents[::-1])),
            s.agents_heard(beats(101 + round_, agents[1::2]), silent_after_ms=15_000),
            s.agents_heard(beats(101 + round_, agents[::2]), silent_after_ms=15_000),
        )
        for answers in (one, two):
            assert [a.row for a in answers] == [None] * len(agents)  # no such commands
            assert all(a.journal is not None and a.journal.present for a in answers)
        assert set(odd) | set(even) == set(agents)
