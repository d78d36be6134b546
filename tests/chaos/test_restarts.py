"""Processes killed and restarted while workflows run: under the same name, within the lease TTL."""

from __future__ import annotations

import signal

import asyncpg

from better_compute.clients import EngineClient
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, until
from better_compute.testing.workflows import wait_workflows
from chaos_stack import Stack
from engine_stack import sim_bmc


async def _profile(api: ApiClient, pid: str, steps: list[dict[str, object]]) -> None:
    doc = {"id": pid, "version": 1, "target": "metal", "role": "host", "steps": steps}
    await EngineClient(api).create_profile(document=doc)


async def test_engine_restarted_under_its_name_within_the_lease_ttl_takes_its_shards_back(
    procs: ServiceProcesses, bc_api: ApiClient, db: asyncpg.Connection
) -> None:
    first = procs.start("bc-engine")
    await procs.wait_ready()
    await _profile(
        bc_api,
        "gate",
        [{"use": "test.noop"}, {"use": "test.waitFlag", "with": {"flag": "go"}}, {"use": "test.sideEffect"}],
    )
    ids = [(await EngineClient(bc_api).start_workflow(profile_id="gate")).id for _ in range(10)]

    async def all_waiting() -> bool:
        n = await db.fetchval(
            "SELECT count(*) FROM engine.workflow_steps WHERE idx = 1 AND state = 'running'"
        )
        return bool(n == 10)

    await until(all_waiting)
    first.kill()
    procs.restart(first)  # what systemd does (RestartSec=2s): same --instance, long before the TTL
    await procs.wait_ready()
    await db.execute("INSERT INTO public.plg_test_flags VALUES ('go')")
    done = await wait_workflows(bc_api, ids, timeout=30)
    assert [d.state for d in done] == ["succeeded"] * 10
    assert await db.fetchval("SELECT count(*) FROM public.plg_test_effects") == 10
    owners = await db.fetch("SELECT DISTINCT owner FROM engine.shard_leases WHERE expires_at > now()")
    assert len(owners) == 1
    assert owners[0]["owner"].startswith(f"{first.instance}#")
    assert await db.fetchval("SELECT count(*) FROM engine.members WHERE expires_at > now()") == 1


async def test_a_paused_earlier_life_of_the_same_name_never_settles(
    procs: ServiceProcesses, bc_api: ApiClient, db: asyncpg.Connection
) -> None:
    old = procs.start("bc-engine")
    await procs.wait_ready()
    await _profile(bc_api, "held", [{"use": "test.sideEffect", "with": {"holdMs": 5000}}])
    wf = (await EngineClient(bc_api).start_workflow(profile_id="held")).id

    async def runs(n: int) -> bool:
        return bool(await db.fetchval("SELECT count(*) FROM public.plg_test_runs") == n)

    await until(lambda: runs(1))
    old.signal(signal.SIGSTOP)  # paused in the middle of the step, before its settle
    try:
        procs.restart(old)  # the supervisor thinks it died and starts it again under its name
        await until(lambda: runs(2))  # the new life took the shards over and runs the step again
    finally:
        old.signal(signal.SIGCONT)
    # The old life's hold ends first; its settle must be fenced off, not land.
    await until(lambda: "FencedError" in old.output())
    step = await db.fetchrow("SELECT state, attempt FROM engine.workflow_steps WHERE workflow_id = $1", wf)
    assert (step["state"], step["attempt"]) == ("running", 1)
    [done] = await wait_workflows(bc_api, [wf], timeout=30)
    assert done.state == "succeeded"
    assert await db.fetchval("SELECT count(*) FROM public.plg_test_effects") == 1
    # the older life stepped aside for good: it holds no shard and counts as no member
    assert await db.fetchval("SELECT count(*) FROM engine.members WHERE expires_at > now()") == 1
    assert old.alive()


# -- the acceptance test: every process killed and restarted while workflows run ---------------

WAVE = 4  # workflows started before each kill, so every kill lands in the middle of some
STEPS: list[dict[str, object]] = [
    {"use": "test.sideEffect"},
    {"use": "test.power", "on": "site", "timeout": "10m", "with": {"action": "on"}},
    {"use": "test.sideEffect"},
    {"use": "test.power", "on": "site", "timeout": "10m", "with": {"action": "off"}},
    {"use": "test.sideEffect"},
]


async def test_kill_and_restart_each_process_while_workflows_run(stack: Stack) -> None:
    procs = stack.procs
    running = {s: procs.start(s) for s in ("bc-pki", "bc-command-queue", "bc-secrets", "bc-engine")}
    await procs.wait_ready()
    sim, _agent = await stack.agent("lab", "--delay", "power.setPower=700")
    await stack.profile("restarts", STEPS)
    ids: list[str] = []

    async def wave() -> None:
        """Start a few workflows and return once the agent runs one of their commands."""
        ran = len(sim.executions())
        for _ in range(WAVE):
            node = await EngineClient(stack.api).create_node(site_id="lab", bmc=sim_bmc())
            wf = await EngineClient(stack.api).start_workflow(profile_id="restarts", node_id=node.id)
            ids.append(wf.id)
        await until(lambda: len(sim.executions()) > ran)

    def kill_and_restart(service: str) -> None:
        running[service].kill()
        running[service] = procs.restart(running[service])  # same instance name, at once

    for service in ("bc-engine", "bc-command-queue", "bc-pki", "bc-secrets"):
        await wave()
        kill_and_restart(service)
        await procs.wait_ready()

    # nats-server crashes; bc-pki crashes too and starts while NATS is still away
    await wave()
    stack.servers.kill_nats()
    kill_and_restart("bc-pki")
    await until(lambda: "waiting_for_dependency" in running["bc-pki"].output())
    stack.servers.start_nats()
    await procs.wait_ready()

    # PostgreSQL crashes; bc-command-queue crashes too and starts while PostgreSQL is still away
    await wave()
    stack.servers.kill_pg()
    kill_and_restart("bc-command-queue")
    await until(lambda: "waiting_for_dependency" in running["bc-command-queue"].output())
    stack.servers.start_pg()
    await procs.wait_ready()

    done = await stack.finished(ids)
    assert [d.state for d in done] == ["succeeded"] * len(ids), [d.error for d in done]
    db = await stack.db()
    try:
        effects = await db.fetchval("SELECT count(*) FROM public.plg_test_effects")
    finally:
        await db.close()
    assert effects == 3 * len(ids)  # each control-plane side effect happened once
    runs = [line.split()[0] for line in sim.executions()]
    assert len(runs) == 2 * len(ids)
    assert len(set(runs)) == len(runs)  # no command ran twice at the agent
    assert all(p.alive() for p in running.values())
    assert sim.proc is not None
    assert sim.proc.poll() is None
