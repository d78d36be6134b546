"""Many instances of every service under a rollout, one of each SIGKILLed mid-deploy (issue 25,
item 3, at small scale; ``bench/bench_fleet.py --kill-mid-deploy`` is the same at scale).

Two sites of four machines each on the lean simulation (every site's bcds tasks of one process),
three bc-engines, two bc-command-queues, two bc-pkis and two bc-secrets, every one its own OS
process on the real nats-server (a hub and a leaf per site) and PostgreSQL. Every machine is
inspected and commissioned, then deployed with the page's profile; once half the machines' BMCs
took their first command of the deploy, one instance of each service is SIGKILLed and nothing
restarts it. bc-pki gets one more kill, where it hurts: two more instances start before the
deploy with the kill point ``pki.after-join`` armed between them, both first ones are SIGKILLed at
the halfway mark, and the first installed OS to join kills the bc-pki that answers it after its
commit (token spent, certificate stored, no answer); that machine's bcd asks again and the other
instance answers it. What is checked is what the hardware saw, not what the engine says: every machine
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
from better_compute.service.killpoints import marker_name
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
    stack: SitesStack, tmp_path: Path
) -> None:
    await asyncio.gather(*(_ready(stack, s, i) for s in SITES for i in range(MACHINES)))
    markers = tmp_path / "kill-markers"
    markers.mkdir()
    saved = dict(stack.processes.extra_env)
    stack.processes.extra_env.update(BC_KILL_AT="pki.after-join@1", BC_KILL_MARKER_DIR=str(markers))
    armed = [stack.processes.start("bc-pki") for _ in range(2)]
    stack.processes.extra_env.clear()
    stack.processes.extra_env.update(saved)
    await stack.processes.wait_ready(timeout=120)
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
        for victim in stack.processes.live(service)[: 2 if service == "bc-pki" else 1]:
            victim.kill()  # SIGKILL, and nothing restarts it
            killed.append(victim.instance)
    print(
        f"killed {killed} with {_past_first_bmc_command(stack, since)} machines past their first BMC command"
    )

    await _every_machine_deployed(stack, timeout=300)
    # a bc-pki died between a join's commit and its answer, and the other one is still there
    assert (markers / marker_name("pki.after-join")).exists()
    assert [p.alive() for p in armed].count(True) == 1

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

    # every installed OS's bcd joined and runs (a join lost with its bc-pki left a machine
    # "deployed" whose agent never came: the engine saw the certificate, the machine had none)
    def installed_bcds_run() -> bool:
        for s in SITES:
            for m in stack.site(s).sim.machines:
                assert m.ledger.count("bcd.join-failed") == 0, (s, m.name, m.ledger.events("bcd.join-failed"))
        return all(
            any(e["t"] >= since for e in m.ledger.events("bcd.started", mode="installed"))
            for s in SITES
            for m in stack.site(s).sim.machines
        )

    await until(installed_bcds_run, timeout=120, interval=0.5, what="every installed OS's bcd running")

    # and the commands that follow a deploy (the host section's node.converge) reach them:
    # nothing stays live
    async def live() -> list[tuple[str, str, str | None]]:
        found = [c for state in sorted(LIVE_STATES) for c in (await cq.list_commands(state=state)).commands]  # type: ignore[arg-type]
        return [(c.kind, c.state, c.node_id) for c in found]

    async def none_live() -> bool:
        return not await live()

    try:
        _: bool = await until(none_live, timeout=120, interval=0.5, what="no command live")
    except AssertionError as exc:
        raise AssertionError(f"commands still live: {await live()}") from exc
