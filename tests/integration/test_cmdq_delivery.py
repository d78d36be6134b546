"""Delivery: PostgreSQL is the truth, the stream only delivers. A lost stream, a restarted
nats-server or a duplicate delivery delays work but never loses or repeats it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest

from bc_command_queue.config import CmdqConfig
from bc_command_queue.service import CommandQueueService
from better_compute.agent import Agent, Enrollment
from better_compute.agent.sim import join_agent, sim_handlers
from better_compute.clients.cmdq import CommandQueueClient
from better_compute.config import Settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id
from better_compute.crypto import sign_event
from better_compute.runtime.embedded import EmbeddedNats, nats_server_binary, spawn_detached, wait_port
from better_compute.service import ApiClient, connect
from better_compute.testing import ServiceProcesses
from better_compute.testing.agents import until
from better_compute.wire import Subjects, unwrap
from better_compute.wire.agent import Ack, CommandDelivery, Heartbeat, Hello, Result, payload_digest
from better_compute.wire.cmdq import EnqueueCommand

T = TypeVar("T")
FAST = CmdqConfig(heartbeat_ms=200, silent_after_ms=2_000, redeliver_after_ms=1_000, sweep_ms=100)


def restart_on_the_same_port(server: EmbeddedNats, *, wipe_jetstream: bool) -> None:
    """Stop the server and start it again on its port (clients reconnect to the same URL).

    ``EmbeddedNats.start`` would move to a new port while the old one is in TIME_WAIT; the
    server itself binds with SO_REUSEADDR, so it is started directly from its config.
    """
    port = int(server.url.rsplit(":", 1)[1])
    server.stop()
    if wipe_jetstream:
        shutil.rmtree(server.dir / "jetstream")
    pid = spawn_detached(
        [str(nats_server_binary()), "-c", str(server.dir / "nats.conf")], server.dir / "nats.log"
    )
    (server.dir / "server.json").write_text(json.dumps({"pid": pid, "port": port}))
    wait_port(port, timeout=15, pid=pid)


async def retrying(call: Callable[[], Awaitable[T]]) -> T:
    while True:
        try:
            return await call()
        except BcError as err:
            if err.code not in (ErrorCode.TIMEOUT, ErrorCode.UNAVAILABLE):
                raise


def executions(log: Path) -> list[str]:
    return log.read_text().split("\n")[:-1] if log.exists() else []


@contextlib.asynccontextmanager
async def running(agent: Agent) -> AsyncIterator[Agent]:
    await agent.start()
    task = asyncio.create_task(agent.run())
    try:
        await asyncio.wait_for(agent.ready.wait(), 20)
        yield agent
    finally:
        await agent.stop()
        await asyncio.wait_for(task, 10)


def make_agent(
    enrollment: Enrollment, tmp: Path, api: ApiClient, *, own_connection: str | None = None
) -> Agent:
    return Agent(
        enrollment=enrollment,
        handlers=sim_handlers(["node.inventory", "power.setPower"], exec_log=tmp / "exec.log"),
        journal=tmp / "journal.db",
        nc=None if own_connection else api.nc,
        nats_url=own_connection,
        subjects=api.subjects,
    )


async def test_a_duplicate_delivery_is_never_run_twice_even_after_a_restart(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> None:
    bc_processes.start("bc-pki")
    await bc_processes.wait_ready()
    cq = CommandQueueClient(bc_api)
    async with CommandQueueService(bc_settings, config=FAST) as svc:
        run = asyncio.create_task(svc.run())
        node = new_id("node")
        enrollment = await join_agent(bc_api, site_id="site-d", role="node", node_id=node)
        js = bc_api.nc.jetstream()
        subject = bc_api.subjects.site_cmd("site-d", node)
        async with running(make_agent(enrollment, tmp_path, bc_api)):
            view = await cq.enqueue(
                EnqueueCommand(node_id=node, site_id="site-d", kind="node.inventory", key="i", target="node")
            )
            await cq.wait(id=view.id, timeout=20)
            # the same delivery again (a republication after the duplicate window)
            copy = msgspec.json.encode(
                {"id": view.id, "kind": "node.inventory", "payload": {}, "nodeId": node, "siteId": "site-d",
                 "agentId": node, "key": "i", "notAfterMs": int(view.not_after * 1000)}
            )  # fmt: skip
            await js.publish(subject, copy)
            marker = await cq.enqueue(
                EnqueueCommand(node_id=node, site_id="site-d", kind="node.inventory", key="j", target="node")
            )
            await cq.wait(id=marker.id, timeout=20)
        # a new process of the same agent, same journal, and the copy once more
        await js.publish(subject, copy)
        async with running(make_agent(enrollment, tmp_path, bc_api)):
            last = await cq.enqueue(
                EnqueueCommand(node_id=node, site_id="site-d", kind="node.inventory", key="k", target="node")
            )
            await cq.wait(id=last.id, timeout=20)
        assert executions(tmp_path / "exec.log") == [
            f"{view.id} node.inventory",
            f"{marker.id} node.inventory",
            f"{last.id} node.inventory",
        ]
        svc.request_stop()
        await run


async def test_delivery_survives_a_nats_server_restart_that_lost_the_streams(
    bc_settings: Settings, tmp_path: Path
) -> None:
    server = EmbeddedNats(tmp_path / "own-nats")
    url = server.start()
    settings = msgspec.structs.replace(bc_settings, nats_url=url)
    procs = ServiceProcesses(settings, tmp_path)
    nc = await connect(url, name="bc-test")
    try:
        procs.start("bc-pki")
        await procs.wait_ready()
        api = ApiClient(nc, Subjects(root=settings.subject_root))
        cq = CommandQueueClient(api, timeout=3.0)
        async with CommandQueueService(settings, config=FAST) as svc:
            run = asyncio.create_task(svc.run())
            site_agent = await join_agent(api, site_id="site-n")
            node = new_id("node")
            bcd = await join_agent(api, site_id="site-n", role="node", node_id=node)
            site_dir = tmp_path / "site"
            site_dir.mkdir()
            async with running(make_agent(site_agent, site_dir, api, own_connection=url)):
                before = await cq.enqueue(
                    EnqueueCommand(
                        node_id=node,
                        site_id="site-n",
                        kind="power.setPower",
                        payload={"action": "on"},
                        key="a",
                    )
                )
                await cq.wait(id=before.id, timeout=20)
                # the node's bcd is away: its command waits in the stream…
                waiting = await cq.enqueue(
                    EnqueueCommand(
                        node_id=node, site_id="site-n", kind="node.inventory", key="inv", target="node"
                    )
                )
                assert waiting.state == "dispatched"
                # …and the server comes back without any stream at all
                restart_on_the_same_port(server, wipe_jetstream=True)
                # a request sent while the clients reconnect may be lost: enqueue is
                # find-before-create by key, so asking again is safe
                after = await retrying(
                    lambda: cq.enqueue(
                        EnqueueCommand(
                            node_id=node,
                            site_id="site-n",
                            kind="power.setPower",
                            payload={"action": "off"},
                            key="b",
                        )
                    )
                )
                assert (await cq.wait(id=after.id, timeout=60)).state == "succeeded"
                async with running(make_agent(bcd, tmp_path, api, own_connection=url)):
                    assert (await cq.wait(id=waiting.id, timeout=60)).state == "succeeded"
            assert executions(site_dir / "exec.log") == [
                f"{before.id} power.setPower",
                f"{after.id} power.setPower",
            ]
            assert executions(tmp_path / "exec.log") == [f"{waiting.id} node.inventory"]
            svc.request_stop()
            await run
    finally:
        await nc.close()
        procs.close()
        server.stop()


async def test_a_lost_agents_unfinished_command_fails_with_a_reason(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses
) -> None:
    bc_processes.start("bc-pki")
    await bc_processes.wait_ready()
    config = CmdqConfig(heartbeat_ms=200, silent_after_ms=500, lost_after_ms=1_000, sweep_ms=100)
    cq = CommandQueueClient(bc_api)
    async with CommandQueueService(bc_settings, config=config) as svc:
        run = asyncio.create_task(svc.run())
        node = new_id("node")
        enrollment = await join_agent(bc_api, site_id="site-l", role="node", node_id=node)
        site_agent = await join_agent(bc_api, site_id="site-l", role="site")

        async def send(kind: str, event: Any, who: Enrollment = enrollment) -> Any:
            subject = bc_api.subjects.agent_event("site-l", who.agent_id, kind)
            return unwrap(
                (await bc_api.nc.request(subject, sign_event(who.identity, kind, event), timeout=5)).data
            )

        def base(who: Enrollment = enrollment) -> dict[str, Any]:
            return {
                "site": "site-l",
                "agent": who.agent_id,
                "signer_id": who.identity.cert_id,
                "signed_at_ms": time.time_ns() // 1_000_000,
            }

        # the node's agent says hello, claims its command, then falls silent for good
        await send("hello", Hello(**base()))
        view = await cq.enqueue(
            EnqueueCommand(node_id=node, site_id="site-l", kind="node.inventory", key="inv", target="node")
        )
        claim = await send(
            "ack", Ack(**base(), command_id=view.id, digest=payload_digest("node.inventory", b"{}"))
        )
        assert claim["proceed"] is True
        # nothing of its site is heard (a site cut off from the hub looks the same): it is
        # unreachable, not lost, and its claimed command waits for it well past lost_after
        with pytest.raises(BcError) as waited:
            await cq.wait(id=view.id, timeout=3)
        assert waited.value.code is ErrorCode.TIMEOUT
        assert (await cq.get(id=view.id)).state == "acked"

        # its site is heard again (the site agent, from now on): the node's own silence counts
        # from then, and after lost_after of it the command fails, its outcome unknown
        async def heartbeats() -> None:
            await send("hello", Hello(**base(site_agent)), site_agent)
            while True:
                await asyncio.sleep(0.2)
                await send("heartbeat", Heartbeat(**base(site_agent)), site_agent)

        beating = asyncio.create_task(heartbeats())
        done = await cq.wait(id=view.id, timeout=20)
        assert (done.state, done.reason) == ("failed", "agent-lost")
        beating.cancel()
        # its result, should it ever come, changes nothing
        late = await send("result", Result(**base(), command_id=view.id, status="succeeded", result=b"{}"))
        assert late["recorded"] is False
        svc.request_stop()
        await run


async def test_a_command_refused_as_not_yours_still_runs_when_it_is_dispatched_to_that_agent_later(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> None:
    """An agent that claims a delivery of a command handed to another agent hears
    ``not-yours``: not now, but not for good. When the command comes to it later (the other
    agent fell silent), it runs it."""
    bc_processes.start("bc-pki")
    await bc_processes.wait_ready()
    # the other agent never beats: long enough a silence that only its leaving reassigns
    config = CmdqConfig(heartbeat_ms=200, silent_after_ms=3_000, redeliver_after_ms=1_000, sweep_ms=100)
    cq = CommandQueueClient(bc_api)
    async with CommandQueueService(bc_settings, config=config) as svc:
        run = asyncio.create_task(svc.run())
        site = "site-y"
        # the other agent: it says hello (it holds the boot lease) and never claims anything
        other = await join_agent(bc_api, site_id=site)

        async def send(kind: str, event: Any) -> Any:
            subject = bc_api.subjects.agent_event(site, other.agent_id, kind)
            data = sign_event(other.identity, kind, event)
            return unwrap((await bc_api.nc.request(subject, data, timeout=5)).data)

        def base() -> dict[str, Any]:
            now_ms = time.time_ns() // 1_000_000
            return {"site": site, "agent": other.agent_id, "signer_id": other.cert_id, "signed_at_ms": now_ms}

        assert (await send("hello", Hello(**base())))["bootLease"] is True
        enrollment = await join_agent(bc_api, site_id=site)
        async with running(make_agent(enrollment, tmp_path, bc_api)):
            view = await cq.enqueue(
                EnqueueCommand(
                    node_id=new_id("node"),
                    site_id=site,
                    kind="power.setPower",
                    payload={"action": "on"},
                    key="p",
                )
            )
            assert (view.state, view.agent_id) == ("dispatched", other.agent_id)
            # a copy of its delivery reaches our agent (as an old one does after a reassignment)
            payload = msgspec.Raw(msgspec.json.encode(view.payload, order="sorted"))
            copy = CommandDelivery(
                id=view.id, kind=view.kind, payload=payload,
                node_id=view.node_id, site_id=site, agent_id=enrollment.agent_id, key=view.key,
                not_after_ms=int(view.not_after * 1000),
            )  # fmt: skip
            js = bc_api.nc.jetstream()
            await js.publish(bc_api.subjects.site_cmd(site, enrollment.agent_id), msgspec.json.encode(copy))
            stream = bc_api.subjects.site_stream(site)

            async def handled() -> bool:
                info = await js.consumer_info(stream, enrollment.agent_id)
                return (
                    info.num_pending == 0 and info.num_ack_pending == 0 and info.delivered.consumer_seq >= 1
                )

            await asyncio.wait_for(until(handled), 10)
            # the other agent leaves: the command comes to ours, which runs it
            await send("heartbeat", Heartbeat(**base(), leaving=True))
            done = await cq.wait(id=view.id, timeout=15)
            assert (done.state, done.agent_id) == ("succeeded", enrollment.agent_id)
            assert executions(tmp_path / "exec.log") == [f"{view.id} power.setPower"]
        svc.request_stop()
        await run
