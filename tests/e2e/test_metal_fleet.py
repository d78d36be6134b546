"""Machines through their lives on the metal simulator, through every real process.

bc-engine (the fleet app: metal with a bcd ramdisk and the page's ``ubuntu-24.04-autoinstall``),
bc-command-queue, bc-pki, bc-secrets, bc-site-agent with its real Redfish driver against the
simulator's sushy-emulator, and the ``bcd --simulate`` processes the simulator boots: the
ramdisk's (which joins with the token its iPXE entry carried) and the installed OS's (which joins
with the token the autoinstall document carried, re-keying the same node, and converges the host
section). What is checked is what an operator would see: the node's state, the commands sent,
node-signed results, the host section applied on the machine, and the simulated hardware's own
count of power changes, media, wipes and installs; and no token or password in any result or log.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from better_compute.config import Settings
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, until
from better_compute.testing.metal_sim import FleetStack, fleet_stack
from better_compute.testing.metal_sim.app import HOST_CONFIG

pytestmark = pytest.mark.e2e

PROFILE = "ubuntu-24.04-autoinstall"
IMAGE = "ubuntu@24.04"
RELEASE_STEPS = ["metal.ensureRamdisk", "wait.agentJoined", "disk.wipe", "power.setPower"]
TOKEN = re.compile(rb"bcjt_[A-Za-z0-9_-]{43}")


async def _stack(
    folder: Path, settings: Settings, api: ApiClient, processes: ServiceProcesses, machines: int
) -> AsyncIterator[FleetStack]:
    # lean (docs/metal-sim.md): the machines' bcds are tasks of one process, as bench_fleet --lean
    # runs them at scale; the process per machine is exercised by test_metal_sim and the chaos tests
    async with fleet_stack(
        folder, settings, machines=machines, processes=processes, api=api, lean=True
    ) as stack:
        try:
            yield stack
        finally:
            for m in stack.sim.machines:
                print(f"--- {m.name} ledger ---", json.dumps(m.ledger.counts(), sort_keys=True))
            print(stack.tails())


async def commands_of(stack: FleetStack, workflow_id: str) -> list[Any]:
    views = (await stack.cq.list_commands(workflow_id=workflow_id)).commands
    return [await stack.cq.get(id=v.id) for v in views]


async def step_results(stack: FleetStack, workflow_id: str) -> list[tuple[str, str, Any]]:
    wf = await stack.engine.get_workflow(id=workflow_id)
    return [(s.action, s.state, s.result) for s in wf.steps]  # type: ignore[union-attr]


def leaked(blob: bytes, password: str) -> list[str]:
    found = [m.decode() for m in TOKEN.findall(blob)]
    return found + ([password] if password.encode() in blob else [])


async def no_secret_in_results(stack: FleetStack, workflow_ids: list[str]) -> None:
    """No join token or BMC password in any command payload or result, or step result."""
    password = stack.sim.emulator.password
    for wf in workflow_ids:
        for cmd in await commands_of(stack, wf):
            blob = json.dumps(cmd.payload).encode() + (cmd.result or b"")
            assert leaked(blob, password) == [], (cmd.kind, cmd.id)
        blob = json.dumps(await step_results(stack, wf), default=str).encode()
        assert leaked(blob, password) == [], wf


def no_secret_in_logs(stack: FleetStack) -> None:
    """Nor in any log: services, site agent, emulator, every bcd (read once, after all loops:
    the simulator's threads share this process, and reading growing logs per loop slowed them)."""
    password = stack.sim.emulator.password
    for path in stack.log_files():
        assert leaked(path.read_bytes(), password) == [], path


async def lifecycle_deploy_release(stack: FleetStack, index: int) -> tuple[float, float]:
    """One deploy of the page's profile and one release, checked; their times in seconds."""
    m, node_id = stack.machine(index), stack.nodes[index]
    before = m.ledger.counts()
    t0 = time.monotonic()
    run = await stack.verb("deploy", index, image=IMAGE, profile=PROFILE)
    assert (run.state, run.profile.id) == ("deploying", PROFILE)
    node = await stack.reaches(index, "deployed", timeout=90)
    t1 = time.monotonic()
    assert node.image == IMAGE
    assert node.host_section == HOST_CONFIG
    steps = await step_results(stack, run.workflow_id)
    assert [(a, s) for a, s, _ in steps] == [
        ("autoinstall.renderIso", "succeeded"), ("media.insert", "succeeded"),
        ("management.setBootDevice", "succeeded"), ("power.setPower", "succeeded"),
        ("wait.agentJoined", "succeeded"), ("media.eject", "succeeded"),
    ]  # fmt: skip
    joined = steps[4][2]
    # the installed OS's bcd joined with the user data's token: the same node, re-keyed
    assert (joined["agentId"], joined["role"]) == (node_id, "provisioned")
    sent = await commands_of(stack, run.workflow_id)
    assert sorted((c.kind, c.state) for c in sent) == [
        ("management.setBootDevice", "succeeded"), ("media.eject", "succeeded"),
        ("media.insert", "succeeded"), ("power.setPower", "succeeded"),
    ]  # fmt: skip
    assert all(c.payload["bmc"]["credentialsRef"].startswith("sec_") for c in sent)

    # the host section reached the machine: its bcd applied it and reported the generation
    async def applied() -> bool:
        got = await stack.engine.get_node(id=node_id)
        return got.observed_generation == got.generation

    await until(applied, timeout=60, what="host section applied")
    sysctl = (m.tree / "etc/sysctl.d/90-bc.conf").read_text()
    assert "vm.swappiness" in sysctl
    assert "10" in sysctl

    t2 = time.monotonic()
    release = await stack.verb("release", index)
    node = await stack.reaches(index, "ready", timeout=90)
    t3 = time.monotonic()
    assert node.image is None
    steps = await step_results(stack, release.workflow_id)
    assert [a for a, _, _ in steps] == RELEASE_STEPS
    wipe = steps[2][2]
    assert wipe["attested"] is True  # node-signed, checked against the node's certificate
    sent = await commands_of(stack, release.workflow_id)
    entries = [c for c in sent if c.kind == "netboot.setEntry"]
    assert sorted(c.payload["mac"] for c in entries) == sorted(m.macs)
    assert {c.payload["joinTokenRef"] for c in entries} == {entries[0].payload["joinTokenRef"]}
    [wipe_cmd] = [c for c in sent if c.kind == "node.wipe"]
    assert (wipe_cmd.state, wipe_cmd.attested, wipe_cmd.target) == ("succeeded", True, "node")

    # the hardware's own count for this loop: one install, one wipe, the medium in and out
    after = m.ledger.counts()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
    assert delta.get("disk.write:vda:autoinstall") == 1, delta
    assert delta.get("disk.write:vda:node.wipe") == 1, delta
    assert delta.get("media.insert:Cd") == 1, delta
    assert delta.get("media.eject:Cd") == 1, delta
    assert delta.get("install:vda") == 1, delta
    assert m.ledger.count("disk.write", commandId=wipe_cmd.id) == 1
    assert m.ledger.repeated_writes() == {}
    assert m.disk().read_bytes()[:8] != b"BCSIM-OS"  # the OS is gone with the wipe
    await no_secret_in_results(stack, [run.workflow_id, release.workflow_id])
    return t1 - t0, t3 - t2


async def _loops(stack: FleetStack, loops: int) -> None:
    """Every enrolled machine to ready, then ``loops`` deploy-and-release loops on each, all
    machines at once; per-loop times printed."""
    machines = sorted(stack.nodes)

    async def ready(i: int) -> None:
        m = stack.machine(i)
        node = await stack.engine.get_node(id=stack.nodes[i])
        assert (node.state, node.macs, node.bmc and node.bmc["driver"]) == (
            "enrolled",
            list(m.macs),
            "redfish",
        )
        inspect = await stack.verb("inspect", i)
        node = await stack.reaches(i, "inspected", timeout=180)
        # the inventory is the machine's own, as its ramdisk's bcd signed it
        assert (node.inventory["productUuid"], node.inventory["serial"]) == (m.uuid, m.serial)
        steps = await step_results(stack, inspect.workflow_id)
        assert (steps[2][0], steps[2][2]["attested"]) == ("inspect.collect", True)
        assert m.ledger.count("boot.network", served="kernel") == 1  # its entry, with the token
        assert m.ledger.count("bcd.started", mode="ramdisk") == 1
        await stack.verb("commission", i)
        await stack.reaches(i, "ready", timeout=180)
        assert m.ledger.count("disk.write", disk="vda", kind="node.wipe") == 1

    t0 = time.monotonic()
    await asyncio.gather(*(ready(i) for i in machines))
    print(f"{len(machines)} machines inspected and commissioned in {time.monotonic() - t0:.1f} s")

    times: list[tuple[int, int, float, float]] = []

    async def loop(i: int) -> None:
        for n in range(loops):
            deploy_s, release_s = await lifecycle_deploy_release(stack, i)
            times.append((i, n, deploy_s, release_s))
            print(f"machine {i} loop {n + 1}: deploy {deploy_s:.1f} s, release {release_s:.1f} s")

    t1 = time.monotonic()
    await asyncio.gather(*(loop(i) for i in machines))
    took = time.monotonic() - t1
    assert len(times) == loops * len(machines)
    per = sorted(d + r for _, _, d, r in times)
    print(f"{len(times)} deploy+release loops in {took:.1f} s on {len(machines)} machines at once;"
          f" per loop p50 {per[len(per) // 2]:.1f} s, max {per[-1]:.1f} s")  # fmt: skip
    for i in machines:
        m = stack.machine(i)
        assert m.ledger.count("install") == loops
        assert m.ledger.count("disk.write", kind="node.wipe") == loops + 1  # and commission's
        assert m.ledger.repeated_writes() == {}
        assert m.ledger.count("bcd.join-failed") == 0
        assert m.ledger.count("bcd.started", mode="installed") == loops
        assert m.ledger.count("power", to="Off") >= 2 + 2 * loops  # inspect, commission, each cycle
        workflows = (await stack.engine.list_workflows(node_id=stack.nodes[i])).workflows
        assert len(workflows) == 2 + 2 * loops
        assert {w.state for w in workflows} == {"succeeded"}
    no_secret_in_logs(stack)


def _seconds(at: str | None) -> float:
    return datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp() if at else float("nan")


async def print_step_times(stack: FleetStack) -> None:
    """Where a loop's time goes, from the step rows: each step's time (p50 and max over its
    runs) and the engine's gaps between a step's end and the next step's start."""
    took: dict[str, list[float]] = {}
    for node_id in stack.nodes.values():
        for listed in (await stack.engine.list_workflows(node_id=node_id)).workflows:
            wf = await stack.engine.get_workflow(id=listed.id)
            steps = wf.steps or []
            for n, step in enumerate(steps):
                name = f"{wf.profile.id} {n}:{step.action}"
                took.setdefault(name, []).append(_seconds(step.finished_at) - _seconds(step.started_at))
            gaps = [_seconds(b.started_at) - _seconds(a.finished_at) for a, b in itertools.pairwise(steps)]
            took.setdefault(f"{wf.profile.id} (between steps, sum)", []).append(sum(gaps))
    for name, times in sorted(took.items()):
        times.sort()
        print(f"{name:<60} x{len(times):<3} p50 {times[len(times) // 2]:6.3f} s  max {times[-1]:6.3f} s")


@pytest_asyncio.fixture(loop_scope="session")
async def four(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> AsyncIterator[FleetStack]:
    async for stack in _stack(tmp_path / "fleet", bc_settings, bc_api, bc_processes, machines=4):
        yield stack


@pytest.mark.timeout(400)  # the stack alone takes 30-90 s to start on the loaded 2-core machine
async def test_twenty_deploy_and_release_loops_of_the_pages_profile(four: FleetStack) -> None:
    """The page's 20 loops: four machines enrolled, inspected and commissioned at once, then five
    deploys of the page's profile and five releases each, all machines at once, every loop
    checked. (Four machines by five loops costs less than more machines by fewer loops: each
    machine adds an inspect and a commission, and the two cores are the limit.)"""
    await _loops(four, loops=5)
    await print_step_times(four)
    # every bcd was a task of the lean host (its numbers, no process); each signed with its own
    # key (the attested results the loops checked)
    started = [e for i in four.nodes for e in four.machine(i).ledger.events("bcd.started")]
    assert len(started) == 4 * (2 + 2 * 5)
    assert all(e["pid"] > 10_000_000 for e in started), started
