"""Per-agent NATS identities as deployed (issue 23 items 1 and 2): the committed deploy/nats configs
with TLS on, bc-pki as its own process on the hub, and the eu1 leaf's auth callout answered by
``bc-pki callout`` as its own process, asking that bc-pki about every certificate.

A machine joins through the site's joining identity, connects with the certificate it got as
itself, and is cut off the moment an operator revokes the certificate.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio
from cryptography.hazmat.primitives import serialization

from bcd.bus import carried_bus
from bcd.configdrive import ConfigDrive, write_config_drive
from better_compute.agent.identity import Enrollment, enroll
from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.pki import PkiClient
from better_compute.config import Settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id
from better_compute.runtime.embedded import free_port
from better_compute.service.client import CONNECT_TRIES, ApiClient
from better_compute.testing.bcd import BcdProcess, run_bcd
from better_compute.testing.databases import DatabaseFactory
from better_compute.testing.machines import DiskSpec, prepare_machine
from better_compute.testing.processes import ServiceProcesses
from better_compute.testing.waiting import until
from better_compute.wire import unwrap
from better_compute.wire.cmdq import AgentView, EnqueueCommand
from deploy_stack import SUBJECTS, Stack, eventually, run_stack


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def stack(
    tmp_path_factory: pytest.TempPathFactory, bc_database_factory: DatabaseFactory
) -> AsyncIterator[Stack]:
    """The hub, bc-pki and the command queue on it (their own users, TLS), then the leaf made
    with bc-pki's CA, and the leaf's responder: one for the module's tests (they share no
    agents)."""
    tmp_path = tmp_path_factory.mktemp("deploy-callout")
    bc_database_url = await bc_database_factory.clone()
    async with run_stack(tmp_path, leaf=False) as st:
        settings = Settings(
            nats_url=f"tls://pki:{st.passwords['PKI']}@127.0.0.1:{st.hub[0].client_port}",
            database_url=bc_database_url,
            state_dir=str(tmp_path / "state"),
        )
        (tmp_path / "logs").mkdir()
        procs = ServiceProcesses(settings, tmp_path / "logs", env={"BC_NATS_CA": str(st.ca)})
        cmdq_url = f"tls://command-queue:{st.passwords['COMMAND_QUEUE']}@127.0.0.1:{st.hub[1].client_port}"
        cmdq = ServiceProcesses(
            msgspec.structs.replace(settings, nats_url=cmdq_url),
            tmp_path / "logs",
            # the site's streams on its leaf, as deploy/bc.example.toml says
            env={"BC_NATS_CA": str(st.ca), "BC_CMDQ_SITE_DOMAIN": "{site}"},
        )
        try:
            procs.start("bc-pki")
            cmdq.start("bc-command-queue")
            alice = await st.connect("alice")
            ca = await eventually("bc-pki answers", lambda: PkiClient(ApiClient(alice)).ca())
            st.start_leaf(ca.certificate_pem.encode())
            await st.leaf_up()
            st.start_responder()
            await st.responder_ready()
            yield st
        finally:
            procs.close()
            cmdq.close()
            for p in procs.procs + cmdq.procs:
                print(f"--- {p.service} ---", *p.output().splitlines()[-30:], sep="\n")
            await bc_database_factory.drop([bc_database_url.rsplit("/", 1)[1]])


async def _join(st: Stack, role: str = "node") -> Enrollment:
    engine = await st.connect("engine")
    token = await PkiClient(ApiClient(engine)).issue_join_token(
        tenant_id="root",
        role=role,
        site_id="eu1",
        ttl_seconds=600,  # type: ignore[arg-type]
    )
    joining = await st.connect_joining()
    try:
        return await enroll(PkiClient(ApiClient(joining)), token=token.token, site_id="eu1")
    finally:
        await joining.close()


def _fetch(url: str) -> Awaitable[bytes]:
    def get() -> bytes:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bytes(resp.read())

    return asyncio.to_thread(get)


def _tls(st: Stack, who: Enrollment) -> ssl.SSLContext:
    key = who.private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return st.client_tls(who.agent_id, who.certificate_pem.encode(), key)


async def test_a_revoked_agent_is_cut_off_at_once(stack: Stack) -> None:
    """Issue 23: a revoked agent kept its NATS connection (and a new one) for as long as its
    user lived. Now the responder hears the revocation and the leaf drops the connection; a new
    connection with that certificate is refused."""
    node = await _join(stack)
    gone = asyncio.Event()
    cut_at: list[float] = []

    async def disconnected() -> None:
        cut_at.append(time.monotonic())
        gone.set()

    agent = await stack.connect_agent(
        node.agent_id, _tls(stack, node), allow_reconnect=False, disconnected_cb=disconnected
    )
    # it is itself on the bus: the command queue hears (and refuses: unsigned) its hello
    hello = SUBJECTS.agent_event("eu1", node.agent_id, "hello")
    with pytest.raises(BcError) as said:
        unwrap((await agent.request(hello, b"{}", timeout=5)).data)
    assert said.value.code is ErrorCode.INVALID_INPUT

    alice = await stack.connect("alice")
    revoked_at = time.monotonic()
    await PkiClient(ApiClient(alice)).revoke_certificate(cert_id=node.cert_id, reason="test")
    await asyncio.wait_for(gone.wait(), timeout=10)
    print(
        f"cut off {cut_at[0] - revoked_at:.3f} s from the start of the revoke call"
    )  # measured, not asserted
    assert agent.is_closed or not agent.is_connected
    with pytest.raises(BcError) as err:
        await stack.connect_agent(node.agent_id, _tls(stack, node), allow_reconnect=False)
    assert err.value.code is ErrorCode.UNAUTHENTICATED


async def test_the_site_agent_and_bcd_join_and_connect_as_themselves(stack: Stack, tmp_path: Path) -> None:
    """Issue 23 items 3 and 4: the site agent and bcd, as their own processes, join through the
    site's joining identity and then connect to the TLS-only leaf with the certificate bc-pki gave
    them, each as a NATS user of its own (no password of theirs is in the leaf's config). bcd gets
    the bus CA and the joining certificate through the boot path (the kernel line's bcd.bus= and
    bcd.bus_ca_sha256=, the files from the site agent's HTTP port), and refuses a CA whose digest
    is not the kernel line's. A revoked bcd is cut off and cannot come back."""
    agents = CommandQueueClient(ApiClient(await stack.connect("alice")))
    engine = PkiClient(ApiClient(await stack.connect("engine")))
    assert stack.callout is not None
    leaf = f"tls://127.0.0.1:{stack.leaf.client_port}"

    # the site agent: its token, the bus CA and the site's joining certificate, nothing more
    site_token = await engine.issue_join_token(tenant_id="root", role="site", site_id="eu1", ttl_seconds=600)
    folder = tmp_path / "site-agent"
    folder.mkdir()
    http_port = free_port()
    (folder / "token").write_text(site_token.token)
    (folder / "site-agent.toml").write_text(
        f'site_id = "eu1"\nnats_url = "{leaf}"\nnats_ca = "{stack.ca}"\nstate_dir = "{folder / "state"}"\n'
        f'join_token_file = "{folder / "token"}"\nhttp_listen = "127.0.0.1:{http_port}"\n'
        f'join_cert_file = "{stack.callout.joining_cert}"\njoin_key_file = "{stack.callout.joining_key}"\n'
    )
    with (folder / "agent.log").open("wb") as log:
        site_agent = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bc_site_agent", "--config", str(folder / "site-agent.toml"),
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    # bcd on a machine: the boot path's kernel line names the site agent's bus files and the
    # bus CA's digest; bcd has nothing else (no BC_NATS_CA, no joining certificate of its own)
    node_token = await engine.issue_join_token(
        tenant_id="root", role="discovery", site_id="eu1", ttl_seconds=600
    )
    bus_url = f"http://127.0.0.1:{http_port}/bus"
    digest = hashlib.sha256(stack.ca.read_bytes()).hexdigest()
    root = prepare_machine(tmp_path / "machine")
    (root / "proc" / "cmdline").write_text(f"quiet bcd.bus={bus_url} bcd.bus_ca_sha256={digest}\n")
    (root / "join-token").write_text(node_token.token)  # bcd reads it under its machine's root
    settings = Settings(nats_url=leaf)
    bcd: BcdProcess | None = None
    try:
        await eventually("the site agent serves the bus CA", lambda: _fetch(f"{bus_url}/ca.pem"))
        # a kernel line whose digest is not the CA's: refused before any connection
        wrong = prepare_machine(tmp_path / "wrong")
        (wrong / "proc" / "cmdline").write_text(f"bcd.bus={bus_url} bcd.bus_ca_sha256={'0' * 64}\n")
        (wrong / "join-token").write_text(node_token.token)
        refused = await run_bcd(
            settings, wrong, "join", "--control-plane", leaf, "--token-file", "/join-token", "--no-service"
        )
        assert refused.returncode != 0
        assert "bcd.bus_ca_sha256" in refused.stderr
        assert f"has SHA-256 {digest}" in refused.stderr, refused.stderr

        joined = await run_bcd(
            settings, root, "join", "--control-plane", leaf, "--token-file", "/join-token", "--no-service"
        )
        assert joined.returncode == 0, joined.stdout + joined.stderr
        node_id = json.loads(joined.stdout.splitlines()[-1])["nodeId"]
        bcd = BcdProcess.start(settings, root, "--control-plane", leaf, log=tmp_path / "bcd.log")

        async def both_connected() -> list[AgentView] | None:
            found = await agents.agents(site_id="eu1", connected=True)
            return (
                found
                if {a.role for a in found} >= {"site", "discovery"} and node_id in {a.id for a in found}
                else None
            )

        connected = await eventually("both agents connected", both_connected, timeout=60)
        assert {a.role for a in connected} == {"site", "discovery"}

        # a command through the deployed bus: delivered into the site's stream on its leaf, run
        # by the site agent, its result stored on the leaf and read back by the command queue
        site_agent_id = next(a.id for a in connected if a.role == "site")
        queue = CommandQueueClient(ApiClient(await stack.connect("engine")))
        sent = await queue.enqueue(
            EnqueueCommand(
                node_id=new_id("node"), site_id="eu1", kind="power.setPower", key="deployed-bus",
                payload={"action": "on", "bmc": {"driver": "sim", "address": "10.0.0.9"}},
            )
        )  # fmt: skip
        done = await queue.wait(id=sent.id, timeout=60)
        assert (done.state, done.agent_id) == ("succeeded", site_agent_id), done

        # revoked: bcd's connection goes, and it is refused when it comes back
        node_cert = next(c for c in await engine.list_certificates(agent_id=node_id) if c.agent_id == node_id)
        await PkiClient(ApiClient(await stack.connect("alice"))).revoke_certificate(cert_id=node_cert.cert_id)

        async def cut_off() -> bool | None:
            text = (stack.folder / "callout.log").read_text()
            gone = node_id not in {a.id for a in await agents.agents(site_id="eu1", connected=True)}
            return True if gone and "the certificate is revoked" in text and "agent_cut_off" in text else None

        await eventually("bcd cut off and refused", cut_off, timeout=20)
    finally:
        if bcd is not None:
            bcd.close()
        if site_agent.returncode is None:
            site_agent.terminate()
            await asyncio.wait_for(site_agent.wait(), 10)
        print("--- site agent ---", (folder / "agent.log").read_text(errors="replace")[-3000:])
        print("--- bcd ---", (tmp_path / "bcd.log").read_text(errors="replace")[-3000:] if bcd else "")


async def test_a_restarted_responder_still_cuts_off_a_connection_it_did_not_let_in(stack: Stack) -> None:
    """The responder restarts (a deploy, a crash) while an agent stays connected; the agent's
    certificate is revoked afterwards. The new responder never let that connection in, and it is
    still cut off: it asks the leaf which connections hold the certificate."""
    node = await _join(stack)
    gone = asyncio.Event()

    async def disconnected() -> None:
        gone.set()

    agent = await stack.connect_agent(
        node.agent_id, _tls(stack, node), allow_reconnect=False, disconnected_cb=disconnected
    )
    await agent.flush(timeout=5)
    assert stack.responder is not None
    stack.responder.kill()
    stack.responder.wait(10)
    stack.start_responder()
    await stack.responder_ready()
    await agent.flush(timeout=5)  # still connected, as nothing has asked the leaf otherwise
    alice = await stack.connect("alice")
    await PkiClient(ApiClient(alice)).revoke_certificate(cert_id=node.cert_id, reason="test")
    await asyncio.wait_for(gone.wait(), timeout=10)


async def test_a_revocation_while_the_responder_is_away_is_swept_when_it_starts(stack: Stack) -> None:
    """Issue 23: an agent whose certificate was revoked while no responder listened (stopped, or
    its leaf link down) kept its connection until its NATS user expired, up to an hour: nobody
    heard the revocation. Now a starting responder sweeps the leaf's connections, asks bc-pki
    afresh about each one's certificate and cuts off the revoked ones."""
    node = await _join(stack)
    gone = asyncio.Event()
    cut_at: list[float] = []

    async def disconnected() -> None:
        cut_at.append(time.monotonic())
        gone.set()

    agent = await stack.connect_agent(
        node.agent_id, _tls(stack, node), allow_reconnect=False, disconnected_cb=disconnected
    )
    await agent.flush(timeout=5)
    assert stack.responder is not None
    stack.responder.kill()
    stack.responder.wait(10)
    try:
        alice = await stack.connect("alice")
        await PkiClient(ApiClient(alice)).revoke_certificate(cert_id=node.cert_id, reason="test")
        await agent.flush(timeout=5)  # nobody heard it: still connected
        assert not gone.is_set()
    finally:
        started_at = time.monotonic()
        stack.start_responder()
    await stack.responder_ready()
    await asyncio.wait_for(gone.wait(), timeout=15)
    print(f"cut off {cut_at[0] - started_at:.3f} s after the responder process was started")  # measured
    assert "agent_cut_off" in (stack.folder / "callout.log").read_text()


async def test_bcd_joined_with_a_held_token_connects_once_the_site_agent_confirms_it(
    stack: Stack, tmp_path: Path
) -> None:
    """Issue 23: the ramdisk's token is held, so bcd's certificate is ``pending`` until the site
    agent reports the boot entry closed clean, and the leaf's responder admits only a ``valid``
    one: bcd is refused at first. It keeps trying (with backoff, without exiting) and connects
    as itself, and says hello, once the site agent confirms the token."""
    leaf = f"tls://127.0.0.1:{stack.leaf.client_port}"
    assert stack.callout is not None
    agents = CommandQueueClient(ApiClient(await stack.connect("alice")))
    engine = PkiClient(ApiClient(await stack.connect("engine")))
    node_id = new_id("node")
    held = await engine.issue_join_token(
        tenant_id="root", role="node", site_id="eu1", ttl_seconds=600, node_id=node_id, held=True
    )
    root = prepare_machine(tmp_path / "machine")
    (root / "join-token").write_text(held.token)
    settings = Settings(nats_url=leaf)
    env = {
        "BC_NATS_CA": str(stack.ca),
        "BC_NATS_JOIN_CERT": str(stack.callout.joining_cert),
        "BC_NATS_JOIN_KEY": str(stack.callout.joining_key),
    }
    joined = await run_bcd(
        settings, root, "join", "--control-plane", leaf, "--token-file", "/join-token", "--no-service",
        extra_env=env,
    )  # fmt: skip
    assert joined.returncode == 0, joined.stdout + joined.stderr
    assert json.loads(joined.stdout.splitlines()[-1])["nodeId"] == node_id
    cert = next(c for c in await engine.list_certificates(agent_id=node_id) if c.agent_id == node_id)
    assert cert.state == "pending"

    callout_log = stack.folder / "callout.log"
    refusals_before = callout_log.read_text().count("connection_refused")
    bcd = BcdProcess.start(settings, root, "--control-plane", leaf, log=tmp_path / "bcd.log", extra_env=env)
    try:

        def running() -> None:
            assert bcd.proc.poll() is None, f"bcd exited ({bcd.proc.returncode}):\n{bcd.output()[-3000:]}"

        async def refused_while_pending() -> bool | None:
            running()
            refusals = callout_log.read_text().count("connection_refused") - refusals_before
            # more refusals than one first connection tries: bcd came back after being refused
            return True if refusals > CONNECT_TRIES else None

        await until(refused_while_pending, timeout=15, interval=0.2, what="the responder refuses bcd again")
        running()
        said = callout_log.read_text().split("\n")
        refusals = [line for line in said if "connection_refused" in line]
        assert refusals
        assert all("the certificate is pending" in line for line in refusals[-CONNECT_TRIES:])
        assert node_id not in {a.id for a in await agents.agents(site_id="eu1", connected=True)}

        # the site agent's report that the boot entry closed clean, as bc_site_agent.reports sends it
        site = await _join(stack, role="site")
        site_nc = await stack.connect_agent(site.agent_id, _tls(stack, site))
        confirmed = await PkiClient(ApiClient(site_nc)).confirm_join_token(
            identity=site.identity, token_sha256=hashlib.sha256(held.token.encode()).hexdigest(),
            mac="52:54:00:12:34:56",
        )  # fmt: skip
        assert confirmed.cert_ids == [cert.cert_id]

        async def connected_as_itself() -> bool | None:
            running()
            found = await agents.agents(site_id="eu1", connected=True)
            return True if node_id in {a.id for a in found} else None

        await until(connected_as_itself, timeout=20, interval=0.3, what="bcd connected and said hello")
        running()
        # the command queue marks it connected at its hello, bcd logs it when the answer is back
        await until(lambda: "agent_connected" in bcd.output(), timeout=10, what="bcd's agent_connected")
    finally:
        bcd.close()
        print("--- bcd ---", bcd.output()[-3000:])


def _image_with_one_partition(disk: Path, size: int) -> int:
    """An OS image's bytes at the start of ``disk``: an MBR with one Linux partition (1-3 MiB);
    how much the image is."""
    mbr = bytearray(512)
    mbr[446 + 4] = 0x83
    mbr[446 + 8 : 446 + 16] = (2048).to_bytes(4, "little") + (4096).to_bytes(4, "little")
    mbr[510:512] = b"\x55\xaa"
    with disk.open("wb") as fh:
        fh.write(mbr)
        fh.truncate(size)
    return 3 << 20


async def test_the_installed_os_joins_with_the_bus_files_its_config_drive_carries(
    stack: Stack, tmp_path: Path
) -> None:
    """Issue 23: the installed OS boots from its disk, without the site agent's bcd.bus= kernel
    words, and its bcd had no bus CA or joining certificate: on a TLS-only leaf its join failed
    unless BC_NATS_CA and BC_NATS_JOIN_CERT/KEY were set by hand. The ramdisk's bcd, which got
    them through the boot path, now puts them on the config drive it writes after the image
    (bcd-bus.json), and the installed OS's bcd join takes them from there."""
    assert stack.callout is not None
    leaf = f"tls://127.0.0.1:{stack.leaf.client_port}"
    # the ramdisk's state folder, as fetch_bus_files left it from the site agent's /bus files
    ramdisk = tmp_path / "ramdisk-state"
    ramdisk.mkdir()
    (ramdisk / "bus-ca.pem").write_bytes(stack.ca.read_bytes())
    (ramdisk / "join.pem").write_bytes(
        stack.callout.joining_cert.read_bytes() + stack.callout.joining_key.read_bytes()
    )
    # the installed OS: the image and the config drive bcd wrote after it on its disk; its
    # kernel line is the image's own, with no bcd.* words; no BC_NATS_* in its environment
    root = prepare_machine(tmp_path / "installed", disks=(DiskSpec("vda", size=16 << 20),), root_disk="vda")
    disk = root / "dev" / "vda"
    written = _image_with_one_partition(disk, 16 << 20)
    fd = os.open(disk, os.O_RDWR)
    try:
        drive = ConfigDrive(user_data=b"#cloud-config\n{}\n", node_id="node_x", bus=carried_bus(ramdisk))
        write_config_drive(fd, drive, image_bytes=written)
    finally:
        os.close(fd)
    (root / "proc" / "cmdline").write_text("console=ttyS0 root=/dev/vda1\n")
    token = await PkiClient(ApiClient(await stack.connect("engine"))).issue_join_token(
        tenant_id="root", role="discovery", site_id="eu1", ttl_seconds=600
    )
    (root / "join-token").write_text(token.token)
    joined = await run_bcd(
        Settings(nats_url=leaf), root, "join", "--control-plane", leaf, "--token-file", "/join-token",
        "--no-service",
    )  # fmt: skip
    assert joined.returncode == 0, joined.stdout + joined.stderr
    assert json.loads(joined.stdout.splitlines()[-1])["nodeId"].startswith("node_")
    kept = root / "var/lib/bcd/bus-ca.pem"
    assert kept.read_bytes() == stack.ca.read_bytes()
