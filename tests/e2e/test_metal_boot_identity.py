"""Identity on the boot network (issue 23, H1 and item 4): an attacker on the boot network who asks
the site agent for a node's boot script gets no identity at all, and the machine's own boot shows
it.

Every part is a real process: bc-pki, bc-secrets, bc-command-queue, bc-engine, the site agent and
the simulated machines, whose iPXE asks the site agent over HTTP as an attacker would. The
machines ask from 127.0.0.1; the attacker from other loopback addresses (another host on the boot
network). Counted where a user sees it: at the attacker (its certificate never signs anything that
counts, its agent never hears from the command queue, no command reaches it), the node
(quarantined, its workflow aborted, ``bcx nodes show`` and ``bcx why`` say why), the machine (no
bcd of the thief's token ever runs on it), and the feed (a node event ``quarantine``).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import http.client
import json
import re
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import pytest_asyncio

from better_compute.agent import Agent, Command, Enrollment, enroll, load_enrollment
from better_compute.config import Settings
from better_compute.core.errors import BcError
from better_compute.metal.commands import COMMAND_KINDS
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, bcx, until
from better_compute.testing.metal_sim import Faults, FleetStack, fleet_stack
from better_compute.wire.engine import NODE_EVENTS
from better_compute.wire.pki import JoinClaims

pytestmark = pytest.mark.e2e

TOKEN = re.compile(r"bcd\.token=(bcjt_[A-Za-z0-9_-]{43})")


@pytest_asyncio.fixture(loop_scope="session")
async def stack(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> AsyncIterator[FleetStack]:
    # machine 0's BMC takes seconds to power on: the thief asks for its script before it boots;
    # machine 2's iPXE asks twice at each network boot; machine 3 never boots (only the test asks)
    # machine 4's BMC hands the ramdisk its token on a virtual CD (tokenDelivery media), and
    # takes seconds to power on too
    faults = {0: Faults(power_delay=(4.0, 4.5)), 2: Faults(netboot_asks=2), 3: Faults(never_boots=True),
              4: Faults(power_delay=(4.0, 4.5))}  # fmt: skip
    async with fleet_stack(
        tmp_path / "fleet", bc_settings, machines=5, faults=faults, processes=bc_processes, api=bc_api,
        quiet_seconds=5.0,
    ) as fleet:  # fmt: skip
        try:
            yield fleet
        finally:
            for m in fleet.sim.machines:
                print(f"--- {m.name} ledger ---", m.ledger.counts())
            print(fleet.tails())


def _ask(stack: FleetStack, mac: str, *, source: str = "127.0.0.2") -> str:
    """GET /boot/mac/<mac> as any host on the boot network can (no credential), from ``source``
    (another host than the machines, which ask from 127.0.0.1)."""
    url = urlsplit(stack.agent.url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=5, source_address=(source, 0))
    try:
        conn.request("GET", f"/boot/mac/{mac.replace(':', '-')}")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


class ThiefAgent:
    """The thief's agent process side, run with its stolen enrollment: counts every command that
    reaches it (answering each as a bcd would, without doing anything)."""

    def __init__(self, stack: FleetStack, thief: Enrollment, folder: Path) -> None:
        self.commands: list[str] = []

        async def handle(cmd: Command) -> dict[str, Any]:
            self.commands.append(cmd.kind)
            return {}

        self.agent = Agent(
            enrollment=thief, handlers=dict.fromkeys(COMMAND_KINDS, handle), journal=folder / "thief.db",
            nats_url=stack.settings.nats_url, subjects=stack.api.subjects,
        )  # fmt: skip
        self.task: asyncio.Task[None] | None = None

    @property
    def heard(self) -> bool:
        """Whether the command queue ever answered its hello (it would pull commands as the node)."""
        return self.agent.ready.is_set()

    async def start(self) -> None:
        await self.agent.start()
        self.task = asyncio.create_task(self.agent.run())

    async def close(self) -> None:
        self.agent.request_stop()
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        await self.agent.stop()


def _entries(stack: FleetStack) -> list[str]:
    return [p.name for p in (stack.agent.state_dir / "netboot").glob("*.json")]


def _entries_of(stack: FleetStack, m: Any) -> bool:
    folder = stack.agent.state_dir / "netboot"
    return all((folder / f"{mac.replace(':', '-')}.json").exists() for mac in m.macs)


def _get(url: str, *, source: str) -> int:
    """GET ``url`` from ``source``; the status."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=5, source_address=(source, 0))
    try:
        conn.request("GET", parts.path)
        return conn.getresponse().status
    finally:
        conn.close()


def _bmc_medium_url(stack: FleetStack, m: Any) -> str | None:
    """The image URL machine ``m``'s BMC shows for its virtual CD (Redfish, as anyone with the
    BMC's credential reads it), or None while none is inserted."""
    creds = stack.sim.emulator.credentials
    auth = base64.b64encode(f"{creds['username']}:{creds['password']}".encode()).decode()

    def get(path: str) -> dict[str, Any]:
        req = urllib.request.Request(
            stack.sim.emulator.url + path, headers={"Authorization": f"Basic {auth}"}
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            doc: dict[str, Any] = json.loads(resp.read())
            return doc

    system = get(f"/redfish/v1/Systems/{m.uuid}")
    for manager in system.get("Links", {}).get("ManagedBy", []):
        media = get(get(manager["@odata.id"])["VirtualMedia"]["@odata.id"])
        for member in media.get("Members", []):
            medium = get(member["@odata.id"])
            if medium.get("Inserted") and medium.get("Image"):
                return str(medium["Image"])
    return None


async def _step_of(stack: FleetStack, node_id: str, action: str = "wait.agentJoined") -> bool:
    current = (await stack.engine.get_node(id=node_id)).current_workflow
    return current is not None and current.step is not None and current.step.action == action


async def _quarantine(stack: FleetStack, node_id: str) -> dict[str, Any] | None:
    found: dict[str, Any] | None = (await stack.engine.get_node(id=node_id)).quarantine
    return found


async def _node_events(stack: FleetStack, node_id: str) -> list[dict[str, Any]]:
    """The node's events on the feed, collected from now on (the list fills as they come)."""
    seen: list[dict[str, Any]] = []

    async def got(msg: Any) -> None:
        seen.append(json.loads(msg.data))

    await stack.api.nc.subscribe(stack.api.subjects.event(NODE_EVENTS, node_id), cb=got)
    return seen


async def _signature_counts(stack: FleetStack, thief: Enrollment) -> bool:
    """Whether a signature of the thief's key verifies at bc-pki as the node (what the command
    queue asks before it takes a command's result)."""
    data, signature = thief.identity.sign("node.inventory", {"nodeId": thief.agent_id})
    try:
        await stack.pki.verify(signer_id=thief.cert_id, data=data, signature=signature)
    except BcError as err:
        if err.reason not in ("cert-revoked", "cert-pending"):
            raise
        return False
    return True


@pytest.mark.timeout(420)  # the stack takes 30-90 s to start on the loaded 2-core machine
async def test_a_token_taken_off_the_boot_network_is_never_the_nodes_identity(
    stack: FleetStack, tmp_path: Path
) -> None:
    # -- the thief asks first: before the machine has even powered on --------------------------
    m, node_id = stack.machine(0), stack.nodes[0]
    events = await _node_events(stack, node_id)
    run = await stack.verb("inspect", 0)
    await until(lambda: len(_entries(stack)) >= len(m.macs), timeout=120, what="machine 0's boot entries")
    script = _ask(stack, m.macs[0])
    found = TOKEN.search(script)
    assert found is not None, script  # the first ask gets the entry: nobody can tell who asks
    claims = JoinClaims(macs=list(m.macs), product_uuid=m.uuid, serial=m.serial)
    thief = await enroll(stack.pki, token=found.group(1), claims=claims, site_id=stack.site_id)
    assert thief.agent_id == node_id
    # ... it holds a certificate, but a pending one: it signs nothing that counts, the command
    # queue does not hear it, and it gets no command (counted at the thief)
    assert (await stack.pki.get_certificate(cert_id=thief.cert_id)).state == "pending"
    assert not await _signature_counts(stack, thief)
    thief_agent = ThiefAgent(stack, thief, tmp_path)
    await thief_agent.start()
    try:
        # ... the machine boots and asks for its script: it gets nothing, and everybody is told
        await until(lambda: m.ledger.count("boot.network") >= 1, timeout=60, what="machine 0 network-boots")
        assert m.ledger.count("boot.network", served="exit") == 1
        node = await stack.node_reaches(node_id, "failed", timeout=60, what="the quarantined node")
        assert node.quarantine is not None
        assert node.quarantine["reason"] == "boot-entry-fetched-twice", node.quarantine
        assert node.quarantine["mac"] == m.macs[0]
        assert "node quarantined: its one-time boot entry" in node.state_reason["message"], node.state_reason
        assert (await stack.engine.get_workflow(id=run.workflow_id)).state == "aborted"
        # the thief's certificate went from pending to revoked: it was never the node
        assert (await stack.pki.get_certificate(cert_id=thief.cert_id)).state == "revoked"
        assert not await _signature_counts(stack, thief)
        assert thief_agent.commands == []
        assert not thief_agent.heard
    finally:
        await thief_agent.close()
    # a burn reported again (its answer lost) gets the same answer and changes nothing; a confirm
    # after it is refused; the thief could never confirm its own token (not a site agent's key)
    site_agent = load_enrollment(stack.agent.state_dir / "enrollment.json")
    assert site_agent is not None
    digest = hashlib.sha256(found.group(1).encode()).hexdigest()
    again = await stack.pki.burn_join_token(
        identity=site_agent.identity, token_sha256=digest, mac=m.macs[0], reason="boot-entry-fetched-twice"
    )
    assert again.revoked_cert_ids == node.quarantine["revokedCertIds"] == [thief.cert_id]
    with pytest.raises(BcError) as late_confirm:
        await stack.pki.confirm_join_token(identity=site_agent.identity, token_sha256=digest, mac=m.macs[0])
    assert (late_confirm.value.code.value, late_confirm.value.reason) == ("INVALID_STATE", "token-revoked")
    with pytest.raises(BcError) as self_confirm:
        await stack.pki.confirm_join_token(identity=thief.identity, token_sha256=digest, mac=m.macs[0])
    assert self_confirm.value.code.value == "UNAUTHENTICATED"
    assert (await stack.engine.get_node(id=node_id)).quarantine == node.quarantine  # not quarantined anew
    assert m.ledger.count("bcd.started") == 0  # no bcd ever ran on the machine with that token
    await until(lambda: any(e.get("verb") == "quarantine" for e in events), timeout=10, what="the event")
    shown = await bcx(stack.settings, "nodes", "show", node_id)
    assert "quarantine  boot-entry-fetched-twice" in shown.stdout, shown.stdout
    why = await bcx(stack.settings, "why", node_id)
    assert f"node {node_id} is quarantined" in why.stdout, why.stdout
    # only an operator's look starts on it (and clears the quarantine)
    with pytest.raises(BcError) as refused:
        await stack.verb("commission", 0)
    assert (refused.value.code.value, refused.value.reason) == ("INVALID_STATE", "node-quarantined")
    with pytest.raises(BcError) as resumed:  # nor does the aborted workflow go on
        await stack.engine.resume_workflow(id=run.workflow_id)
    assert (resumed.value.code.value, resumed.value.reason) == ("INVALID_STATE", "node-quarantined")

    # -- the machine first: a later ask from another host, for any MAC of the node, gets nothing -
    m, node_id = stack.machine(1), stack.nodes[1]
    await stack.verb("inspect", 1)
    await until(lambda: m.ledger.count("bcd.started") >= 1, timeout=120, what="machine 1's ramdisk")
    late = _ask(stack, m.macs[1])  # the node's other MAC: its entry went with the first
    assert "bcd.token" not in late, late
    node = await stack.node_reaches(node_id, "failed", timeout=60, what="the quarantined node")
    assert node.quarantine is not None
    assert node.quarantine["mac"] == m.macs[1]
    # and a second join with the token the machine booted with (sniffed off the wire) is refused
    cmdline = (m.tree / "proc/cmdline").read_text()
    sniffed = TOKEN.search(cmdline)
    assert sniffed is not None
    with pytest.raises(BcError) as second:
        await enroll(
            stack.pki, token=sniffed.group(1), claims=JoinClaims(macs=list(m.macs)), site_id=stack.site_id
        )
    assert second.value.code.value == "UNAUTHENTICATED", second.value
    certs = await stack.pki.list_certificates(agent_id=node_id, include_revoked=True)
    assert certs
    assert all(c.state == "revoked" for c in certs)

    # -- a machine whose iPXE asks twice (from its own address) is not a thief ------------------
    m, node_id = stack.machine(2), stack.nodes[2]
    await stack.verb("inspect", 2)
    node = await stack.node_reaches(node_id, "inspected", timeout=120, what="machine 2 inspected")
    assert node.quarantine is None
    # it asked twice, and the second ask got the same entry again (its iPXE booted the kernel)
    assert m.ledger.count("boot.network", served="kernel", asks=2) == 1
    certs = await stack.pki.list_certificates(agent_id=node_id)
    assert [c.state for c in certs] == ["valid"]  # its join, confirmed once the entry closed clean

    # -- a BMC with virtual media: the token never crosses the boot network --------------------
    m, node_id = stack.machine(4), stack.nodes[4]
    updated = await bcx(stack.settings, "nodes", "update", node_id, "--bmc-token-delivery", "media")
    assert updated.returncode == 0, updated.stdout + updated.stderr
    shown = await bcx(stack.settings, "nodes", "show", node_id)
    assert "boot token  media: on a virtual CD only the BMC fetches" in shown.stdout, shown.stdout
    run = await stack.verb("inspect", 4)
    # the BMC fetched the token image from the site agent's capability URL (sushy-emulator
    # downloads it at InsertMedia); whoever reads the BMC's virtual media sees that URL
    leaked = await until(
        lambda: _bmc_medium_url(stack, m), timeout=60, interval=0.2, what="machine 4's medium inserted"
    )
    assert re.fullmatch(r"http://[^/]+/media/[0-9a-f]{32}", leaked), leaked
    await until(lambda: _entries_of(stack, m), timeout=60, what="machine 4's boot entries")
    script = _ask(stack, m.macs[0])  # a host on the boot network asks before the machine does
    assert m.ledger.count("boot.network") == 0  # (its BMC takes seconds to power it on)
    assert TOKEN.search(script) is None, script  # nothing to join with: 0 joins as the node
    assert "bcd.token_from=media" in script
    assert _get(leaked.rsplit("/", 1)[0] + "/" + "0" * 32, source="127.0.0.2") == 404  # no guessing
    await until(lambda: m.ledger.count("boot.network") >= 1, timeout=60, what="machine 4 network-boots")
    m.faults = dataclasses.replace(m.faults, power_delay=None)  # its power-off need not take seconds
    stack.sim.write_power_delays()
    node = await stack.node_reaches(node_id, "inspected", timeout=120, what="machine 4 inspected")
    assert node.quarantine is None
    assert node.inventory_summary is not None  # from the ramdisk's attested answer: it is the node
    cmdline = (m.tree / "proc/cmdline").read_text()
    assert "bcd.token=" not in cmdline
    assert "bcd.token_from=media" in cmdline
    assert m.ledger.count("media.visible") == 1
    assert m.ledger.count("media.eject") == 1  # out once the node joined
    assert not _entries_of(stack, m)  # and its entries cleared
    steps = {st.action: st.result for st in (await stack.engine.get_workflow(id=run.workflow_id)).steps}
    assert steps["metal.ensureRamdisk"]["tokenDelivery"] == "media"
    assert "mediaEjectCommand" in steps["wait.agentJoined"]
    [cert] = await stack.pki.list_certificates(agent_id=node_id)
    assert cert.state == "valid"  # never held: no quiet period to wait for
    # a second fetch of the capability URL (leaked off the BMC) gets nothing and burns the token
    assert _get(leaked, source="127.0.0.2") == 404
    quarantined = await until(
        lambda: _quarantine(stack, node_id), timeout=60, what="the node quarantined for the leaked medium"
    )
    assert quarantined["reason"] == "boot-medium-fetched-twice", quarantined
    assert (await stack.pki.get_certificate(cert_id=cert.cert_id)).state == "revoked"

    # -- a burn report survives bc-pki away and the agent killed before it could send it -------
    m, node_id = stack.machine(3), stack.nodes[3]  # never boots: only the test's hosts ask
    await stack.verb("inspect", 3)
    await until(lambda: len(_entries(stack)) >= len(m.macs), timeout=120, what="machine 3's boot entries")
    # its ramdisk step done (the power cycle too): the site agent is killed below, and a command
    # of that step still running then would fail the inspect for another reason than the burn
    await until(lambda: _step_of(stack, node_id), timeout=120, what="machine 3 waits for its join")
    pki = next(p for p in stack.processes.procs if p.service == "bc-pki" and p.alive())
    pki.kill()
    assert TOKEN.search(_ask(stack, m.macs[0], source="127.0.0.2")) is not None
    assert "bcd.token" not in _ask(stack, m.macs[0], source="127.0.0.3")
    reports = stack.agent.state_dir / "netboot" / "reports"
    await until(lambda: any(reports.glob("burn-*.json")), timeout=10, what="the burn report kept")
    stack.agent.kill()
    stack.agent.start()
    stack.processes.restart(pki)
    node = await stack.node_reaches(node_id, "failed", timeout=120, what="the quarantined node")
    assert node.quarantine is not None
    assert node.quarantine["reason"] == "boot-entry-fetched-twice"
    await until(lambda: not any(reports.glob("burn-*.json")), timeout=30, what="the report taken")
