"""bc-command-queue, bc-pki and agents each as their own OS process.

Agents are the SDK's simulated agent (``python -m better_compute.agent.sim``); each appends
every execution to its own log, so a test counts how often a command really ran.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest_asyncio

from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.pki import PkiClient
from better_compute.config import Settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id
from better_compute.service import ApiClient, discover
from better_compute.testing import ServiceProcesses, until
from better_compute.testing.agents import SimAgent, start_sim_agent
from better_compute.wire.cmdq import TERMINAL_STATES, CommandView, EnqueueCommand

T = TypeVar("T")
FAST_ENV = {
    "BC_CMDQ_HEARTBEAT": "200ms",
    "BC_CMDQ_SILENT_AFTER": "1500ms",
    "BC_CMDQ_LOST_AFTER": "60000ms",
    "BC_CMDQ_REDELIVER_AFTER": "1000ms",
    "BC_CMDQ_SWEEP": "100ms",
}


@dataclass
class Cluster:
    api: ApiClient
    cq: CommandQueueClient
    pki: PkiClient
    procs: ServiceProcesses
    settings: Settings
    tmp: Path
    agents: list[SimAgent] = field(default_factory=list)

    async def agent(self, *, site_id: str, args: list[str] | None = None) -> tuple[SimAgent, str]:
        """Start a site agent process; returns it and its agent id once it is connected."""
        sim, agent_id = await start_sim_agent(
            self.settings, self.tmp / f"agent-{len(self.agents)}", site_id=site_id, pki=self.pki,
            cq=self.cq, args=args,
        )  # fmt: skip
        self.agents.append(sim)
        return sim, agent_id


@pytest_asyncio.fixture(loop_scope="session")
async def cluster(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path,
    agents_closed: list[SimAgent],
) -> AsyncIterator[Cluster]:  # fmt: skip
    bc_processes.extra_env.update(FAST_ENV)
    bc_processes.start("bc-pki")
    bc_processes.start("bc-command-queue")
    bc_processes.start("bc-command-queue")
    await bc_processes.wait_ready()
    cluster = Cluster(
        api=bc_api,
        cq=CommandQueueClient(bc_api, timeout=3.0),
        pki=PkiClient(bc_api),
        procs=bc_processes,
        settings=bc_settings,
        tmp=tmp_path,
        agents=agents_closed,
    )
    yield cluster


async def retrying(call: Callable[[], Awaitable[T]]) -> T:
    """Ask again while no instance answers: every call here is safe to repeat."""
    while True:
        try:
            return await call()
        except BcError as err:
            if err.code not in (ErrorCode.TIMEOUT, ErrorCode.UNAVAILABLE):
                raise


async def settled(cq: CommandQueueClient, command_id: str) -> CommandView:
    async def finished() -> CommandView | None:
        view = await retrying(lambda: cq.get(id=command_id))
        return view if view.state in TERMINAL_STATES else None

    return await until(finished)


async def state_is(cq: CommandQueueClient, command_id: str, state: str) -> bool:
    return (await cq.get(id=command_id)).state == state


async def connected(cq: CommandQueueClient, site_id: str, agent_id: str, want: bool) -> bool:
    return any(a.connected == want for a in await cq.agents(site_id=site_id) if a.id == agent_id)


async def site_agent_is(cq: CommandQueueClient, site_id: str, agent_id: str) -> bool:
    return await cq.site_agent(site_id=site_id) == agent_id


def power(site_id: str, key: str, action: str = "cycle") -> EnqueueCommand:
    return EnqueueCommand(
        node_id=new_id("node"), site_id=site_id, kind="power.setPower", payload={"action": action}, key=key
    )


async def test_two_command_queues_serve_at_once_and_losing_one_loses_nothing(cluster: Cluster) -> None:
    cq = cluster.cq
    sim, _agent = await cluster.agent(site_id="site-e")
    first = await asyncio.gather(*(cq.enqueue(power("site-e", f"a{i}")) for i in range(30)))
    stats = await discover(cluster.api.nc, root=cluster.settings.subject_root)
    served = {
        d["metadata"]["instance"]: sum(e.get("num_requests", 0) for e in d["endpoints"])
        for d in stats
        if d["name"] == "bc-command-queue"
    }
    assert len(served) == 2
    assert all(n > 0 for n in served.values()), served
    # one instance dies hard while commands are in flight; the other carries on
    doomed = next(p for p in cluster.procs.procs if p.service == "bc-command-queue")
    # an enqueue lost with the instance is asked again with the same (node, key)
    batch = [power("site-e", f"b{i}") for i in range(30)]
    more = [asyncio.create_task(retrying(lambda c=c: cq.enqueue(c))) for c in batch]
    await until(lambda: sum(t.done() for t in more) >= 5)
    doomed.kill()
    second = await asyncio.gather(*more)
    assert len({v.id for v in second}) == 30  # a retried enqueue found what the first made
    views = [await settled(cq, v.id) for v in [*first, *second]]
    assert {v.state for v in views} == {"succeeded"}
    ran = sim.executions()
    assert sorted(ran) == sorted(f"{v.id} power.setPower" for v in views)  # each exactly once


async def test_an_agent_killed_mid_command_never_runs_it_twice(cluster: Cluster) -> None:
    cq = cluster.cq
    # dies while the handler runs
    during, _ = await cluster.agent(site_id="site-k", args=["--crash", "power.setPower=started"])
    interrupted = await cq.enqueue(power("site-k", "k1"))
    assert await during.wait_exit() == -signal.SIGKILL
    # its claim went through; its "running" may or may not have left before it died
    assert (await cq.get(id=interrupted.id)).state in ("acked", "running")
    during.start()  # same enrollment and journal
    view = await settled(cq, interrupted.id)
    assert (view.state, view.reason) == ("failed", "interrupted: the agent stopped while the command ran")
    after = await settled(cq, (await cq.enqueue(power("site-k", "k2"))).id)
    assert after.state == "succeeded"
    assert during.executions() == [f"{interrupted.id} power.setPower", f"{after.id} power.setPower"]

    # dies after the journal recorded the result, before it was reported
    late, _ = await cluster.agent(site_id="site-l", args=["--crash", "media.eject=executed"])
    unreported = await cq.enqueue(
        EnqueueCommand(node_id=new_id("node"), site_id="site-l", kind="media.eject", payload={}, key="l1")
    )
    assert await late.wait_exit() == -signal.SIGKILL
    late.start()
    view = await settled(cq, unreported.id)
    assert view.state == "succeeded"
    assert view.result is not None
    assert late.executions() == [f"{unreported.id} media.eject"]


async def test_an_agent_that_goes_silent_mid_command_and_returns_finishes_it(cluster: Cluster) -> None:
    cq = cluster.cq
    quiet, quiet_id = await cluster.agent(site_id="site-s", args=["--delay", "power.setPower=1500"])
    spare, spare_id = await cluster.agent(site_id="site-s")
    assert await cq.site_agent(site_id="site-s") == quiet_id  # the boot-lease holder
    busy = await cq.enqueue(power("site-s", "s1"))
    assert busy.agent_id == quiet_id
    await until(lambda: state_is(cq, busy.id, "running"))
    quiet.signal(signal.SIGSTOP)  # no network, no heartbeats: it looks gone
    await until(lambda: connected(cq, "site-s", quiet_id, False))
    # meanwhile a new command goes to the agent still there
    await until(lambda: site_agent_is(cq, "site-s", spare_id))
    other = await cq.enqueue(power("site-s", "s2"))
    assert (await settled(cq, other.id)).agent_id == spare_id
    assert (await cq.get(id=busy.id)).state == "running"  # destructive or not, never re-sent
    quiet.signal(signal.SIGCONT)
    done = await settled(cq, busy.id)
    assert (done.state, done.agent_id) == ("succeeded", quiet_id)
    assert quiet.executions() == [f"{busy.id} power.setPower"]
    assert spare.executions() == [f"{other.id} power.setPower"]
    await until(lambda: connected(cq, "site-s", quiet_id, True))
