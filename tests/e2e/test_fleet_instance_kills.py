"""Many instances of every service under a rollout, one of each SIGKILLed mid-deploy (issue 25,
item 3, at small scale; ``bench/bench_fleet.py --kill-mid-deploy`` is the same at scale).

Two sites of four machines each on the lean simulation (every site's bcds tasks of one process),
three bc-engines, two bc-command-queues, two bc-pkis and two bc-secrets, every one its own OS
process on the real nats-server (a hub and a leaf per site) and PostgreSQL. Every machine is
inspected and commissioned, then deployed with the page's profile; once half the machines' BMCs
took their first command of the deploy, one instance of each service is SIGKILLed and nothing
restarts it. What is checked is what the hardware saw, not what the engine says: every machine
installed exactly once, its medium inserted and ejected once, its power changed as the profile
asks and no more, no disk write twice; and then in the engine and the queue: every deploy
workflow ``succeeded``, none still running, no command still live.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from better_compute.config import Settings
from better_compute.testing import until
from better_compute.testing.metal_sim.sites import SitesStack, sites_stack
from better_compute.wire.cmdq import LIVE_STATES

pytestmark = [pytest.mark.e2e, pytest.mark.long]

SITES = ["lab1", "lab2"]
MACHINES = 4
INSTANCES = {"bc-engine": 3, "bc-command-queue": 2, "bc-pki": 2, "bc-secrets": 2}
PROFILE = "ubuntu-24.04-autoinstall"
IMAGE = "ubuntu@24.04"
BMC_EVENTS = ("media.insert", "media.eject", "boot.device", "power.requested")
# One deploy of the page's profile at the simulated hardware: the medium in and out, the boot
# device set to the CD, the machine powered on (its commission left it off: the profile's
# "cycle" of a machine that is off is one power-on), the OS written and installed once.
DEPLOY_AT_THE_HARDWARE = {
    "boot.device:Cd": 1,
    "disk.write:vda:autoinstall": 1,
    "install:vda": 1,
    "media.eject:Cd": 1,
    "media.insert:Cd": 1,
    "power.requested:On": 1,
    "power:On": 1,
}
COUNTED = ("boot.device", "disk.write", "install", "media.insert", "media.eject", "power", "power.requested")


@pytest_asyncio.fixture(loop_scope="session")
async def stack(bc_settings: Settings, tmp_path: Path) -> AsyncIterator[SitesStack]:
    async with sites_stack(
        tmp_path / "sites", bc_settings, sites=SITES, machines=MACHINES, instances=INSTANCES, lean=True
    ) as st:
        try:
            yield st
        finally:
            for site in st.sites.values():
                for m in site.sim.machines:
                    print(
                        f"--- {site.site_id}/{m.name} ledger ---",
                        json.dumps(m.ledger.counts(), sort_keys=True),
                    )
            print(st.tails())


async def _ready(stack: SitesStack, site: str, index: int) -> None:
    fleet = stack.site(site)
    await fleet.verb("inspect", index)
    await fleet.reaches(index, "inspected", timeout=300)
    await fleet.verb("commission", index)
    await fleet.reaches(index, "ready", timeout=300)


def _past_first_bmc_command(stack: SitesStack, since: float) -> int:
    """How many machines' BMCs took a command since ``since``."""
    return sum(
        1
        for s in SITES
        for m in stack.site(s).sim.machines
        if any(e["event"] in BMC_EVENTS and e["t"] >= since for e in m.ledger.events())
    )


async def _every_machine_deployed(stack: SitesStack, *, timeout: float) -> None:
    """Wait until every machine is ``deployed`` (a deploy takes well under a minute here); a
    machine that failed, or still is not deployed at ``timeout``, fails the test with what
    ``bcx why`` would say of each machine left behind."""
    engine = stack.site(SITES[0]).engine
    nodes = {(s, i): stack.site(s).nodes[i] for s in SITES for i in range(MACHINES)}

    async def behind() -> dict[tuple[str, int], str]:
        out = {}
        for key, node_id in nodes.items():
            node = await engine.get_node(id=node_id)
            if node.state == "failed":
                raise AssertionError(f"{key} ({node_id}) failed: {node.state_reason}")
            if node.state != "deployed":
                out[key] = node.state
        return out

    async def all_deployed() -> bool:
        return not await behind()

    try:
        _: bool = await until(all_deployed, timeout=timeout, interval=0.5, what="every machine deployed")
    except AssertionError as exc:
        left = await behind()
        said = {key: (state, (await engine.why(id=nodes[key])).answer) for key, state in left.items()}
        raise AssertionError(f"{len(left)} machine(s) not deployed after {timeout:g} s: {said}") from exc


@pytest.mark.timeout(900)
async def test_one_instance_of_each_service_killed_mid_deploy_and_every_machine_installed_once(
    stack: SitesStack,
) -> None:
    await asyncio.gather(*(_ready(stack, s, i) for s in SITES for i in range(MACHINES)))
    since = time.time()
    runs = {}
    for s in SITES:
        for i in range(MACHINES):
            runs[(s, i)] = await stack.site(s).verb("deploy", i, image=IMAGE, profile=PROFILE)

    await until(
        lambda: _past_first_bmc_command(stack, since) >= len(SITES) * MACHINES // 2,
        timeout=300,
        interval=0.1,
        what="half the machines past their first BMC command",
    )
    killed = []
    for service in INSTANCES:
        victim = stack.processes.live(service)[0]
        victim.kill()  # SIGKILL, and nothing restarts it
        killed.append(victim.instance)
    print(
        f"killed {killed} with {_past_first_bmc_command(stack, since)} machines past their first BMC command"
    )

    await _every_machine_deployed(stack, timeout=300)

    # at the simulated hardware: each machine's deploy once, nothing else, nothing twice
    for s in SITES:
        for i in range(MACHINES):
            m = stack.site(s).machine(i)
            got = m.ledger.counts(since=since)
            print(f"{s}/{m.name} deploy at its hardware:", json.dumps(got, sort_keys=True))
            counted = {k: n for k, n in got.items() if k.split(":")[0] in COUNTED}
            assert counted == DEPLOY_AT_THE_HARDWARE, (s, i, got)
            assert m.ledger.repeated_writes() == {}, (s, i)
    # in the engine and the queue: every deploy succeeded, nothing left running or live
    for (s, i), run in runs.items():
        wf = await stack.site(s).engine.get_workflow(id=run.workflow_id)
        assert wf.state == "succeeded", (s, i, wf.state, [(st.action, st.state) for st in wf.steps or []])
    engine, cq = stack.site(SITES[0]).engine, stack.site(SITES[0]).cq
    assert (await engine.list_workflows(state="running")).workflows == []
    live = [c for state in sorted(LIVE_STATES) for c in (await cq.list_commands(state=state)).commands]  # type: ignore[arg-type]
    assert live == [], [(c.kind, c.state, c.node_id) for c in live]
