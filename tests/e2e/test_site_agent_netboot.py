"""Network boot with a real iPXE client: QEMU's network ROM (Debian qemu-system-x86 and
ipxe-qemu, installed by scripts/bootstrap.sh) boots a VM on user-mode networking, whose DHCP
hands it the agent's first-stage script at 10.0.2.2 (QEMU's address for this machine's
loopback, where bc-site-agent listens). The first boot gets the one-time entry a command
installed and fetches its kernel from the site cache; the next boot falls through to local boot.
Never skipped: without QEMU this test fails."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import pytest_asyncio

from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.pki import PkiClient
from better_compute.config import Settings
from better_compute.core.ids import new_id
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses
from better_compute.testing.agents import until
from better_compute.testing.site_agent import SiteAgentProcess
from better_compute.wire.cmdq import TERMINAL_STATES, CommandView, EnqueueCommand

SITE = "site-boot"
MAC = "52:54:00:12:34:56"
LOCAL = "no boot entry for this machine: booting from local disk"
# An iPXE script as the "kernel": iPXE runs it as an image when the entry boots, and it says so.
KERNEL = b"#!ipxe\necho bc-test: the kernel from the site cache runs\nexit\n"


@pytest.fixture
def kernel_source() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(KERNEL)))
            self.end_headers()
            self.wfile.write(KERNEL)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/vmlinuz"
    server.shutdown()
    server.server_close()


@pytest_asyncio.fixture(loop_scope="session")
async def agent(
    bc_api: ApiClient, bc_processes: ServiceProcesses, bc_settings: Settings, tmp_path: Path
) -> AsyncIterator[SiteAgentProcess]:
    for service in ("bc-pki", "bc-command-queue"):
        bc_processes.start(service)
    await bc_processes.wait_ready()
    cq = CommandQueueClient(bc_api)
    token = await PkiClient(bc_api).issue_join_token(
        tenant_id="root", role="site", site_id=SITE, ttl_seconds=600
    )
    proc = SiteAgentProcess(
        folder=tmp_path / "site-agent",
        nats_url=bc_settings.nats_url or "",
        subject_root=bc_settings.subject_root,
        site_id=SITE,
    )
    proc.public_url = f"http://10.0.2.2:{proc.port}"
    proc.write_config(token.token)
    proc.start()
    try:
        await until(lambda: cq.agents(site_id=SITE, connected=True))
        yield proc
    finally:
        proc.close()
        print("--- site agent ---", proc.output()[-4000:], sep="\n")


def start_vm(qemu: str, serial: Path, bootfile: str) -> subprocess.Popen[bytes]:
    """A diskless VM whose NIC ROM is iPXE; DHCP (QEMU's user network) names ``bootfile``; a
    boot that fails reboots after 1 s."""
    with open(serial, "wb") as out:
        return subprocess.Popen(
            [
                qemu, "-machine", "pc", "-m", "128", "-nographic", "-no-user-config", "-nodefaults",
                "-display", "none", "-serial", "stdio",
                "-netdev", f"user,id=n0,bootfile={bootfile}",
                "-device", f"e1000,netdev=n0,mac={MAC}",
                "-boot", "order=n,reboot-timeout=1000",
            ],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip


def events(agent: SiteAgentProcess) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for line in agent.output().splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


async def test_a_real_ipxe_client_boots_its_entry_once_then_local_disk(
    bc_api: ApiClient, agent: SiteAgentProcess, kernel_source: str, tmp_path: Path
) -> None:
    qemu = shutil.which("qemu-system-x86_64")
    assert qemu, "qemu-system-x86_64 is missing: scripts/bootstrap.sh installs qemu-system-x86 and ipxe-qemu"
    cq = CommandQueueClient(bc_api)
    sha = hashlib.sha256(KERNEL).hexdigest()
    wf = new_id("wf")
    view = await cq.enqueue(
        EnqueueCommand(
            node_id=new_id("node"),
            site_id=SITE,
            kind="netboot.setEntry",
            key=f"wf:{wf}:1#1:netboot",
            workflow_id=wf,
            step=1,
            payload={
                "mac": MAC,
                "kernel": kernel_source,
                "kernelSha256": sha,
                "cmdline": "console=ttyS0 bc.test=1",
                "oneTime": True,
            },
        )
    )

    async def settled() -> CommandView | None:
        got = await cq.get(id=view.id)
        return got if got.state in TERMINAL_STATES else None

    done: CommandView = await until(settled)
    assert done.state == "succeeded", done.reason
    assert done.result is not None
    assert json.loads(done.result)["kernel"] == f"{agent.public_url}/cache/{sha}"

    serial = tmp_path / "serial.log"
    vm = start_vm(qemu, serial, f"{agent.url.replace('127.0.0.1', '10.0.2.2')}/boot.ipxe")
    try:

        def booted_twice() -> bool:
            names = [e.get("event") for e in events(agent)]
            if "netboot_entry_served" not in names:
                return False
            first = names.index("netboot_entry_served")
            rest = names[first:]
            if "cache_served" not in rest:
                return False
            if "netboot_local_boot_served" not in rest[rest.index("cache_served") :]:
                return False
            # the agent logs before iPXE prints what it got: wait for the screen too
            return LOCAL in serial.read_text(errors="replace")

        await until(lambda: booted_twice() or vm.poll() is not None)
        assert vm.poll() is None, serial.read_text(errors="replace")
    finally:
        vm.kill()
        vm.wait(10)
    screen = serial.read_text(errors="replace")
    assert f"boot entry for {MAC}" in screen
    assert "bc-test: the kernel from the site cache runs" in screen
    assert LOCAL in screen
    served = [e for e in events(agent) if e.get("event") == "netboot_entry_served"]
    assert len(served) == 1  # one-time: consumed by the first boot
