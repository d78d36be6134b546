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
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from better_compute.cmdq_client import CommandQueueClient
from better_compute.config import Settings
from better_compute.core.ids import new_id
from better_compute.pki_client import PkiClient
from better_compute.secrets_client import SecretsClient
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, until
from better_compute.testing.metal_sim import Faults, MetalSim, SimMachine
from better_compute.testing.site_agent import SiteAgentProcess
from better_compute.wire.cmdq import EnqueueCommand

pytestmark = pytest.mark.e2e

SITE = "lab1"
FAST_ENV = {"BC_CMDQ_HEARTBEAT": "200ms", "BC_CMDQ_SWEEP": "100ms", "BC_CMDQ_REDELIVER_AFTER": "1s"}


@dataclass
class Fleet:
    sim: MetalSim
    agent: SiteAgentProcess
    cq: CommandQueueClient
    pki: PkiClient
    secrets: SecretsClient
    wf: str
    steps: int = 0

    async def site(self, m: SimMachine, node: str, kind: str, payload: dict[str, Any]) -> dict[str, Any]:
        """One site-agent command for machine ``m`` (its BMC credential stored for that step);
        its result, once it succeeded."""
        self.steps += 1
        creds = json.dumps(self.sim.emulator.credentials).encode()
        ref = (await self.secrets.put(creds, tenant_id="root", workflow_id=self.wf, step=self.steps)).ref
        if kind.startswith(("power.", "management.", "media.")):
            payload = {**payload, "bmc": m.bmc(ref)}
        view = await self.cq.enqueue(
            EnqueueCommand(node_id=node, site_id=SITE, kind=kind, key=f"wf:{self.wf}:{self.steps}#1:{kind}",
                           workflow_id=self.wf, step=self.steps, payload=payload, timeout_ms=60_000)
        )  # fmt: skip
        done = await self.cq.wait(view.id, timeout=60)
        assert done.state == "succeeded", (kind, done.state, done.reason)
        result: dict[str, Any] = json.loads(done.result or "{}")
        return result

    async def network_boot(self, m: SimMachine, node: str) -> None:
        """What the engine does to boot a node's ramdisk: a join token bound to the node and its
        hardware, a one-time iPXE entry whose command line carries it, PXE once, power on."""
        token = await self.pki.issue_join_token(
            tenant_id="root", role="provisioned", site_id=SITE, ttl_seconds=600, node_id=node,
            expect={"productUuid": m.uuid},
        )  # fmt: skip
        await self.site(m, node, "netboot.setEntry", {
            "mac": m.macs[0], "kernel": "http://127.0.0.1:9/bcd-ramdisk/vmlinuz",
            "cmdline": f"bcd.token={token.token} bcd.control_plane=nats://gw.invalid:4222",
        })  # fmt: skip
        await self.site(m, node, "management.setBootDevice", {"device": "pxe"})
        assert (await self.site(m, node, "power.setPower", {"action": "on"}))["powerState"] == "On"


@pytest_asyncio.fixture(loop_scope="session")
async def fleet(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> AsyncIterator[Fleet]:
    bc_processes.extra_env.update(FAST_ENV)
    for service in ("bc-pki", "bc-secrets", "bc-command-queue"):
        bc_processes.start(service)
    await bc_processes.wait_ready()
    cq = CommandQueueClient(bc_api, timeout=5.0)
    pki = PkiClient(bc_api)
    sim = MetalSim(
        tmp_path / "sim",
        settings=bc_settings,
        machines=2,
        site_id=SITE,
        seed=7,
        power_delay=(0.2, 1.0),
        faults={1: Faults(never_boots=True, bmc_proxy=True)},
    )
    agent = SiteAgentProcess(
        folder=tmp_path / "site-agent",
        nats_url=bc_settings.nats_url or "",
        subject_root=bc_settings.subject_root,
        site_id=SITE,
    )
    sim.boot_url = agent.url
    site_token = await pki.issue_join_token(tenant_id="root", role="site", site_id=SITE, ttl_seconds=600)
    agent.write_config(site_token.token)
    await asyncio.to_thread(sim.start)
    agent.start()
    try:
        await until(lambda: _connected(cq, role="site"))
        yield Fleet(sim=sim, agent=agent, cq=cq, pki=pki, secrets=SecretsClient(bc_api), wf=new_id("wf"))
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
    await fleet.network_boot(m, node)

    await until(lambda: _connected(fleet.cq, agent_id=node), timeout=30)
    view = await fleet.cq.enqueue(
        EnqueueCommand(node_id=node, site_id=SITE, kind="node.inventory", payload={}, key="inv",
                       target="node")
    )  # fmt: skip
    inv = await fleet.cq.wait(view.id, timeout=30)
    assert (inv.state, inv.attested) == ("succeeded", True), inv.reason
    doc = json.loads(inv.result or "{}")
    assert (doc["productUuid"], doc["serial"]) == (m.uuid, m.serial)
    assert sorted(n["mac"] for n in doc["nics"]) == sorted(m.macs)

    # A wipe runs once, and the disk (not bcd's log) counts it.
    view = await fleet.cq.enqueue(
        EnqueueCommand(node_id=node, site_id=SITE, kind="node.wipe", payload={"mode": "quick"}, key="wipe",
                       target="node")
    )  # fmt: skip
    wipe = await fleet.cq.wait(view.id, timeout=30)
    assert (wipe.state, wipe.attested) == ("succeeded", True), wipe.reason
    assert m.ledger.count("disk.write", disk="vda", kind="node.wipe", commandId=wipe.id) == 1

    ledger = m.ledger
    assert ledger.count("power", to="On") == 1
    assert ledger.count("boot.network", served="kernel") == 1
    assert ledger.count("bcd.started") == 1
    token_words = [e for e in ledger.events() if "bcd.token" in json.dumps(e)]
    assert token_words == []  # the ledger keeps no token

    # Power off pulls the plug: that bcd is gone, its node disconnected.
    await fleet.site(m, node, "power.setPower", {"action": "off"})
    await until(lambda: m.ledger.count("bcd.stopped", reason="power-off") == 1)
    await until(lambda: _not(_connected(fleet.cq, agent_id=node)), timeout=30)
    assert ledger.count("power", to="Off") == 1


async def _not(check: Any) -> bool:
    return not await check


async def test_knobs_a_machine_that_never_boots_behind_a_bmc_that_500s_then_recovers(fleet: Fleet) -> None:
    m, node = fleet.sim.machine(1), new_id("node")
    assert m.proxy is not None
    m.proxy.set(mode="error-count", left=3)
    await fleet.network_boot(m, node)

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
