"""bcd as its own OS process against bc-pki and bc-command-queue processes, on prepared trees.

Joins with hardware claims (refused, accepted, re-keyed, discovered), the command line the
built-in user data runs, and node commands whose results the command-queue checks (attested):
the ramdisk and the installed OS serve different kinds and sign every result, a refusal too, the
same way (each signature checked here against the node's certificate as well).
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import http.server
import json
import os
import shlex
import shutil
import socket
import sqlite3
import stat
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
import pytest_asyncio
from cryptography import x509

from better_compute.agent import result_document
from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.pki import PkiClient
from better_compute.config import Settings
from better_compute.core.ids import new_id
from better_compute.provision.templates import UserData, template_variables
from better_compute.provision.userdata import cloud_init, ignition
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses
from better_compute.testing.agents import until
from better_compute.testing.bcd import BcdProcess, bcd_env, run_bcd
from better_compute.testing.machines import DiskSpec, prepare_machine
from better_compute.wire.cmdq import EnqueueCommand

pytestmark = pytest.mark.e2e

SITE = "site-a"
UUID = "4c4c4544-0042-3510-8052-b4c04f4e3432"
FAST_ENV = {"BC_CMDQ_HEARTBEAT": "200ms", "BC_CMDQ_SWEEP": "100ms", "BC_CMDQ_REDELIVER_AFTER": "1s"}


@dataclass
class Stack:
    settings: Settings
    pki: PkiClient
    cq: CommandQueueClient
    tmp: Path

    def tree(self, name: str, **kw: Any) -> Path:
        return prepare_machine(self.tmp / name, **kw)

    async def token(self, *, role: str = "provisioned", node_id: str | None = None, **expect: str) -> Any:
        return await self.pki.issue_join_token(
            tenant_id="root", role=role, site_id=SITE, ttl_seconds=600, node_id=node_id,  # type: ignore[arg-type]
            expect=expect or None,
        )  # fmt: skip

    async def join(self, root: Path, token: str, *extra: str) -> Any:
        (root / "etc/bcd").mkdir(parents=True, exist_ok=True)
        (root / "etc/bcd/join-token").write_text(token + "\n")
        return await run_bcd(
            self.settings, root, "join", "--control-plane", "https://gw.example.test",
            "--token-file", "/etc/bcd/join-token", *extra,
        )  # fmt: skip


@pytest_asyncio.fixture(loop_scope="session")
async def stack(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> AsyncIterator[Stack]:
    bc_processes.extra_env.update(FAST_ENV)
    bc_processes.start("bc-pki")
    bc_processes.start("bc-command-queue")
    await bc_processes.wait_ready()
    yield Stack(bc_settings, PkiClient(bc_api), CommandQueueClient(bc_api, timeout=5.0), tmp_path)


def _enrollment(root: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((root / "var/lib/bcd/enrollment.json").read_text())
    return doc


async def test_join_is_refused_with_other_claims_unspent_then_accepted_then_rekeyed(stack: Stack) -> None:
    node = new_id("node")
    root = stack.tree("m1", product_uuid=UUID, serial="SER-1", macs=("52:54:00:00:00:01",))
    other = await stack.token(node_id=node, productUuid="11111111-2222-3333-4444-555555555555")
    refused = await stack.join(root, other.token, "--node", node)
    assert refused.returncode == 1
    assert "PERMISSION_DENIED" in refused.stderr, refused.stderr
    assert '["productUuid"]' in refused.stderr, refused.stderr
    assert other.token not in refused.stderr + refused.stdout
    assert (await stack.pki.get_join_token(join_token_id=other.join_token_id)).uses == 0  # not spent
    assert not (root / "var/lib/bcd/enrollment.json").exists()
    assert (root / "etc/bcd/join-token").exists()  # kept for the right machine

    right = await stack.token(node_id=node, productUuid=UUID, mac="52:54:00:00:00:01", serial="SER-1")
    done = await stack.join(root, right.token, "--node", node)
    assert done.returncode == 0, done.stderr
    joined = json.loads(done.stdout)
    assert (joined["nodeId"], joined["role"]) == (node, "provisioned")
    key_file = root / "var/lib/bcd/enrollment.json"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert (root / "var/lib/bcd/node.crt").read_text().startswith("-----BEGIN CERTIFICATE-----")
    assert not (root / "etc/bcd/join-token").exists()  # spent: removed
    first = _enrollment(root)
    certs = await stack.pki.list_certificates(agent_id=node)
    assert [c.cert_id for c in certs] == [first["certId"]]

    # the installed OS joins again with a fresh provisioned token: same node, new key
    again = await stack.token(node_id=node, productUuid=UUID)
    rekey = await stack.join(root, again.token, "--node", node)
    assert rekey.returncode == 0, rekey.stderr
    second = _enrollment(root)
    assert second["agentId"] == node
    assert second["certId"] != first["certId"]
    assert second["privateKeyPem"] != first["privateKeyPem"]


def _join_in_background(stack: Stack, root: Path, node: str, log: Path) -> subprocess.Popen[bytes]:
    """The user data's ``bcd join`` (its default wait), as its own process."""
    argv = [sys.executable, "-m", "bcd", "join", "--control-plane", "https://gw.example.test",
            "--token-file", "/etc/bcd/join-token", "--node", node, "--no-service"]  # fmt: skip
    with log.open("wb") as out:
        return subprocess.Popen(
            argv,
            env=bcd_env(stack.settings, root),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


async def test_a_join_while_no_bc_pki_answers_waits_and_joins_once_it_answers(
    stack: Stack, bc_processes: ServiceProcesses
) -> None:
    # the installed OS runs bcd join once (its user data); booted while its site is cut off from
    # the hub, its leaf answers and bc-pki does not: it asked once and gave up, and the machine
    # never joined (tests/e2e/test_site_cut.py, ledger 'bcd.join-failed')
    node = new_id("node")
    root = stack.tree("cut", product_uuid=UUID, serial="SER-1", macs=("52:54:00:00:00:01",))
    token = await stack.token(node_id=node, productUuid=UUID)
    for p in bc_processes.procs:
        if p.service == "bc-pki":
            p.kill()
    (root / "etc/bcd").mkdir(parents=True, exist_ok=True)
    (root / "etc/bcd/join-token").write_text(token.token + "\n")
    log = stack.tmp / "join.log"
    joining = _join_in_background(stack, root, node, log)
    try:
        await until(lambda: "bcd_join_waiting" in log.read_text(), timeout=30, what="bcd join waiting")
        assert joining.poll() is None, log.read_text()
        bc_processes.start("bc-pki")
        await bc_processes.wait_ready()
        code = await asyncio.to_thread(joining.wait, 60)
    finally:
        if joining.poll() is None:
            joining.kill()
            joining.wait(10)
    assert code == 0, log.read_text()
    assert _enrollment(root)["agentId"] == node
    assert token.token not in log.read_text()


async def test_a_discovery_token_registers_an_unknown_machine(stack: Stack) -> None:
    root = stack.tree("disc")
    token = await stack.token(role="discovery")
    (root / "proc/cmdline").write_text(f"console=ttyS0 bcd.token={token.token} bcd.control_plane=nats://x\n")
    done = await run_bcd(stack.settings, root, "join")
    assert done.returncode == 0, done.stderr
    joined = json.loads(done.stdout)
    assert joined["role"] == "discovery"
    assert joined["nodeId"].startswith("node_")  # node commands reach it by that id
    (audit,) = await stack.pki.list_joins(join_token_id=token.join_token_id)
    assert audit.claims is not None
    assert audit.claims.product_uuid == UUID  # the discovered machine's claims are on record


def _cloud_init_join(doc: str, root: Path) -> list[str]:
    assert doc.startswith("#cloud-config\n")
    body = json.loads(doc.split("\n", 1)[1])
    for f in body["write_files"]:  # what cloud-init writes before runcmd
        target = root / f["path"].lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(f["content"])
        os.chmod(target, int(f["permissions"], 8))
    (line,) = [c for c in body["runcmd"] if " join " in c]
    return shlex.split(line)


def _ignition_join(doc: str, root: Path) -> list[str]:
    body = json.loads(doc)
    script = ""
    for f in body["storage"]["files"]:
        text = unquote(f["contents"]["source"].removeprefix("data:,"))
        target = root / f["path"].lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        if f["path"] == "/usr/local/sbin/bcd-install":
            script = text
    (line,) = [c for c in script.splitlines() if " join " in c]
    return shlex.split(line)


@pytest.mark.parametrize("kind", ["cloud-init", "ignition"])
async def test_the_built_in_user_data_runs_a_join_this_bcd_accepts(stack: Stack, kind: str) -> None:
    node = new_id("node")
    root = stack.tree(kind)
    token = await stack.token(node_id=node, productUuid=UUID)
    settings = UserData(
        control_plane_url="https://gw.eu-1.example.test", bcd_url="https://dl.example.test/bcd",
        bcd_sha256="0" * 64,
    )  # fmt: skip
    variables = template_variables(node_id=node, join_token=token.token, user_data=settings)
    render = cloud_init if kind == "cloud-init" else ignition
    argv = (_cloud_init_join if kind == "cloud-init" else _ignition_join)(render(variables), root)  # type: ignore[arg-type]
    assert argv[:2] == ["/usr/local/bin/bcd", "join"]
    done = await run_bcd(stack.settings, root, *argv[1:])
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["nodeId"] == node
    saved = json.loads((root / "var/lib/bcd/control-plane.json").read_text())
    assert saved["controlPlane"] == "https://gw.eu-1.example.test"
    # the join installs the unit that runs bcd from now on (deploy/systemd/bcd.service)
    unit = (root / "etc/systemd/system/bcd.service").read_text()
    assert unit == (Path(__file__).parents[2] / "deploy/systemd/bcd.service").read_text()
    assert "ExecStart=/usr/local/bin/bcd run" in unit


@pytest.fixture
def cache() -> Iterator[tuple[Path, str]]:
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="bcd-cache-"))
    handler = lambda *a, **kw: http.server.SimpleHTTPRequestHandler(*a, directory=str(folder), **kw)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield folder, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    shutil.rmtree(folder)


def command(node: str, kind: str, payload: dict[str, Any], key: str) -> EnqueueCommand:
    return EnqueueCommand(node_id=node, site_id=SITE, kind=kind, payload=payload, key=key, target="node")


def _signed_by_the_node(root: Path, node: str, view: Any) -> bool:
    """The result bcd journaled for ``view`` carries the node key's signature over what the
    command-queue recorded (the same document in every mode)."""
    with sqlite3.connect(root / "var/lib/bcd/journal.db") as db:
        status, result, signature = db.execute(
            "SELECT status, result, signature FROM commands WHERE id = ?", (view.id,)
        ).fetchone()
    assert (status, bytes(result or b"")) == (view.state, view.result or b"")
    cert = x509.load_pem_x509_certificate((root / "var/lib/bcd/node.crt").read_bytes())
    document = result_document(command_id=view.id, node_id=node, status=status, result=bytes(result or b""))
    cert.public_key().verify(signature, document)  # type: ignore[union-attr,call-arg]
    return True


async def _serving(stack: Stack, root: Path, node: str, mode: str, bcds: list[BcdProcess]) -> None:
    token = await stack.token(node_id=node, productUuid=UUID)
    done = await stack.join(root, token.token, "--node", node)
    assert done.returncode == 0, done.stderr
    bcd = BcdProcess.start(stack.settings, root, "--mode", mode, log=root.parent / f"{node}.log")
    bcds.append(bcd)

    async def connected() -> bool:
        assert bcd.proc.poll() is None, bcd.output()
        return any(a.id == node and a.connected for a in await stack.cq.agents(site_id=SITE))

    await until(connected)


async def test_the_ramdisk_inventories_wipes_and_writes_with_node_signed_results(
    stack: Stack, bcds: list[BcdProcess], cache: tuple[Path, str]
) -> None:
    folder, base = cache
    node = new_id("node")
    root = stack.tree("ram", disks=(DiskSpec("vdb", size=16 << 20), DiskSpec("vdc", size=16 << 20)))
    await _serving(stack, root, node, "ramdisk", bcds)
    cq = stack.cq

    inv = await cq.wait(id=(await cq.enqueue(command(node, "node.inventory", {}, "inv"))).id, timeout=30)
    assert (inv.state, inv.attested) == ("succeeded", True)
    found = json.loads(inv.result or b"{}")
    assert [d["name"] for d in found["disks"]] == ["vdb", "vdc"]
    assert found["productUuid"] == UUID

    (root / "dev/vdb").write_bytes(b"\x55" * (16 << 20))
    wipe = await cq.wait(
        id=(await cq.enqueue(command(node, "node.wipe", {"disks": ["/dev/vdb"]}, "wipe"))).id, timeout=30
    )
    assert (wipe.state, wipe.attested) == ("succeeded", True), wipe.reason
    assert json.loads(wipe.result or b"{}")["disks"][0]["disk"] == "/dev/vdb"
    assert (root / "dev/vdb").read_bytes()[: 1 << 20] == bytes(1 << 20)

    raw = (b"\xeb\x63\x90" + bytes(509)) + os.urandom(3 << 20)
    (folder / "good.raw.gz").write_bytes(gzip.compress(raw))
    good = {"url": f"{base}/good.raw.gz", "sha256": hashlib.sha256(gzip.compress(raw)).hexdigest()}
    good["sha256"] = hashlib.sha256((folder / "good.raw.gz").read_bytes()).hexdigest()
    write = await cq.wait(
        id=(
            await cq.enqueue(
                command(node, "node.imageWrite", {**good, "format": "raw.gz", "disk": "/dev/vdc"}, "w1")
            )
        ).id,
        timeout=60,
    )
    assert (write.state, write.attested) == ("succeeded", True), write.reason
    assert (root / "dev/vdc").read_bytes()[: len(raw)] == raw

    # the last byte flipped (it was set to 0, which random data already is once in 256 runs: then
    # the "bad" image was the good one, and its write succeeded in a fresh-clone CI run)
    bad_raw = raw[:-1] + bytes([raw[-1] ^ 0xFF])
    (folder / "bad.raw").write_bytes(bad_raw)
    expected = hashlib.sha256(raw).hexdigest()
    actual = hashlib.sha256(bad_raw).hexdigest()
    bad = await cq.wait(
        id=(await cq.enqueue(command(node, "node.imageWrite", {"url": f"{base}/bad.raw", "sha256": expected,
                                                            "disk": "/dev/vdc"}, "w2"))).id,
        timeout=60,
    )  # fmt: skip
    assert bad.state == "failed"
    assert expected in (bad.reason or "")
    assert actual in (bad.reason or "")
    assert (root / "dev/vdc").read_bytes()[: 1 << 20] == bytes(1 << 20)  # not bootable

    converge = await cq.wait(
        id=(await cq.enqueue(command(node, "node.converge", {"generation": 1, "units": []}, "c"))).id,
        timeout=30,
    )
    assert (converge.state, converge.attested) == ("rejected", True)  # the ramdisk has no converger
    assert converge.reason == "unsupported-kind: this agent does not run node.converge"
    for view in (inv, wipe, write, bad, converge):
        assert _signed_by_the_node(root, node, view)


async def test_the_installed_os_converges_and_reports_its_generation(
    stack: Stack, bcds: list[BcdProcess]
) -> None:
    node = new_id("node")
    root = stack.tree("inst", root_disk="vda", disks=(DiskSpec("vda"),))
    await _serving(stack, root, node, "installed", bcds)
    cq = stack.cq
    inv = await cq.wait(id=(await cq.enqueue(command(node, "node.inventory", {}, "inv"))).id, timeout=30)
    assert (inv.state, inv.attested) == ("succeeded", True)
    # kernel-modules with only a blacklist writes files and runs nothing on this machine; a GPU
    # unit on a tree without a GPU is skipped (only where this machine has no nvidia-smi either:
    # bcd runs the real programs here)
    unit = {"name": "kernel-modules", "settings": {"blacklist": ["floppy"]}}
    gpu = (
        [{"name": "nvidia-driver", "settings": {"version": "550"}}] if not shutil.which("nvidia-smi") else []
    )
    first = await cq.wait(
        id=(
            await cq.enqueue(command(node, "node.converge", {"generation": 2, "units": [unit, *gpu]}, "c1"))
        ).id,
        timeout=30,
    )
    assert (first.state, first.attested) == ("succeeded", True), first.reason
    report = json.loads(first.result or b"{}")
    assert report["observedGeneration"] == 2
    assert report["units"] == [{"name": "kernel-modules", "status": "changed"}] + [
        {"name": "nvidia-driver", "status": "skipped", "detail": "no NVIDIA GPU on this machine"} for _ in gpu
    ]
    assert "blacklist floppy" in (root / "etc/modprobe.d/bc.conf").read_text()

    units = [unit, {"name": "acme-nic-firmware", "settings": {"branch": "1.2"}}]
    second = await cq.wait(
        id=(await cq.enqueue(command(node, "node.converge", {"generation": 3, "units": units}, "c2"))).id,
        timeout=30,
    )
    assert (second.state, second.attested) == ("failed", True)
    assert "unit acme-nic-firmware is not supported by this daemon" in (second.reason or "")
    assert "kernel-modules unchanged" in (second.reason or "")

    wipe = await cq.wait(id=(await cq.enqueue(command(node, "node.wipe", {}, "w"))).id, timeout=30)
    assert (wipe.state, wipe.attested) == ("rejected", True)  # the installed OS does not wipe disks
    assert wipe.reason == "unsupported-kind: this agent does not run node.wipe"
    for view in (inv, first, second, wipe):
        assert _signed_by_the_node(root, node, view)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def test_bcd_waits_out_a_control_plane_that_is_not_there_yet(
    stack: Stack, bcds: list[BcdProcess]
) -> None:
    node = new_id("node")
    root = stack.tree("late")
    token = await stack.token(node_id=node, productUuid=UUID)
    assert (await stack.join(root, token.token, "--node", node)).returncode == 0
    # bcd starts while nothing answers at its control plane's address
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    bcd = BcdProcess.start(
        stack.settings, root, "--mode", "ramdisk", log=root.parent / "late.log",
        extra_env={"BC_NATS_URL": f"nats://127.0.0.1:{port}"},
    )  # fmt: skip
    bcds.append(bcd)
    await until(lambda: bcd.output().count("control_plane_unreachable") >= 2)
    assert bcd.proc.poll() is None, bcd.output()
    # then the gateway comes up (a loopback relay to the real NATS): bcd connects by itself
    assert stack.settings.nats_url is not None
    target = urlsplit(stack.settings.nats_url)

    open_writers: list[asyncio.StreamWriter] = []

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(target.hostname, target.port)
        open_writers.extend((writer, up_writer))
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = await asyncio.start_server(relay, "127.0.0.1", port)
    try:
        await until(lambda: _connected(stack.cq, node))
    finally:
        bcd.close()
        server.close()
        for writer in open_writers:
            writer.close()
        await server.wait_closed()


async def _connected(cq: CommandQueueClient, node: str) -> bool:
    return any(a.id == node and a.connected for a in await cq.agents(site_id=SITE))


async def test_run_join_joins_once_with_the_kernel_line_token_and_keeps_its_enrollment_after_a_restart(
    stack: Stack, bcds: list[BcdProcess]
) -> None:
    """What the ramdisk's init runs (``bcd run --join``, again whenever it exits): the first start
    joins with ``bcd.token=`` and serves in the same process; a restart serves with the stored
    enrollment and never spends a token again."""
    node = new_id("node")
    root = stack.tree("ramdisk-init", product_uuid=UUID, macs=("52:54:00:00:00:07",))
    token = await stack.token(role="node", node_id=node, productUuid=UUID)
    (root / "proc/cmdline").write_text(f"console=ttyS0 bcd.token={token.token} bcd.control_plane=nats://x\n")
    (root / "etc/bcd").mkdir(parents=True, exist_ok=True)
    (root / "etc/bcd/ramdisk").touch()

    async def connected(bcd: BcdProcess) -> bool:
        assert bcd.proc.poll() is None, bcd.output()
        return any(a.id == node and a.connected for a in await stack.cq.agents(site_id=SITE))

    first = BcdProcess.start(stack.settings, root, "--join", log=root.parent / "first.log")
    bcds.append(first)
    await until(lambda: connected(first))
    assert _enrollment(root)["agentId"] == node
    assert "bcd_joined" in first.output()
    first.proc.kill()
    first.proc.wait(10)
    again = BcdProcess.start(stack.settings, root, "--join", log=root.parent / "again.log")
    bcds.append(again)
    await until(lambda: connected(again))
    assert "bcd_joined" not in again.output()  # the token is spent: a second join would fail
    joins = await stack.pki.list_joins(join_token_id=token.join_token_id)
    assert [j.outcome for j in joins] == ["joined"]
    done = await stack.cq.wait(
        id=(await stack.cq.enqueue(command(node, "node.inventory", {}, "i"))).id, timeout=30
    )
    assert (done.state, done.attested) == ("succeeded", True)
