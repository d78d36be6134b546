"""A site cut off from the hub in the middle of a rollout (issue 25, item 4).

Every site has its own NATS leaf node (``better_compute.testing.leaves``: a hub with JetStream and
a leaf per site, as deploy/nats lays them out), its own metal simulator, site agent and machines;
the services run on the hub. Each leaf runs JetStream in a domain named after its site and holds
the site's streams (``cmdq.site_domain = "{site}"``): its command stream, and the stream where
its agents store their results, which the command queue reads across the leaf link. While every
machine deploys, one site's leaf link is cut (the TCP proxy between leaf and hub drops its
connections and refuses new ones) once that site's agent holds a command, for
``BC_SITE_CUT_SECONDS`` (5 minutes by default, longer than the command queue's ``lost_after`` of
2 minutes). What an operator would see:

* the cut site's agent finishes the command it held (its BMC applied it during the cut), its
  result waits on the site's leaf (in the leaf's results stream, while the command queue still
  has the command running) and arrives after the link returns;
* the engine fails nothing and sends nothing twice: every workflow succeeds with each step's
  first attempt, each command once;
* the other sites deploy meanwhile (their times printed next to the cut);
* ``bcx why`` names the site as unreachable since the cut, for each of its machines;
* at the simulated disks and BMCs: every machine installed once, media in and out once, power
  as on a machine never cut, no write twice.

Short variant while developing: ``BC_SITE_CUT_SECONDS=20 BC_SITE_CUT_SITES=2`` (the command
queue's ``lost_after`` then shrinks with the cut, so the cut still outlasts it).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import nats.js.errors
import pytest
import pytest_asyncio

from better_compute.config import Settings
from better_compute.testing import bcx, until
from better_compute.testing.metal_sim.sites import SitesStack, sites_stack
from better_compute.wire import Subjects
from better_compute.wire.cmdq import LIVE_STATES

pytestmark = [pytest.mark.e2e, pytest.mark.long]

CUT_SECONDS = float(os.environ.get("BC_SITE_CUT_SECONDS", "300"))
SITES = [f"lab{n}" for n in range(1, int(os.environ.get("BC_SITE_CUT_SITES", "3")) + 1)]
MACHINES = int(os.environ.get("BC_SITE_CUT_MACHINES", "2"))
CUT = SITES[-1]
PROFILE = "ubuntu-24.04-autoinstall"
IMAGE = "ubuntu@24.04"
DEPLOY_STEPS = [
    "autoinstall.renderIso", "media.insert", "management.setBootDevice", "power.setPower",
    "wait.agentJoined", "media.eject",
]  # fmt: skip
# The product's lost_after (2 min) is shorter than the 5-minute cut; a short cut gets a shorter one.
LOST_AFTER_S = 120.0 if CUT_SECONDS >= 240 else max(CUT_SECONDS / 4, 1.0)


@pytest_asyncio.fixture(loop_scope="session")
async def stack(bc_settings: Settings, tmp_path: Path) -> AsyncIterator[SitesStack]:
    env = {"BC_CMDQ_SILENT_AFTER": "2s", "BC_CMDQ_LOST_AFTER": f"{LOST_AFTER_S:g}s"}
    # the cut site's BMC takes 2 s per power change: its agent holds the command when cut
    async with sites_stack(
        tmp_path / "sites",
        bc_settings,
        sites=SITES,
        machines=MACHINES,
        power_delay={CUT: (2.0, 2.0)},
        env=env,
        leaf_domains=True,
    ) as st:
        try:
            yield st
        finally:
            for site in st.sites.values():
                for m in site.sim.machines:
                    print(f"--- {m.name} ledger ---", json.dumps(m.ledger.counts(), sort_keys=True))
            print(st.tails())


async def _ready(stack: SitesStack, site: str, index: int) -> None:
    fleet = stack.site(site)
    await fleet.verb("inspect", index)
    await fleet.reaches(index, "inspected", timeout=240)
    await fleet.verb("commission", index)
    await fleet.reaches(index, "ready", timeout=240)


async def _on_leaf(stack: SitesStack, site: str) -> tuple[int, int]:
    """What the site's leaf holds in its own JetStream: messages in its command stream and in
    its results stream (asked on the leaf, so it answers while the site is cut off)."""
    subjects = Subjects(stack.settings.subject_root)
    nc = await nats.connect(stack.leaves.url(site))
    try:
        js = nc.jetstream(timeout=5.0)
        cmd = await js.stream_info(subjects.site_stream(site))
        results = await js.stream_info(subjects.site_results_stream(site))
        return cmd.state.messages, results.state.messages
    finally:
        await nc.close()


async def _stream_on_hub(stack: SitesStack, site: str) -> bool:
    nc = await nats.connect(stack.leaves.hub_url)
    try:
        await nc.jetstream(timeout=5.0).stream_info(Subjects(stack.settings.subject_root).site_stream(site))
    except nats.js.errors.NotFoundError:
        return False
    finally:
        await nc.close()
    return True


def _held_power_change(stack: SitesStack, since: float) -> bool:
    """Whether the cut site's BMC has a power change asked since ``since`` and not yet applied:
    its agent is in the middle of that command."""
    for m in stack.site(CUT).sim.machines:
        asked = [e for e in m.ledger.events("power.requested") if e["t"] > since]
        if len(asked) > len([e for e in m.ledger.events("power") if e["t"] > since]):
            return True
    return False


@pytest.mark.timeout(CUT_SECONDS + 900)
async def test_a_site_cut_off_mid_rollout_loses_nothing_and_runs_nothing_twice(
    stack: SitesStack, tmp_path: Path
) -> None:
    await asyncio.gather(*(_ready(stack, s, i) for s in SITES for i in range(MACHINES)))
    # every site's streams are on its leaf, none on the hub
    for s in SITES:
        await _on_leaf(stack, s)
        assert not await _stream_on_hub(stack, s), s
    before = {
        (s, i): stack.site(s).machine(i).ledger.counts() for s in SITES for i in range(MACHINES)
    }  # fmt: skip

    t0, rollout_wall = time.monotonic(), time.time()
    runs = {}
    for s in SITES:
        for i in range(MACHINES):
            runs[(s, i)] = await stack.site(s).verb("deploy", i, image=IMAGE, profile=PROFILE)
    await until(
        lambda: _held_power_change(stack, rollout_wall),
        timeout=120,
        interval=0.05,
        what=f"{CUT}'s agent holds a command",
    )
    gate = stack.leaves.gate(CUT)
    gate.cut(CUT_SECONDS + 3600)
    cut_at, cut_wall = time.monotonic(), time.time()
    _, stored_at_cut = await _on_leaf(stack, CUT)
    print(f"{CUT} cut off {cut_at - t0:.1f} s into the rollout, for {CUT_SECONDS:g} s")

    done: dict[tuple[str, int], float] = {}

    async def deployed(s: str, i: int) -> None:
        await stack.site(s).reaches(i, "deployed", timeout=CUT_SECONDS + 600)
        done[(s, i)] = time.monotonic() - t0

    others = [asyncio.create_task(deployed(s, i)) for s in SITES if s != CUT for i in range(MACHINES)]

    # while cut: the operator is told the site is unreachable, for each of its machines
    for node_id in stack.site(CUT).nodes.values():

        async def told(node_id: str = node_id) -> str | None:
            out = await bcx(stack.settings, "why", node_id)
            return out.stdout if f"site {CUT} unreachable since" in out.stdout else None

        said = await until(told, timeout=60, interval=0.5, what=f"bcx why names {CUT} unreachable")
        assert gate.is_cut
        print(f"bcx why {node_id}:", said.strip())

    # the agent finished the command it held: the BMC applied the power change during the cut
    applied = [
        e for m in stack.site(CUT).sim.machines for e in m.ledger.events("power") if e["t"] > cut_wall
    ]  # fmt: skip
    assert applied, "the cut site's BMC applied nothing its agent held"

    await asyncio.sleep(max(0.0, cut_at + CUT_SECONDS - time.monotonic()))  # the cut's length
    assert gate.is_cut
    # what the BMC applied is still running for the command-queue: its result waits on the leaf
    _, stored = await _on_leaf(stack, CUT)
    print(f"{CUT}'s leaf holds {stored} results the hub has not seen")
    assert stored > stored_at_cut, "no result waits in the cut site's leaf stream"
    held = [
        c for i in range(MACHINES)
        for c in (await stack.site(CUT).cq.list_commands(workflow_id=runs[(CUT, i)].workflow_id)).commands
        if c.kind == "power.setPower" and c.state in ("acked", "running")
    ]  # fmt: skip
    assert held, "no result of the cut site waits"
    gate.heal()
    healed_at = time.monotonic() - t0
    print(f"{CUT} back {healed_at:.1f} s into the rollout")
    await asyncio.gather(*others)
    await asyncio.gather(*(deployed(CUT, i) for i in range(MACHINES)))
    for (s, i), took in sorted(done.items(), key=lambda kv: kv[1]):
        print(f"{s} machine {i} deployed {took:.1f} s into the rollout")

    for (s, i), run in runs.items():
        fleet = stack.site(s)
        wf = await fleet.engine.get_workflow(id=run.workflow_id)
        assert wf.state == "succeeded", (s, i, wf.state)
        steps = [(st.action, st.state, st.attempt) for st in wf.steps]  # type: ignore[union-attr]
        assert steps == [(a, "succeeded", 1) for a in DEPLOY_STEPS], (s, i, steps)
        sent = (await fleet.cq.list_commands(workflow_id=run.workflow_id, limit=100)).commands
        assert sorted((c.kind, c.state) for c in sent) == [
            ("management.setBootDevice", "succeeded"), ("media.eject", "succeeded"),
            ("media.insert", "succeeded"), ("power.setPower", "succeeded"),
        ], (s, i)  # fmt: skip
        assert not [c for c in sent if c.state in LIVE_STATES]
        m = fleet.machine(i)
        after = m.ledger.counts()
        delta = {k: after.get(k, 0) - before[(s, i)].get(k, 0) for k in after}
        delta = {k: v for k, v in delta.items() if v}
        print(f"{s} machine {i} deploy at its hardware:", json.dumps(delta, sort_keys=True))
        assert delta.get("disk.write:vda:autoinstall") == 1, delta
        assert delta.get("install:vda") == 1, delta
        assert delta.get("media.insert:Cd") == 1, delta
        assert delta.get("media.eject:Cd") == 1, delta
        assert m.ledger.repeated_writes() == {}

    # the leaf's results were all read: nothing waits there any more
    async def drained() -> bool:
        return (await _on_leaf(stack, CUT))[1] == 0

    await until(drained, timeout=60, interval=0.5, what=f"{CUT}'s leaf results read by the command queue")
    for c in held:  # arrived after the link came back, and counted once
        assert (await stack.site(CUT).cq.get(id=c.id)).state == "succeeded", c.id
    # power at the BMC: the cut site's machines saw what a machine never cut saw
    reference = stack.site(SITES[0]).machine(0)
    ref = {k: v for k, v in reference.ledger.counts().items() if k.startswith("power")}
    for m in stack.site(CUT).sim.machines:
        got = {k: v for k, v in m.ledger.counts().items() if k.startswith("power")}
        assert got == ref, (m.name, got, ref)
    machines = [stack.site(s).machine(i) for s in SITES for i in range(MACHINES)]
    installs = sum(m.ledger.count("install") for m in machines)
    twice = sum(len(m.ledger.repeated_writes()) for m in machines)
    print(
        f"site cut: {len(SITES)} sites x {MACHINES} machines, {CUT} cut {CUT_SECONDS:g} s (lost_after"
        f" {LOST_AFTER_S:g} s); {len(held)} commands held at {CUT} through the cut, {stored} results"
        f" stored on its leaf meanwhile; at the hardware:"
        f" {installs} installs of {len(machines)} machines, lost {len(machines) - installs}, disk writes"
        f" repeated {twice}"
    )
