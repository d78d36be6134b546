"""PostgreSQL and nats-server outages, short and long, while workflows run: every service rides
them out (same process, same pid), every workflow finishes, nothing runs twice."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from typing import Any

import pytest

from better_compute.clients import EngineClient
from better_compute.core.errors import BcError
from better_compute.testing import until
from better_compute.testing.agents import SimAgent
from chaos_stack import Stack
from engine_stack import sim_bmc

SERVICES = ("bc-pki", "bc-command-queue", "bc-secrets", "bc-engine")
# control-plane side effects (counted in plg_test_effects) and site commands (counted at the agent)
STEPS: list[dict[str, Any]] = [
    {"use": "test.sideEffect"},
    {"use": "test.waitFlag", "with": {"flag": "go"}},
    {"use": "test.power", "on": "site", "timeout": "10m", "with": {"action": "on"}},
    {"use": "test.sideEffect"},
    {"use": "test.power", "on": "site", "timeout": "10m", "with": {"action": "off"}},
    {"use": "test.sideEffect"},
]
WORKFLOWS = 10


async def outage(stop: Callable[[], None], start: Callable[[], None], seconds: float) -> None:
    stop()
    await asyncio.sleep(seconds)  # the length of the fault under test, not a wait for a condition
    start()


async def start_workflows(stack: Stack) -> tuple[SimAgent, list[str], dict[str, int]]:
    for service in SERVICES:
        stack.procs.start(service)
    await stack.procs.wait_ready()
    sim, _agent = await stack.agent("lab", "--delay", "power.setPower=300")
    await stack.profile("busy", STEPS)
    ids = []
    for _ in range(WORKFLOWS):
        node = await EngineClient(stack.api).create_node(site_id="lab", bmc=sim_bmc())
        wf = await EngineClient(stack.api).start_workflow(profile_id="busy", node_id=node.id)
        ids.append(wf.id)
    db = await stack.db()
    try:

        async def all_waiting() -> bool:
            n = await db.fetchval(
                "SELECT count(*) FROM engine.workflow_steps WHERE idx = 1 AND state = 'running'"
            )
            return bool(n == WORKFLOWS)

        await until(all_waiting)
        await db.execute("INSERT INTO public.plg_test_flags VALUES ('go')")
    finally:
        await db.close()
    await until(lambda: len(sim.executions()) >= 1)  # commands are flowing
    return sim, ids, stack.pids()


async def check_all_done_once(stack: Stack, sim: SimAgent, ids: list[str], pids: dict[str, int]) -> None:
    done = await stack.finished(ids)
    assert [d.state for d in done] == ["succeeded"] * WORKFLOWS, [d.error for d in done]
    db = await stack.db()
    try:
        assert await db.fetchval("SELECT count(*) FROM public.plg_test_effects") == 3 * WORKFLOWS
    finally:
        await db.close()
    runs = [line.split()[0] for line in sim.executions()]
    assert len(runs) == 2 * WORKFLOWS
    assert len(set(runs)) == len(runs)  # no command ran twice at the agent
    assert stack.pids() == pids  # every service is the process it was: none exited
    assert sim.proc is not None
    assert sim.proc.poll() is None


async def run_once_up(stack: Stack, profile_id: str, node_id: str | None = None) -> Any:
    """One workflow of ``profile_id`` (on ``node_id``, else a new node), started as soon as the
    services answer again, once it finished."""

    async def started() -> str | None:
        try:
            engine = EngineClient(stack.api, timeout=2.0)
            node = node_id or (await engine.create_node(site_id="lab", bmc=sim_bmc())).id
            wf = await engine.start_workflow(profile_id=profile_id, node_id=node)
        except BcError:
            return None  # the services are still reconnecting
        return str(wf.id)

    [done] = await stack.finished([await until(started)])
    return done


async def test_two_second_outages_of_postgres_then_nats(stack: Stack) -> None:
    sim, ids, pids = await start_workflows(stack)
    await outage(stack.servers.stop_pg, stack.servers.start_pg, 2.0)
    ran = len(sim.executions())
    await until(lambda: len(sim.executions()) > ran)  # work goes on before the next fault
    await outage(stack.servers.stop_nats, stack.servers.start_nats, 2.0)
    await check_all_done_once(stack, sim, ids, pids)


@pytest.mark.long
@pytest.mark.timeout(300)
async def test_sixty_second_outages_of_postgres_and_nats_overlapping(stack: Stack) -> None:
    # PostgreSQL away for 60 s, NATS for 60 s, overlapping by 30 s: the services see the store
    # gone, then both, then the bus gone; leases lapse and must be taken again after.
    sim, ids, pids = await start_workflows(stack)
    stack.servers.stop_pg()
    await asyncio.sleep(30.0)  # the fault's length, as above
    stack.servers.stop_nats()
    await asyncio.sleep(30.0)
    stack.servers.start_pg()
    await asyncio.sleep(30.0)
    stack.servers.start_nats()
    await check_all_done_once(stack, sim, ids, pids)


async def test_an_agent_that_starts_while_nats_is_down_waits_and_then_serves(stack: Stack) -> None:
    for service in SERVICES:
        stack.procs.start(service)
    await stack.procs.wait_ready()
    sim, _agent = await stack.agent("lab")  # enrolled while NATS is up
    sim.signal(signal.SIGTERM)
    assert await sim.wait_exit() == 0
    stack.servers.stop_nats()
    sim.start()  # the same enrollment, no NATS to talk to
    await until(lambda: "nats_unreachable" in sim.output())
    assert sim.proc is not None
    assert sim.proc.poll() is None  # waiting, not gone
    stack.servers.start_nats()

    await stack.profile("one", [{"use": "test.power", "on": "site", "with": {"action": "on"}}])

    done = await run_once_up(stack, "one")
    assert done.state == "succeeded", done.error
    assert done.steps[0].result["commandId"] in sim.executions()[0]


async def test_an_idle_agent_takes_commands_at_once_after_nats_restarts(stack: Stack) -> None:
    # The agent's pull waits up to its fetch timeout for a command; a restarted server forgets
    # the waiting pull, so the reconnect must cut it short. With a pull of 600 s the command
    # below reaches the agent only if it does (the wait below gives up long before).
    for service in SERVICES:
        stack.procs.start(service)
    await stack.procs.wait_ready()
    sim, _agent = await stack.agent("lab", "--fetch-timeout", "600")
    await stack.profile("one", [{"use": "test.power", "on": "site", "with": {"action": "on"}}])
    engine = EngineClient(stack.api, timeout=5.0)
    node = await engine.create_node(site_id="lab", bmc=sim_bmc())
    [first] = await stack.finished([(await engine.start_workflow(profile_id="one", node_id=node.id)).id])
    assert first.state == "succeeded", first.error  # served before the restart, then idle
    stack.servers.stop_nats()
    stack.servers.start_nats()

    done = await run_once_up(stack, "one", node.id)
    assert done.state == "succeeded", done.error
    assert len(sim.executions()) == 2
