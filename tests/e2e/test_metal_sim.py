"""The simulated fleet on real processes: bc-pki, bc-secrets and bc-command-queue as processes,
the real site agent driving the simulator's sushy-emulator through its Redfish driver, and
bcd processes the simulator boots when a machine powers on from the network.

What a user would notice: a machine powered on with a one-time network boot joins as its node
and answers ``node.inventory`` with its own product UUID, node-signed; a machine that never
boots stays silent though its BMC says On; a BMC that answers 500 for a while still gets the
power change, once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.pki import PkiClient
from better_compute.clients.secrets import SecretsClient
from better_compute.config import Settings
from better_compute.core.ids import new_id
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, until
from better_compute.testing.metal_sim import Faults, MetalSim, SiteDriver, TcpGate
from better_compute.testing.metal_sim.stack import MediaServer
from better_compute.testing.site_agent import SiteAgentProcess

pytestmark = pytest.mark.e2e

SITE = "lab1"
FAST_ENV = {
    "BC_CMDQ_HEARTBEAT": "200ms", "BC_CMDQ_SWEEP": "100ms", "BC_CMDQ_REDELIVER_AFTER": "1s",
    # a machine whose plug is pulled while idle is silent after 3 idle heartbeats (30 s each by
    # default): this file waits for that (docs/command-queue.md "Presence and boot leases")
    "BC_CMDQ_IDLE_HEARTBEAT": "2s",
}  # fmt: skip


@dataclass
class Fleet:
    sim: MetalSim
    agent: SiteAgentProcess
    agent_link: TcpGate
    drive: SiteDriver
    cq: CommandQueueClient


@pytest_asyncio.fixture(loop_scope="session")
async def fleet(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> AsyncIterator[Fleet]:
    bc_processes.extra_env.update(FAST_ENV)
    for service in ("bc-pki", "bc-secrets", "bc-command-queue"):
        bc_processes.start(service)
    cq = CommandQueueClient(bc_api, timeout=5.0)
    pki = PkiClient(bc_api)
    sim = MetalSim(
        tmp_path / "sim",
        settings=bc_settings,
        machines=3,
        site_id=SITE,
        seed=7,
        power_delay=(0.2, 1.0),
        faults={
            1: Faults(never_boots=True, bmc_proxy=True),
            2: Faults(flaky_link=True, power_delay=(2.0, 2.5)),
        },
    )
    link = sim.nats_gate()  # the site agent's route to NATS, which a test can cut
    agent = SiteAgentProcess(
        folder=tmp_path / "site-agent", nats_url=link.url, subject_root=bc_settings.subject_root, site_id=SITE
    )
    sim.boot_url = agent.url
    try:
        # both take seconds (up to a minute or more on the loaded 2-core machine)
        await asyncio.gather(bc_processes.wait_ready(timeout=180), asyncio.to_thread(sim.start))
        site_token = await pki.issue_join_token(tenant_id="root", role="site", site_id=SITE, ttl_seconds=600)
        agent.write_config(site_token.token)
        agent.start()
        await until(lambda: _connected(cq, role="site"))
        drive = SiteDriver(sim=sim, cq=cq, pki=pki, secrets=SecretsClient(bc_api))
        yield Fleet(sim=sim, agent=agent, agent_link=link, drive=drive, cq=cq)
    finally:
        agent.close()
        await asyncio.to_thread(sim.close)
        for m in sim.machines:
            print(f"--- {m.name} ledger ---", m.ledger.path.read_text() if m.ledger.path.exists() else "")
            print(f"--- {m.name} bcd ---", m.bcd_output()[-3000:], sep="\n")
        print("--- site agent ---", agent.output()[-4000:], sep="\n")
        print("--- emulator ---", sim.emulator.output()[-3000:], sep="\n")


async def _connected(cq: CommandQueueClient, *, role: str | None = None, agent_id: str | None = None) -> bool:
    agents = await cq.agents(site_id=SITE, connected=True)
    return any((role is None or a.role == role) and (agent_id is None or a.id == agent_id) for a in agents)


async def test_a_network_booted_machine_joins_and_reports_its_own_inventory(fleet: Fleet) -> None:
    m, node = fleet.sim.machine(0), new_id("node")
    await fleet.drive.network_boot(m, node)

    await until(lambda: _connected(fleet.cq, agent_id=node), timeout=30)
    inv = await fleet.drive.node_command(node, "node.inventory", {}, "inv")
    assert (inv.state, inv.attested) == ("succeeded", True), inv.reason
    doc = json.loads(inv.result or "{}")
    assert (doc["productUuid"], doc["serial"]) == (m.uuid, m.serial)
    assert sorted(n["mac"] for n in doc["nics"]) == sorted(m.macs)

    # A wipe runs once, and the disk (not bcd's log) counts it.
    wipe = await fleet.drive.node_command(node, "node.wipe", {"mode": "quick"}, "wipe")
    assert (wipe.state, wipe.attested) == ("succeeded", True), wipe.reason
    assert m.ledger.count("disk.write", disk="vda", kind="node.wipe", commandId=wipe.id) == 1

    # An image write, counted at the disk too; the disk then holds the image.
    image = os.urandom(3 << 20)
    served = MediaServer()
    image_url = served.add("image.raw", image)
    try:
        written = await fleet.drive.node_command(node, "node.imageWrite", {
            "url": image_url, "sha256": hashlib.sha256(image).hexdigest(), "format": "raw",
            "disk": "/dev/vda",
        }, "image")  # fmt: skip
    finally:
        served.close()
    assert (written.state, written.attested) == ("succeeded", True), written.reason
    assert m.ledger.count("disk.write", disk="vda", kind="node.imageWrite", commandId=written.id) == 1
    assert m.disk("vda").read_bytes()[: len(image)] == image
    assert m.ledger.repeated_writes() == {}

    # A disk that fails writes: the next wipe fails, and the hardware saw the attempt.
    m.fail_writes("vda")
    failed = await fleet.drive.node_command(node, "node.wipe", {"mode": "quick"}, "wipe-2")
    assert failed.state == "failed", failed.state
    assert m.ledger.count("disk.write", disk="vda", kind="node.wipe", commandId=failed.id, failed=True) == 1

    ledger = m.ledger
    assert ledger.count("power", to="On") == 1
    assert ledger.count("boot.network", served="kernel") == 1
    assert ledger.count("bcd.started") == 1
    token_words = [e for e in ledger.events() if "bcd.token" in json.dumps(e)]
    assert token_words == []  # the ledger keeps no token

    # Power off pulls the plug: that bcd is gone, its node disconnected.
    await fleet.drive.ok(m, node, "power.setPower", {"action": "off"})
    await until(lambda: m.ledger.count("bcd.stopped", reason="power-off") == 1)
    await until(lambda: _not(_connected(fleet.cq, agent_id=node)), timeout=30)
    assert ledger.count("power", to="Off") == 1


async def _not(check: Any) -> bool:
    return not await check


async def test_knobs_a_machine_that_never_boots_behind_a_bmc_that_500s_then_recovers(fleet: Fleet) -> None:
    m, node = fleet.sim.machine(1), new_id("node")
    assert m.proxy is not None
    m.proxy.set(mode="error-count", left=3)
    await fleet.drive.network_boot(m, node)

    # The BMC answered 500 three times; the site agent retried and the power change reached it once.
    answered = [line.split()[-1] for line in m.proxy.requests()]
    assert answered.count("error") == 3
    resets = [line for line in m.proxy.requests() if "ComputerSystem.Reset" in line]
    assert [line.split()[-1] for line in resets] == ["forward"]
    await until(lambda: m.ledger.count("boot.none", reason="never-boots") == 1)
    assert m.ledger.count("power", to="On") == 1
    # Nothing ever ran on it: no bcd, no join.
    assert m.ledger.count("bcd.started") == 0
    assert not await _connected(fleet.cq, agent_id=node)
    assert m.boots == 1


async def test_knobs_a_media_boot_through_slow_power_a_flaky_link_and_a_site_cut_off(fleet: Fleet) -> None:
    m, node = fleet.sim.machine(2), new_id("node")
    assert m.gate is not None
    medium = MediaServer()  # the ISO: its first bytes are its boot command line
    medium_url = medium.add(
        "ramdisk.iso", (await fleet.drive.boot_cmdline(m, node)).encode()
    )  # its boot line
    try:
        await fleet.drive.media_boot(m, node, medium_url)
    finally:
        medium.close()
    await until(lambda: _connected(fleet.cq, agent_id=node), timeout=30)
    assert m.ledger.count("media.insert", device="Cd") == 1
    assert m.ledger.count("boot.media", bootable=True) == 1
    requested, landed = m.ledger.events("power.requested", to="On"), m.ledger.events("power", to="On")
    assert len(requested) == len(landed) == 1
    assert landed[0]["t"] - requested[0]["t"] >= 2.0  # this machine's power changes land late

    # Its bcd loses the connection for a while, gets it back, and answers.
    m.gate.cut(2.0)
    inv = await fleet.drive.node_command(node, "node.inventory", {}, "inv-after-cut")
    assert (inv.state, inv.attested) == ("succeeded", True), inv.reason
    assert json.loads(inv.result or "{}")["productUuid"] == m.uuid

    # The site agent is cut off from NATS: a power-off sent meanwhile lands once it is back.
    fleet.agent_link.cut(3.0)
    await fleet.drive.ok(m, node, "power.setPower", {"action": "off"})
    assert fleet.agent_link.cuts == 1
    assert m.ledger.count("power", to="Off") == 1
    await until(lambda: m.ledger.count("bcd.stopped", reason="power-off") == 1)
