"""bc-command-queue on a real nats-server and PostgreSQL, with agents built on the agent SDK.

bc-pki runs as its own process (agents join through it and the queue checks their
certificates there); the command queue runs in this process so its sweeper can be fast.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec
import nats.js.errors
import pytest
import pytest_asyncio

from bc_command_queue.config import CmdqConfig
from bc_command_queue.service import CommandQueueService
from better_compute.agent import Agent, Command, Enrollment
from better_compute.agent.sim import join_agent, sim_handlers
from better_compute.clients.cmdq import CommandQueueClient
from better_compute.config import Settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id
from better_compute.provision import StepNotReady, await_command, site_agent_for
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, refused, until
from better_compute.wire.cmdq import CommandEvent, CommandView, EnqueueCommand

FAST = CmdqConfig(
    heartbeat_ms=200, silent_after_ms=1_500, lost_after_ms=60_000, redeliver_after_ms=1_000, sweep_ms=100
)
SITE = "site-a"


@dataclass
class Stack:
    api: ApiClient
    cq: CommandQueueClient
    svc: CommandQueueService
    tmp: Path
    agents: list[Agent] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def agent(
        self,
        handlers: dict[str, Callable[[Command], Awaitable[Any]]] | None = None,
        *,
        site_id: str = SITE,
        role: str = "site",
        node_id: str | None = None,
        enrollment: Enrollment | None = None,
        journal: Path | None = None,
        max_concurrency: int = 16,
    ) -> Agent:
        enrollment = enrollment or await join_agent(self.api, site_id=site_id, role=role, node_id=node_id)
        agent = Agent(
            enrollment=enrollment,
            handlers=handlers if handlers is not None else sim_handlers(["power.setPower", "node.wipe"]),
            journal=journal or self.tmp / f"journal-{len(self.agents)}.db",
            nc=self.api.nc,
            subjects=self.api.subjects,
            stop_grace=2.0,
            max_concurrency=max_concurrency,
        )
        await agent.start()
        self.agents.append(agent)
        self.tasks.append(asyncio.create_task(agent.run()))
        await asyncio.wait_for(agent.ready.wait(), 10)
        return agent

    async def stop_agent(self, agent: Agent) -> None:
        await agent.stop()
        index = self.agents.index(agent)
        await asyncio.wait_for(self.tasks[index], 10)

    def command(self, **kw: Any) -> EnqueueCommand:
        args: dict[str, Any] = {
            "node_id": new_id("node"),
            "site_id": SITE,
            "kind": "power.setPower",
            "payload": {"action": "on"},
            "key": "k",
        }
        args.update(kw)
        return EnqueueCommand(**args)


@pytest_asyncio.fixture(loop_scope="session")
async def stack(
    bc_settings: Settings,
    bc_api: ApiClient,
    bc_processes: ServiceProcesses,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> AsyncIterator[Stack]:
    """The queue with ``FAST`` timings; a test parametrizes ``stack`` indirectly to change some."""
    bc_processes.start("bc-pki")
    await bc_processes.wait_ready()
    config = replace(FAST, **getattr(request, "param", {}))
    async with CommandQueueService(bc_settings, config=config) as svc:
        run = asyncio.create_task(svc.run())
        s = Stack(api=bc_api, cq=CommandQueueClient(bc_api), svc=svc, tmp=tmp_path)
        try:
            yield s
        finally:
            for agent in s.agents:
                await agent.stop()
            for task in s.tasks:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(task, 5)
            svc.request_stop()
            await run


async def wait_state(cq: CommandQueueClient, command_id: str, *states: str) -> CommandView:
    """The command once it is in one of ``states`` (bounded by the test timeout)."""

    async def in_state() -> CommandView | None:
        view = await cq.get(id=command_id)
        return view if view.state in states else None

    return await until(in_state)


async def test_every_refusal_of_enqueue_has_its_code_and_path(stack: Stack) -> None:
    cq = stack.cq
    err = await refused(cq.enqueue(stack.command(kind="acme.unknown")))
    assert (err.code, err.path) == (ErrorCode.INVALID_CONFIG, "kind")
    err = await refused(cq.enqueue(stack.command(payload={"action": "explode"})))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "payload.action")
    err = await refused(cq.enqueue(stack.command(payload={"action": "on", "extra": 1})))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "payload.extra")
    err = await refused(cq.enqueue(stack.command(sends=["site.httpProxy"])))
    assert (err.code, err.path, err.reason) == (ErrorCode.INVALID_CONFIG, "kind", "undeclared-kind")
    err = await refused(cq.enqueue(stack.command(node_id="not-a-node")))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "nodeId")
    err = await refused(cq.enqueue(stack.command(site_id="site a")))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "siteId")
    err = await refused(cq.enqueue(stack.command(timeout_ms=5)))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "timeoutMs")
    err = await refused(stack.api.call("command-queue", "commands.enqueue", {"nodeId": new_id("node")}))
    assert err.code is ErrorCode.INVALID_INPUT
    assert err.path
    err = await refused(stack.api.call("command-queue", "commands.enqueue", b"[1,"))
    assert err.code is ErrorCode.INVALID_INPUT
    err = await refused(cq.get(id=new_id("cmd")))
    assert (err.code, err.path) == (ErrorCode.NOT_FOUND, "id")
    err = await refused(cq.get(id="cmd_nope"))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "id")
    err = await refused(stack.api.call("command-queue", "commands.cancel", {}))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "id")
    err = await refused(stack.api.call("command-queue", "commands.list", {"state": "sleeping"}))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "state")
    # with its kind declared, the same command goes in
    assert (await cq.enqueue(stack.command(sends=["power.setPower"]))).created


async def test_find_before_create_by_node_and_key_and_listing(stack: Stack) -> None:
    cq = stack.cq
    node, wf = new_id("node"), new_id("wf")
    first = await cq.enqueue(stack.command(node_id=node, key=f"wf:{wf}:0#1", workflow_id=wf, step=0))
    again = await cq.enqueue(stack.command(node_id=node, key=f"wf:{wf}:0#1", workflow_id=wf, step=0))
    assert first.created
    assert not again.created
    assert again.id == first.id
    err = await refused(
        cq.enqueue(stack.command(node_id=node, key=f"wf:{wf}:0#1", kind="media.eject", payload={}))
    )
    assert (err.code, err.path) == (ErrorCode.CONFLICT, "key")
    # another node may use the same key
    other = await cq.enqueue(stack.command(key=f"wf:{wf}:0#1", workflow_id=wf))
    assert other.id != first.id
    for i in range(3):
        await cq.enqueue(stack.command(node_id=node, key=f"media-{i}", kind="media.eject", payload={}))
    assert {c.id for c in (await cq.list_commands(workflow_id=wf)).commands} == {first.id, other.id}
    by_node = (await cq.list_commands(node_id=node)).commands
    assert len(by_node) == 4
    assert [c.id for c in by_node] == sorted((c.id for c in by_node), reverse=True)
    assert len((await cq.list_commands(node_id=node, kind="media.eject")).commands) == 3
    assert len((await cq.list_commands(node_id=node, state="pending")).commands) == 4
    assert (await cq.list_commands(node_id=node, state="succeeded")).commands == []
    page = await cq.list_commands(node_id=node, limit=3)
    assert page.next is not None
    rest = await cq.list_commands(node_id=node, limit=3, before=page.next)
    assert len(rest.commands) == 1
    assert rest.next is None
    assert (await cq.get(id=first.id)).payload == {"action": "on"}


async def test_an_agent_runs_commands_and_every_state_change_is_an_event(stack: Stack) -> None:
    cq = stack.cq
    events: list[CommandEvent] = []

    async def on_event(msg: Any) -> None:
        events.append(msgspec.json.decode(msg.data, type=CommandEvent))

    sub = await stack.api.nc.subscribe(stack.api.subjects.events_all("command"), cb=on_event)

    async def power(cmd: Command) -> bytes:
        await cmd.progress("halfway", percent=50.0)
        await wait_state(cq, cmd.id, "running")  # the queue saw it running before we finish
        return b"\x00raw-bytes\xff"

    async def wipe(cmd: Command) -> None:
        raise RuntimeError("disk on fire")

    async def media(cmd: Command) -> None:
        from better_compute.agent import CommandRejected

        raise CommandRejected("no virtual media on this BMC")

    await stack.agent({"power.setPower": power, "node.wipe": wipe, "media.eject": media})
    ok = await cq.enqueue(stack.command())
    assert ok.state == "dispatched"
    done = await cq.wait(id=ok.id, timeout=20)
    assert (done.state, done.result, done.attested) == ("succeeded", b"\x00raw-bytes\xff", False)
    assert done.progress == "halfway"
    failed = await cq.wait(
        id=(await cq.enqueue(stack.command(kind="media.eject", payload={}))).id, timeout=20
    )
    assert (failed.state, failed.reason) == ("rejected", "no virtual media on this BMC")

    def rejected_seen() -> bool:  # cq.wait read the row; its event may still be on the way
        return "rejected" in [e.state for e in events if e.id == failed.id]

    await until(rejected_seen, timeout=30, what="the rejected command's event")
    await stack.api.nc.flush()
    await sub.unsubscribe()
    # Each command's events come in the order of its states, its end the last word. A state
    # that reaches the queue's publisher after a later one (a claim's "running", its first
    # progress, and the end are published by two tasks) is dropped, never published after it.
    for command_id, end in ((ok.id, "succeeded"), (failed.id, "rejected")):
        told = [e.state for e in events if e.id == command_id]
        assert told[-1] == end, told
        assert told[:-1] == [s for s in ("dispatched", "acked", "running") if s in told], told


@pytest.mark.parametrize("stack", [{"consumer_inactive_ms": 1_000}], indirect=True)
async def test_an_agent_away_longer_than_its_consumer_lives_gets_its_command_when_back(stack: Stack) -> None:
    """nats-server deletes a consumer nobody pulled from for ``cmdq.consumer_inactive`` (a retired
    node's would stay for ever, up to the stream's consumer limit). An agent merely away that long
    loses nothing: its command waits in the stream, and its hello makes the consumer again."""
    node = new_id("node")
    enrollment = await join_agent(stack.api, site_id=SITE, role="node", node_id=node)
    journal = stack.tmp / "away.db"
    ran: list[str] = []

    async def wipe(cmd: Command) -> None:
        ran.append(cmd.id)

    agent = await stack.agent(
        {"node.wipe": wipe}, role="node", node_id=node, enrollment=enrollment, journal=journal
    )
    js = stack.api.nc.jetstream()
    stream = stack.api.subjects.site_stream(SITE)

    async def has_consumer() -> bool:
        try:
            await js.consumer_info(stream, node)
        except nats.js.errors.NotFoundError:
            return False
        return True

    assert await has_consumer()
    await stack.stop_agent(agent)
    view = await stack.cq.enqueue(stack.command(node_id=node, kind="node.wipe", payload={}, target="node"))
    assert view.state == "dispatched"

    async def consumer_gone() -> bool:
        return not await has_consumer()

    await until(consumer_gone, timeout=20, what="the away agent's consumer deleted")
    on_subject = stack.api.subjects.site_cmd(SITE, node)
    assert (await js.stream_info(stream, subjects_filter=on_subject)).state.messages == 1
    await stack.agent({"node.wipe": wipe}, role="node", node_id=node, enrollment=enrollment, journal=journal)
    assert await has_consumer()
    done = await stack.cq.wait(id=view.id, timeout=20)
    assert (done.state, ran) == ("succeeded", [view.id])


async def test_a_failing_handler_fails_the_command_with_its_reason(stack: Stack) -> None:
    async def wipe(cmd: Command) -> None:
        raise RuntimeError("disk on fire")

    node = new_id("node")
    await stack.agent({"node.wipe": wipe}, role="node", node_id=node)
    view = await stack.cq.enqueue(
        stack.command(node_id=node, kind="node.wipe", payload={}, target="node", key="wipe")
    )
    done = await stack.cq.wait(id=view.id, timeout=20)
    assert (done.state, done.reason) == ("failed", "RuntimeError: disk on fire")


async def test_pending_without_an_agent_expires_and_cancel_is_by_id_or_key_prefix(stack: Stack) -> None:
    cq = stack.cq
    lonely = await cq.enqueue(stack.command(site_id="site-nobody", timeout_ms=1_000))
    assert lonely.state == "pending"
    expired = await cq.wait(id=lonely.id, timeout=20)
    assert (expired.state, expired.reason) == ("expired", "not-dispatched")

    node, wf = new_id("node"), new_id("wf")
    keys = [f"wf:{wf}:2#1", f"wf:{wf}:2#1:boot", f"wf:{wf}:2#10", f"wf:{wf}:21#1"]
    views = {k: await cq.enqueue(stack.command(site_id="site-nobody", node_id=node, key=k)) for k in keys}
    cancelled = await cq.cancel(node_id=node, key_prefix=f"wf:{wf}:2#1", reason="attempt 2 starts")
    assert sorted(cancelled) == sorted([views[keys[0]].id, views[keys[1]].id])
    got = await cq.get(id=views[keys[1]].id)
    assert (got.state, got.reason) == ("cancelled", "attempt 2 starts")
    assert (await cq.get(id=views[keys[2]].id)).state == "pending"
    assert await cq.cancel(id=views[keys[2]].id) == [views[keys[2]].id]
    assert await cq.cancel(id=views[keys[2]].id) == []  # settled: nothing left to cancel
    err = await refused(cq.cancel(id=new_id("cmd")))
    assert err.code is ErrorCode.NOT_FOUND
    # the whole step, every attempt
    assert await cq.cancel(node_id=node, key_prefix=f"wf:{wf}:21") == [views[keys[3]].id]


async def test_a_command_cancelled_while_waiting_in_the_stream_is_never_run(stack: Stack) -> None:
    ran: list[str] = []
    release = asyncio.Event()

    async def power(cmd: Command) -> None:
        ran.append(cmd.id)
        await release.wait()

    agent = await stack.agent({"power.setPower": power}, max_concurrency=1)
    busy = await stack.cq.enqueue(stack.command())
    await wait_state(stack.cq, busy.id, "running")
    queued = await stack.cq.enqueue(stack.command())
    assert queued.state == "dispatched"  # in the agent's stream, not pulled yet
    assert await stack.cq.cancel(id=queued.id) == [queued.id]
    release.set()
    await stack.cq.wait(id=busy.id, timeout=20)
    assert agent.journal is not None
    journal = agent.journal
    # pulled, claimed, refused
    entry = await until(lambda: (e := journal.get(queued.id)) is not None and e.state == "refused" and e)
    assert entry.reason == "cancelled"
    assert ran == [busy.id]
    assert (await stack.cq.get(id=queued.id)).state == "cancelled"


async def test_site_agent_for_prefers_the_boot_lease_holder(stack: Stack) -> None:
    cq = stack.cq
    assert await cq.site_agent(site_id="site-b") is None
    first = await stack.agent(site_id="site-b")
    second = await stack.agent(site_id="site-b")
    node_agent = await stack.agent(site_id="site-b", role="node", node_id=new_id("node"))
    assert first.boot_lease
    assert not second.boot_lease
    assert await cq.site_agent(site_id="site-b") == first.agent_id
    listed = {a.id: a for a in await cq.agents(site_id="site-b")}
    assert set(listed) == {first.agent_id, second.agent_id, node_agent.agent_id}
    assert listed[first.agent_id].boot_lease
    assert listed[first.agent_id].connected
    assert listed[node_agent.agent_id].role == "node"
    # site commands go to the lease holder
    view = await cq.enqueue(stack.command(site_id="site-b"))
    assert view.agent_id == first.agent_id
    # the holder leaves: the other takes the lease at its next heartbeat
    await stack.stop_agent(first)
    await until(lambda: second.boot_lease)
    assert await cq.site_agent(site_id="site-b") == second.agent_id
    listed = {a.id: a for a in await cq.agents(site_id="site-b")}
    assert not listed[first.agent_id].connected
    assert [a.id for a in await cq.agents(site_id="site-b", connected=False)] == [first.agent_id]
    # by node: the site its own agent joined in
    assert await cq.site_agent(node_id=node_agent.agent_id) == second.agent_id


async def test_a_node_signed_result_is_attested_and_a_site_agents_is_not(stack: Stack) -> None:
    node = new_id("node")
    bcd = await stack.agent(role="node", node_id=node)
    assert bcd.agent_id == node
    await stack.agent()
    wipe = await stack.cq.enqueue(
        stack.command(node_id=node, kind="node.wipe", payload={"mode": "quick"}, target="node", key="w")
    )
    done = await stack.cq.wait(id=wipe.id, timeout=20)
    assert (done.state, done.attested, done.agent_id) == ("succeeded", True, node)
    power = await stack.cq.wait(id=(await stack.cq.enqueue(stack.command(node_id=node))).id, timeout=20)
    assert (power.state, power.attested) == ("succeeded", False)


async def test_live_with_ref_answers_for_the_agent_and_the_step_only(stack: Stack) -> None:
    node, wf = new_id("node"), new_id("wf")
    ref = "sec_" + new_id("sec").split("_")[1]
    # the node's bcd never connected: the command waits in its stream, addressed to it
    view = await stack.cq.enqueue(
        stack.command(
            node_id=node,
            kind="node.imageWrite",
            target="node",
            key=f"wf:{wf}:3#1:write",
            payload={
                "url": "https://img.example/os.raw",
                "sha256": "a" * 64,
                "userDataRef": {"secretRef": ref},
            },
        )
    )
    assert view.state == "dispatched"
    assert view.payload["userDataRef"] == ref
    live = await stack.cq.live_with_ref(agent_id=node, ref=ref, key_prefix=f"wf:{wf}:3")
    assert (live.live, live.command_id) == (True, view.id)
    assert not (await stack.cq.live_with_ref(agent_id=node, ref=ref, key_prefix=f"wf:{wf}:31")).live
    assert not (await stack.cq.live_with_ref(agent_id=new_id("node"), ref=ref, key_prefix=f"wf:{wf}:3")).live
    other = "sec_" + new_id("sec").split("_")[1]
    assert not (await stack.cq.live_with_ref(agent_id=node, ref=other, key_prefix=f"wf:{wf}:3")).live
    await stack.cq.cancel(id=view.id)
    assert not (await stack.cq.live_with_ref(agent_id=node, ref=ref, key_prefix=f"wf:{wf}:3")).live


@dataclass
class _Node:
    id: str
    site_id: str
    tenant_id: str = "root"


@dataclass
class _Commands:
    """The engine's ``ctx.commands`` over the real command queue (what the engine does)."""

    cq: CommandQueueClient
    sends: list[str] | None = None

    async def enqueue(self, command: EnqueueCommand) -> CommandView:
        return await self.cq.enqueue(msgspec.structs.replace(command, sends=self.sends))

    async def site_agent_for(self, node_id: str) -> str | None:
        return await self.cq.site_agent(node_id=node_id)


@dataclass
class _Ctx:
    node: _Node
    commands: _Commands
    workflow_id: str = field(default_factory=lambda: new_id("wf"))
    step: int = 1
    attempt: int = 1
    batch_id: str | None = None


async def test_await_command_waits_then_returns_or_fails_as_the_reference_says(stack: Stack) -> None:
    ctx = _Ctx(node=_Node(id=new_id("node"), site_id="site-c"), commands=_Commands(stack.cq))
    assert await site_agent_for(ctx, ctx.node.id) is None
    with pytest.raises(StepNotReady) as wait:
        await await_command(
            ctx, node_id=ctx.node.id, kind="power.setPower", payload={"action": "cycle"}, key="pc"
        )
    assert wait.value.retry_after_ms == 2000
    [pending] = (await stack.cq.list_commands(node_id=ctx.node.id)).commands
    assert pending.key == f"wf:{ctx.workflow_id}:1#1:pc"
    assert pending.workflow_id == ctx.workflow_id
    agent = await stack.agent(site_id="site-c")
    assert await site_agent_for(ctx, ctx.node.id) == agent.agent_id
    await stack.cq.wait(id=pending.id, timeout=20)
    done = await await_command(
        ctx, node_id=ctx.node.id, kind="power.setPower", payload={"action": "cycle"}, key="pc"
    )
    assert done["command_id"] == pending.id
    assert msgspec.json.decode(done["result"])["ok"] is True
    assert done["attested"] is False
    # a failed command is DRIVER_ERROR with its state and reason
    # (in a site with no agent, so nothing can run it before the cancel)
    failing = _Ctx(node=_Node(id=new_id("node"), site_id="site-none"), commands=ctx.commands, attempt=2)
    with pytest.raises(StepNotReady):
        await await_command(
            failing,
            node_id=failing.node.id,
            kind="power.setPower",
            payload={"action": "on"},
            timeout_ms=60_000,
        )
    [mine] = (await stack.cq.list_commands(node_id=failing.node.id, kind="power.setPower", limit=1)).commands
    await stack.cq.cancel(id=mine.id, reason="operator said no")
    err = await refused(
        await_command(failing, node_id=failing.node.id, kind="power.setPower", payload={"action": "on"})
    )
    assert err.code is ErrorCode.DRIVER_ERROR
    assert (err.details["state"], err.details["reason"]) == ("cancelled", "operator said no")
    # a step that declared what it sends may send nothing else
    declared = _Ctx(node=ctx.node, commands=_Commands(stack.cq, sends=["media.eject"]))
    err = await refused(
        await_command(declared, node_id=ctx.node.id, kind="power.setPower", payload={"action": "on"})
    )
    assert (err.code, err.reason) == (ErrorCode.INVALID_CONFIG, "undeclared-kind")


async def test_finished_commands_older_than_the_retention_are_purged(stack: Stack) -> None:
    old_done = await stack.cq.enqueue(stack.command(key="old-done"))
    old_live = await stack.cq.enqueue(stack.command(key="old-live", site_id="site-nobody"))
    recent_done = await stack.cq.enqueue(stack.command(key="recent-done"))
    for cmd in (old_done, recent_done):
        await stack.cq.cancel(id=cmd.id, reason="done with it")
    db = stack.svc.db
    assert db is not None
    await db.execute(
        "UPDATE commands SET updated_at = now() - interval '40 days' WHERE id = ANY($1::text[])",
        [old_done.id, old_live.id],
    )
    assert await stack.svc.purge() == 1
    with pytest.raises(BcError) as e:
        await stack.cq.get(id=old_done.id)
    assert e.value.code is ErrorCode.NOT_FOUND
    assert (await stack.cq.get(id=old_live.id)).state == "pending"  # never purged while live
    assert (await stack.cq.get(id=recent_done.id)).state == "cancelled"
