"""bc-site-agent as an operator runs it: its own process, joined with a site token from a file,
BMC commands through the real command-queue with credentials from the real bc-secrets fetch
gate, against sushy-emulator (behind a proxy that counts what reached the BMC) and pyghmi's IPMI
BMC (whose request log counts the sessions and requests that reached it)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import stat
import urllib.error
import urllib.request
from base64 import b64encode
from collections.abc import AsyncIterator, Iterator
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
from better_compute.testing import ServiceProcesses, run_bcx
from better_compute.testing.agents import until
from better_compute.testing.bmcs import SYSTEM_MACS, SYSTEM_UUID, FaultyProxy, IpmiBmc, RedfishEmulator
from better_compute.testing.site_agent import SiteAgentProcess
from better_compute.wire.cmdq import TERMINAL_STATES, CommandView, EnqueueCommand

SITE = "site-e2e"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedfishEmulator]:
    emu = RedfishEmulator(tmp_path_factory.mktemp("redfish")).start()
    yield emu
    emu.close()


@dataclass
class Site:
    api: ApiClient
    cq: CommandQueueClient
    secrets: SecretsClient
    agent: SiteAgentProcess
    agent_id: str
    proxy: FaultyProxy
    emulator: RedfishEmulator
    wf: str
    node: str
    steps: int = 0
    ipmi: IpmiBmc | None = None
    """Commands go to this IPMI BMC instead of the Redfish one."""

    async def run(self, kind: str, payload: dict[str, Any], *, timeout_ms: int = 60_000) -> CommandView:
        """One command of a new workflow step, with the BMC's credential stored for that step."""
        view = await self.enqueue(kind, payload, timeout_ms=timeout_ms)
        return await self.settled(view.id)

    async def enqueue(self, kind: str, payload: dict[str, Any], *, timeout_ms: int = 60_000) -> CommandView:
        self.steps += 1
        user, password = self.emulator.username, self.emulator.password
        if self.ipmi is not None:
            user, password = self.ipmi.username, self.ipmi.password
        creds = json.dumps({"username": user, "password": password})
        ref = (
            await self.secrets.put(
                value=creds.encode(), tenant_id="root", workflow_id=self.wf, step=self.steps
            )
        ).ref
        bmc = {"driver": "redfish", "address": self.proxy.url, "credentialsRef": ref}
        if self.ipmi is not None:
            bmc = {"driver": "ipmi", "address": self.ipmi.address, "credentialsRef": ref}
        return await self.cq.enqueue(
            EnqueueCommand(
                node_id=self.node,
                site_id=SITE,
                kind=kind,
                key=f"wf:{self.wf}:{self.steps}#1:{kind}",
                workflow_id=self.wf,
                step=self.steps,
                payload={**payload, "bmc": bmc},
                timeout_ms=timeout_ms,
            )
        )

    async def settled(self, command_id: str) -> CommandView:
        async def done() -> CommandView | None:
            view = await self.cq.get(id=command_id)
            return view if view.state in TERMINAL_STATES else None

        result: CommandView = await until(done)
        return result

    def bmc(self, path: str = f"/redfish/v1/Systems/{SYSTEM_UUID}") -> dict[str, Any]:
        req = urllib.request.Request(self.emulator.url + path)
        auth = b64encode(f"{self.emulator.username}:{self.emulator.password}".encode()).decode()
        req.add_header("Authorization", f"Basic {auth}")
        with urllib.request.urlopen(req, timeout=5) as resp:
            doc: dict[str, Any] = json.loads(resp.read())
            return doc

    def resets(self) -> int:
        return sum("ComputerSystem.Reset" in line for line in self.proxy.requests())


async def _agent_id(cq: CommandQueueClient, before: set[str]) -> str | None:
    new = [a.id for a in await cq.agents(site_id=SITE, connected=True) if a.id not in before]
    return new[0] if new else None


@pytest_asyncio.fixture(loop_scope="session")
async def site(
    bc_api: ApiClient,
    bc_processes: ServiceProcesses,
    bc_settings: Settings,
    emulator: RedfishEmulator,
    tmp_path: Path,
) -> AsyncIterator[Site]:
    for service in ("bc-pki", "bc-secrets", "bc-command-queue"):
        bc_processes.start(service)
    await bc_processes.wait_ready()
    cq = CommandQueueClient(bc_api)
    token = await PkiClient(bc_api).issue_join_token(
        tenant_id="root", role="site", site_id=SITE, ttl_seconds=600
    )
    proxy = FaultyProxy(tmp_path / "proxy", emulator.url).start()
    agent = SiteAgentProcess(
        folder=tmp_path / "site-agent",
        nats_url=bc_settings.nats_url or "",
        subject_root=bc_settings.subject_root,
        site_id=SITE,
    )
    agent.write_config(token.token)
    agent.start()
    try:
        agent_id = await until(lambda: _agent_id(cq, set()))
        yield Site(
            api=bc_api,
            cq=cq,
            secrets=SecretsClient(bc_api),
            agent=agent,
            agent_id=agent_id,
            proxy=proxy,
            emulator=emulator,
            wf=new_id("wf"),
            node=new_id("node"),
        )
    finally:
        agent.close()
        proxy.close()
        print("--- site agent ---", agent.output()[-6000:], sep="\n")


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as resp:
        data: bytes = resp.read()
        return data


def _health(url: str) -> dict[str, Any] | None:
    try:
        doc: dict[str, Any] = json.loads(_get(url + "/healthz"))
    except urllib.error.HTTPError as err:  # 503 while not ready
        err.close()
        if err.code != 503:
            raise
        return None
    return doc


def ok(view: CommandView) -> dict[str, Any]:
    assert view.state == "succeeded", (view.state, view.reason)
    assert view.result is not None
    doc: dict[str, Any] = json.loads(view.result)
    return doc


async def test_the_site_agent_drives_a_redfish_bmc_and_keeps_its_secrets(site: Site) -> None:
    state = site.agent.state_dir
    assert stat.S_IMODE((state / "enrollment.json").stat().st_mode) == 0o600
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    # ready once the agent pulls its commands, a moment after the command-queue saw its hello
    health = await until(lambda: asyncio.to_thread(_health, site.agent.url))
    # anyone on the boot network reads it: whether the agent works, nothing more (issue 23)
    assert health == {"status": "ok", "connected": True, "ready": True}

    assert ok(await site.run("power.setPower", {"action": "on"}))["powerState"] == "On"
    assert site.bmc()["PowerState"] == "On"
    got = ok(await site.run("management.setBootDevice", {"device": "pxe"}))
    assert got["target"] == "Pxe"
    assert site.bmc()["Boot"]["BootSourceOverrideTarget"] == "Pxe"
    resets = site.resets()
    assert ok(await site.run("power.setPower", {"action": "cycle"})) == {
        "driver": "redfish",
        "powerState": "On",
        "changed": True,
    }
    assert site.resets() == resets + 1
    inventory = ok(await site.run("management.inventory", {}))
    assert sorted(n["mac"] for n in inventory["nics"]) == sorted(SYSTEM_MACS)

    # A wrong credential: a typed failure naming the BMC call, the password nowhere.
    site.emulator.password, real = "not-the-password-123", site.emulator.password
    try:
        failed = await site.run("management.inventory", {})
    finally:
        site.emulator.password = real
    assert failed.state == "failed"
    assert failed.reason is not None
    assert failed.reason.startswith("DRIVER_ERROR")
    assert "401" in failed.reason
    assert "not-the-password-123" not in failed.reason

    # site.httpProxy to the cloud metadata address: refused, even when recorded as the node's.
    proxied = await site.cq.enqueue(
        EnqueueCommand(
            node_id=site.node,
            site_id=SITE,
            kind="site.httpProxy",
            key=f"wf:{site.wf}:99#1:proxy",
            workflow_id=site.wf,
            step=99,
            payload={"url": "http://169.254.169.254/latest/meta-data/", "nodeAddresses": ["169.254.169.254"]},
        )
    )
    refused = await site.settled(proxied.id)
    assert refused.state == "rejected"
    assert refused.reason is not None
    assert "ssrf-refused" in refused.reason

    # SIGTERM: a clean stop; a restart does not need the join token again.
    site.agent.signal(signal.SIGTERM)
    assert site.agent.proc is not None
    assert await asyncio.wait_for(asyncio.to_thread(site.agent.proc.wait), 20) == 0
    site.agent.token_file.unlink()
    site.agent.start()
    assert ok(await site.run("power.setPower", {"action": "off"}))["powerState"] == "Off"

    for secret in (real, "not-the-password-123"):
        basic = b64encode(f"{site.emulator.username}:{secret}".encode())  # an Authorization header
        for file in site.agent.files():
            data = file.read_bytes()
            assert secret.encode() not in data, file
            assert basic not in data, file


async def test_a_site_agent_killed_mid_command_never_runs_it_twice(site: Site) -> None:
    ok(await site.run("power.setPower", {"action": "on"}))
    before = site.resets()
    view = await site.enqueue("power.setPower", {"action": "cycle"})
    await until(lambda: site.resets() > before)  # the BMC got the reset: the agent now polls
    site.agent.kill()
    site.agent.start()
    final = await site.settled(view.id)
    assert final.state == "failed"
    assert final.reason is not None
    assert "interrupted" in final.reason
    # The agent is back and serves the next command; the cycle reached the BMC exactly once.
    ok(await site.run("management.inventory", {}))
    assert site.resets() == before + 1
    for file in site.agent.files():
        assert site.emulator.password.encode() not in file.read_bytes(), file


async def test_bcx_agents_list_shows_the_site_agents_drivers_cache_and_last_error(
    site: Site, bc_settings: Settings
) -> None:
    site.emulator.password, real = "not-the-password-456", site.emulator.password
    try:
        failed = await site.run("management.inventory", {})
    finally:
        site.emulator.password = real
    assert failed.state == "failed"

    async def listed() -> dict[str, Any] | None:
        out = await asyncio.to_thread(run_bcx, bc_settings, "agents", "list", "--site", SITE, "--json")
        assert out.returncode == 0, out.stderr
        [agent] = [a for a in json.loads(out.stdout)["agents"] if a["id"] == site.agent_id]
        status = agent.get("status") or {}
        return agent if "401" in (status.get("lastError") or "") else None  # the next heartbeat

    agent = await until(listed)
    status = agent["status"]
    assert {"redfish", "ipmi", "sim"} <= set(status["drivers"])
    assert status["cacheMaxBytes"] > 0
    assert status["cacheUsedBytes"] >= 0
    assert status["lastError"].startswith("management.inventory: DRIVER_ERROR")
    assert "not-the-password-456" not in json.dumps(agent)

    table = await asyncio.to_thread(run_bcx, bc_settings, "agents", "list", "--site", SITE)
    assert table.returncode == 0, table.stderr
    header, *rows = table.stdout.splitlines()
    assert all(col in header for col in ("DRIVERS", "CACHE", "LAST ERROR"))
    [row] = [r for r in rows if r.startswith(site.agent_id)]
    assert "redfish" in row
    assert "DRIVER_ERROR" in row


async def test_the_site_agent_runs_any_number_of_ipmi_commands_on_one_bmc(site: Site, tmp_path: Path) -> None:
    """Inspect's path over IPMI: a power read, the boot device, a power cycle, more reads, a power
    off, each its own command (a fresh driver and session). Regression: the driver logged out
    after each command and pyghmi handed that dead session to the next, which failed
    ``malformed answer (TypeError)`` without reaching the BMC."""
    site.ipmi = IpmiBmc(tmp_path / "ipmi").start()
    try:
        assert ok(await site.run("management.inventory", {}))["system"]["powerState"] == "off"
        assert ok(await site.run("management.setBootDevice", {"device": "pxe"}))["device"] == "pxe"
        assert ok(await site.run("power.setPower", {"action": "cycle"}))["powerState"] == "on"
        assert ok(await site.run("management.inventory", {}))["system"]["powerState"] == "on"
        assert ok(await site.run("management.setBootDevice", {"device": "disk", "persistent": True}))
        assert ok(await site.run("power.setPower", {"action": "off"}))["powerState"] == "off"
        assert ok(await site.run("management.inventory", {}))["system"]["powerState"] == "off"

        # Counted at the BMC: each change arrived once, and every command had its own session,
        # closed at its end (a BMC has few session slots).
        # (pyghmi cycles a machine that is off by powering it on)
        assert site.ipmi.state()["calls"] == ["bootdev:network", "on", "bootdev:hd", "off"]
        ipmi = site.ipmi

        def all_closed() -> list[str] | None:
            log = ipmi.requests()  # a logout's close-session may land just after the command
            opened = [line for line in log if line.startswith("open-session") and line.endswith("accepted")]
            closed = {line.split("session=")[1] for line in log if line.startswith("close-session")}
            used = {line.split("session=")[1] for line in log if "session=" in line}
            return log if len(opened) == len(used) == len(closed) >= 7 else None

        log = await until(all_closed, timeout=10, what="every session opened was closed")
        assert sum(line.startswith("chassis-control") for line in log) == 2, log
    finally:
        site.ipmi.close()


def _finished_at_agent(site: Site, command_id: str) -> bool:
    """The agent's own log says the command's handler ended (whatever its outcome)."""
    return any("command_finished" in line and command_id in line for line in site.agent.output().splitlines())


async def test_nothing_reaches_the_bmc_after_a_cancel_reached_the_site_agent(site: Site) -> None:
    """Issue 22, gap 1: with the BMC down, a cancelled boot-device command used to be retried by
    the agent and applied once the BMC came back. Counted at the BMC's request log: no PATCH
    after the cancel; the command is `cancelling` until the agent confirms, then `cancelled`."""
    ok(await site.run("management.setBootDevice", {"device": "disk"}))  # the BMC works; not PXE
    site.proxy.set(mode="error", status=500)  # the BMC is down
    start = len(site.proxy.requests())
    view = await site.enqueue("management.setBootDevice", {"device": "pxe"}, timeout_ms=120_000)
    await until(lambda: len(site.proxy.requests()) >= start + 2)  # the agent retries
    site.proxy.set(mode="hang", seconds=3)  # its next try is at the BMC while the cancel comes
    await until(lambda: any(line.endswith(" hang") for line in site.proxy.requests()[start:]))
    await site.cq.cancel(id=view.id, reason="workflow aborted")
    at_cancel = len(site.proxy.requests())
    state_after_cancel = (await site.cq.get(id=view.id)).state
    final = await site.settled(view.id)
    site.proxy.set(mode="forward")  # the BMC is back
    await until(lambda: _finished_at_agent(site, view.id), what="the agent ends the command")
    ok(await site.run("management.inventory", {}))
    after = site.proxy.requests()[at_cancel:]
    patches = [line for line in after if line.startswith("PATCH")]
    assert patches == [], after
    assert site.bmc()["Boot"]["BootSourceOverrideTarget"] == "Hdd"
    assert state_after_cancel == "cancelling"
    assert final.state == "cancelled", (final.state, final.reason)
    assert final.reason == "workflow aborted"
    assert final.progress is not None
    assert "the agent stopped: rejected" in final.progress, final.progress
    # the agent's last word: while its tries fail, that they do and how (issue 26), with the call
    assert re.match(
        r"BMC answers with errors at 127\.0\.0\.1:\d+: HTTP 500 \(PATCH System\.Boot\), \d+ tr",
        final.progress,
    ), final.progress


async def test_a_site_agent_killed_while_running_an_idempotent_command_runs_it_again(site: Site) -> None:
    """Issue 22, gap 7: a boot-device command whose agent was killed while it ran is run again
    at the agent's restart (its kind is idempotent), and succeeds; counted at the BMC."""
    ok(await site.run("power.setPower", {"action": "on"}))
    site.proxy.set(mode="hang", seconds=3)
    start = len(site.proxy.requests())
    view = await site.enqueue("management.setBootDevice", {"device": "pxe"})
    await until(lambda: any(line.endswith(" hang") for line in site.proxy.requests()[start:]))
    site.agent.kill()  # journaled started, at the BMC
    site.proxy.set(mode="forward")
    site.agent.start()
    final = await site.settled(view.id)
    assert final.state == "succeeded", (final.state, final.reason)
    assert site.bmc()["Boot"]["BootSourceOverrideTarget"] == "Pxe"
    patches = [line for line in site.proxy.requests()[start:] if line.startswith("PATCH")]
    assert len(patches) == 1, patches  # the killed run never got to its PATCH


async def test_a_site_agent_killed_while_running_a_destructive_command_fails_it_interrupted(
    site: Site,
) -> None:
    """Issue 22, gap 7: a destructive kind (driver.invoke) is never run again after a kill."""
    ok(await site.run("power.setPower", {"action": "on"}))
    site.steps += 1
    creds = json.dumps({"username": site.emulator.username, "password": site.emulator.password})
    ref = (
        await site.secrets.put(value=creds.encode(), tenant_id="root", workflow_id=site.wf, step=site.steps)
    ).ref
    bmc = {"driver": "redfish", "address": site.proxy.url, "credentialsRef": ref}
    site.proxy.set(mode="hang", seconds=3)
    start = len(site.proxy.requests())
    view = await site.cq.enqueue(
        EnqueueCommand(
            node_id=site.node,
            site_id=SITE,
            kind="driver.invoke",
            key=f"wf:{site.wf}:{site.steps}#1:driver.invoke",
            workflow_id=site.wf,
            step=site.steps,
            payload={"operation": "management.setBootDevice", "input": {"device": "cd", "bmc": bmc}},
            timeout_ms=60_000,
        )
    )
    await until(lambda: any(line.endswith(" hang") for line in site.proxy.requests()[start:]))
    site.agent.kill()
    site.proxy.set(mode="forward")
    site.agent.start()
    final = await site.settled(view.id)
    assert final.state == "failed", (final.state, final.reason)
    assert final.reason is not None
    assert "interrupted" in final.reason
    assert [line for line in site.proxy.requests()[start:] if line.startswith("PATCH")] == []
