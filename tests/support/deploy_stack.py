"""deploy/nats as committed, for the integration tests: a 3-node hub cluster and the eu1 leaf node,
each its own ``nats-server -c deploy/nats/<file>`` process with TLS on, and the leaf's auth
callout responder (``bc-pki callout``) as its own process.

The test supplies only what the files read from the environment (addresses, store folders,
password hashes, certificates), made with the functions ``bcx bus`` runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import json
import os
import secrets
import signal
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from cryptography.hazmat.primitives import serialization
from nats.aio.client import Client as Nats

from bc_pki.ca import CertificateAuthority, parse_csr
from better_compute.cli.bus_commands import CA_CERT, CA_KEY, CalloutArtefacts, write_callout_artefacts
from better_compute.core.errors import BcError, ErrorCode
from better_compute.crypto import bcrypt_password, issue_bus_certificate, make_csr, new_agent_key, new_bus_ca
from better_compute.runtime.embedded import free_port as pick_free_port
from better_compute.runtime.embedded import nats_server_binary, wait_port
from better_compute.service.client import connect, nats_client, tls_context
from better_compute.testing import until
from better_compute.wire import Subjects
from better_compute.wire.envelope import encode_error, encode_ok
from better_compute.wire.pki import CertificateInfo
from better_compute.wire.subjects import (
    agent_inbox_prefix,
    join_connection_name,
    join_inbox_prefix,
    operator_inbox_prefix,
    service_inbox_prefix,
)

T = TypeVar("T")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "nats"
SUBJECTS = Subjects()  # the configs are written for the default root, "bc"
PASSWORD_VARS = ["SYS", "ENGINE", "COMMAND_QUEUE", "PKI", "SECRETS", "BCX", "ALICE"]
OPERATORS = ("bcx", "alice")  # the users of account OPS
SERVICES = ("engine", "command-queue", "pki", "secrets")  # the users of account BC
WAIT = 15.0  # upper bound for anything the cluster has to settle


@dataclass
class Server:
    name: str
    conf: Path
    env: dict[str, str]
    log: Path
    client_port: int
    monitor_port: int
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [str(nats_server_binary()), "-c", str(self.conf)],
                env={**os.environ, **self.env},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        wait_port(self.client_port, timeout=WAIT, pid=self.proc.pid)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=WAIT)

    def monitor(self, path: str) -> tuple[int, Any]:
        url = f"http://127.0.0.1:{self.monitor_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            with contextlib.closing(err):
                return err.code, None


@dataclass
class Stack:
    """The hub cluster, the eu1 leaf node, its auth callout, and ways to connect as anyone."""

    hub: list[Server]
    leaf: Server
    passwords: dict[str, str]
    ca: Path  # the bus CA's certificate, which every server's chains to
    folder: Path
    pki: CertificateAuthority | None = None  # bc-pki's CA when the test plays bc-pki
    callout: CalloutArtefacts | None = None
    pki_ca_pem: bytes = b""
    responder: subprocess.Popen[bytes] | None = None
    clients: list[Nats] = field(default_factory=list)
    errors: dict[str, list[str]] = field(default_factory=dict)
    certs: dict[str, CertificateInfo] = field(default_factory=dict)  # what the test's CA issued

    async def connect(self, user: str, *servers: Server) -> Nats:
        """Connect as ``user`` (to ``servers``, or to every hub node); permission errors are kept
        in ``self.errors[user]``."""
        password = self.passwords[user.upper().replace("-", "_")]
        seen = self.errors.setdefault(user, [])

        async def on_error(err: Exception) -> None:
            seen.append(str(err))

        nc = nats_client()  # nats-py's, with a flush that comes after the SUBs before it
        await nc.connect(
            servers=[f"tls://127.0.0.1:{s.client_port}" for s in servers or self.hub],
            tls=tls_context(str(self.ca)),
            user=user,
            password=password,
            name=f"test-{user}",
            error_cb=on_error,
            connect_timeout=2,
            reconnect_time_wait=0.2,
            max_reconnect_attempts=-1,
            # each service and operator hears replies only under its own prefix, as they do
            inbox_prefix=inbox_prefix(user),
        )
        self.clients.append(nc)
        return nc

    # -- the leaf's side: agents and joining machines ------------------------------------

    def start_leaf(self, pki_ca_pem: bytes) -> None:
        """Make the auth callout's artefacts (``bcx bus callout``, with bc-pki's CA
        ``pki_ca_pem``) and start the leaf node on them."""
        self.callout = write_callout_artefacts(
            self.ca.parent, site="eu1", pki_ca_pem=pki_ca_pem, days=1, bcrypt_rounds=4
        )
        self.pki_ca_pem = pki_ca_pem
        self.leaf.env |= self.callout.env()
        self.leaf.start()

    async def leaf_up(self) -> None:
        await eventually("leaf node connected", functools.partial(_leaf_connected, self.leaf))

    def start_responder(self) -> None:
        """``bc-pki callout`` for the leaf, as its systemd unit runs it."""
        made = self.callout
        assert made is not None
        conf = self.folder / "callout.toml"
        pki_ca = self.folder / "pki-ca.pem"
        pki_ca.write_bytes(self.pki_ca_pem)
        conf.write_text(
            "\n".join(
                f'{key} = "{value}"'
                for key, value in {
                    "site_id": "eu1",
                    "nats_url": f"tls://127.0.0.1:{self.leaf.client_port}",
                    "nats_ca": self.ca,
                    "cert_file": made.responder_cert,
                    "key_file": made.responder_key,
                    "password_file": made.password,
                    "issuer_seed_file": made.issuer_seed,
                    "pki_ca_file": pki_ca,
                }.items()
            )
            + "\n"
        )
        out = (self.folder / "callout.log").open("ab")
        self.responder = subprocess.Popen(
            [sys.executable, "-m", "bc_pki", "callout", "--config", str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        out.close()

    def agent_tls(self, agent_id: str, *, site_id: str = "eu1", role: str = "node") -> ssl.SSLContext:
        """A TLS context presenting a certificate the test's bc-pki CA issues ``agent_id``
        (kept in ``self.certs`` for the test's bc-pki to answer ``certs.get``)."""
        assert self.pki is not None
        key = new_agent_key()
        cert_id = f"cert_{secrets.token_hex(8)}"
        cert = self.pki.issue(
            parse_csr(make_csr(key)), agent_id=agent_id, tenant_id="root", site_id=site_id, role=role,
            lifetime=dt.timedelta(hours=1), cert_id=cert_id,
        )  # fmt: skip
        pem = cert.public_bytes(serialization.Encoding.PEM)
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        now = dt.datetime.now(dt.UTC)
        self.certs[cert_id] = CertificateInfo(
            cert_id=cert_id, agent_id=agent_id, tenant_id="root", site_id=site_id, role=role,  # type: ignore[arg-type]
            join_token_id=None, serial=format(cert.serial_number, "x"), key_type="ed25519",
            state="valid", not_before=now, not_after=cert.not_valid_after_utc, created_at=now,
            certificate_pem=pem.decode(),
        )  # fmt: skip
        return self.client_tls(agent_id, pem, key_pem)

    def client_tls(self, name: str, cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
        cert, key = self.folder / f"client-{name}.pem", self.folder / f"client-{name}-key.pem"
        cert.write_bytes(cert_pem)
        key.write_bytes(key_pem)
        key.chmod(0o600)
        tls = tls_context(str(self.ca))
        tls.load_cert_chain(cert, key)
        return tls

    def joining_tls(self) -> ssl.SSLContext:
        """The site's joining certificate, as a machine without a certificate shows it."""
        assert self.callout is not None
        tls = tls_context(str(self.ca))
        tls.load_cert_chain(self.callout.joining_cert, self.callout.joining_key)
        return tls

    async def connect_agent(
        self, name: str, tls: ssl.SSLContext, *, inbox: str | None = None, **kwargs: Any
    ) -> Nats:
        """Connect to the leaf as agent ``name`` (its inbox ``_INBOX.<name>``) or with ``inbox``;
        errors are kept in ``self.errors[name]``; a refused connection raises ``BcError``."""
        seen = self.errors.setdefault(name, [])

        async def on_error(err: Exception) -> None:
            seen.append(str(err))

        nc = await connect(
            f"tls://127.0.0.1:{self.leaf.client_port}",
            name=kwargs.pop("conn_name", f"test-{name}"),
            tls=tls,
            error_cb=on_error,
            inbox_prefix=inbox or agent_inbox_prefix(name),
            **kwargs,
        )
        self.clients.append(nc)
        return nc

    async def connect_joining(self, nonce: str | None = None, **kwargs: Any) -> Nats:
        nonce = nonce or secrets.token_hex(12)
        return await self.connect_agent(
            "joining", self.joining_tls(), inbox=join_inbox_prefix(nonce),
            conn_name=join_connection_name(nonce), **kwargs,
        )  # fmt: skip

    async def answer_certs_get(self) -> None:
        """Play bc-pki's ``certs.get`` for the certificates ``agent_tls`` issued, as user pki."""
        pki = await self.connect("pki")

        async def answer(msg: Any) -> None:
            info = self.certs.get(json.loads(msg.data).get("certId", ""))
            if info is None:
                await msg.respond(encode_error(BcError(ErrorCode.NOT_FOUND, "no such certificate")))
            else:
                await msg.respond(encode_ok(info))

        await pki.subscribe(SUBJECTS.api("pki", "certs", "get"), queue="pki-stand-in", cb=answer)
        await pki.flush()

    async def responder_ready(self) -> None:
        """Until the responder answers: a joining connection gets in."""

        async def joined() -> bool | None:
            nc = await self.connect_joining(allow_reconnect=False)
            await nc.close()
            return True

        await eventually("the callout responder answers", joined)

    async def close(self) -> None:
        for nc in self.clients:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), timeout=2)
        if self.responder is not None and self.responder.poll() is None:
            self.responder.kill()
            self.responder.wait(timeout=WAIT)
        for server in [self.leaf, *self.hub]:
            server.kill()


def inbox_prefix(user: str) -> str:
    if user in OPERATORS:
        return operator_inbox_prefix(user)
    if user in SERVICES:
        return service_inbox_prefix(user)
    raise ValueError(user)


def _env(**values: object) -> dict[str, str]:
    return {f"BC_NATS_{k}": str(v) for k, v in values.items()}


async def eventually(what: str, probe: Callable[[], Awaitable[T | None]], *, timeout: float = WAIT) -> T:
    """``until()`` as these tests use it: ``probe()`` until it returns something other than None;
    whatever a settling cluster answers meanwhile (an exception) counts as not yet."""
    return await until(probe, timeout=timeout, interval=0.2, ignore=(Exception,), what=what)


async def _healthy(server: Server) -> bool | None:
    status, _ = await asyncio.to_thread(server.monitor, "/healthz")
    return True if status == 200 else None


async def _leaf_connected(leaf: Server) -> bool | None:
    _, body = await asyncio.to_thread(leaf.monitor, "/leafz")
    return True if body and body.get("leafnodes") else None


def _certificates(folder: Path, names: list[str]) -> dict[str, dict[str, object]]:
    """The bus CA in ``folder`` and a certificate from it for each server, as ``bcx bus`` makes
    them: each server's TLS variables."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = new_bus_ca("test bus CA")
    (folder / CA_CERT).write_bytes(ca_cert)
    (folder / CA_KEY).write_bytes(ca_key)
    env: dict[str, dict[str, object]] = {}
    for name in names:
        cert, key = issue_bus_certificate(ca_cert, ca_key, name=name, dns=["localhost"], ips=["127.0.0.1"])
        (folder / f"{name}.pem").write_bytes(cert)
        (folder / f"{name}-key.pem").write_bytes(key)
        env[name] = {
            "TLS_CERT": folder / f"{name}.pem",
            "TLS_KEY": folder / f"{name}-key.pem",
            "TLS_CA": folder / CA_CERT,
        }
    return env


def _build(tmp_path: Path) -> Stack:
    """The hub's three nodes and the eu1 leaf on fresh ports, not started."""
    passwords = {name: f"p{secrets.token_hex(12)}" for name in PASSWORD_VARS}
    # the servers get only the hashes (cheap ones: the test connects often)
    shared = _env(
        **{f"{name}_PASSWORD": bcrypt_password(value, rounds=4) for name, value in passwords.items()}
    )
    tls = _certificates(tmp_path / "tls", [*(f"bc-nats-{n}" for n in (1, 2, 3)), "bc-leaf-eu1"])
    used: set[int] = set()

    def free_port() -> int:
        """A port free now and not picked for another node of this stack: the OS may hand the
        same free port out twice (bc-nats-3 once got bc-nats-2's client port)."""
        while (port := pick_free_port()) in used:
            pass
        used.add(port)
        return port

    route_ports = [free_port() for _ in range(3)]
    leaf_ports = [free_port() for _ in range(3)]
    for n, port in enumerate(route_ports, 1):
        shared |= _env(**{f"ROUTE_{n}": f"nats-route://127.0.0.1:{port}"})
    for n, port in enumerate(leaf_ports, 1):
        shared |= _env(**{f"HUB_{n}": f"nats-leaf://127.0.0.1:{port}"})

    def server(name: str, conf: str, **env: object) -> Server:
        client, monitor = free_port(), free_port()
        env |= {"CLIENT_LISTEN": f"127.0.0.1:{client}", "MONITOR_LISTEN": f"127.0.0.1:{monitor}"}
        env |= tls[name]
        log = tmp_path / f"{name}.log"
        return Server(name, DEPLOY / conf, shared | _env(**env), log, client, monitor)

    hub = [
        server(
            f"bc-nats-{n}",
            f"cluster-{n}.conf",
            CLUSTER_LISTEN=f"127.0.0.1:{route_ports[n - 1]}",
            LEAF_LISTEN=f"127.0.0.1:{leaf_ports[n - 1]}",
            STORE_DIR=tmp_path / f"store-{n}",
        )
        for n in (1, 2, 3)
    ]
    leaf = server("bc-leaf-eu1", "leaf-site.conf", STORE_DIR=tmp_path / "store-leaf")
    return Stack(hub=hub, leaf=leaf, passwords=passwords, ca=tmp_path / "tls" / CA_CERT, folder=tmp_path)


def _port_taken(st: Stack) -> bool:
    """A node died because a port picked for it was taken before it listened: another process,
    or a node's own route dial, whose loopback source port can be any free port."""
    logs = [n.log.read_text(errors="replace") for n in [*st.hub, st.leaf] if n.log.exists()]
    return any("address already in use" in text for text in logs)


@contextlib.asynccontextmanager
async def run_stack(tmp_path: Path, *, leaf: bool = True) -> AsyncIterator[Stack]:
    """Start the hub cluster and (with ``leaf``) the eu1 leaf from deploy/nats, the test playing
    bc-pki's CA; kill them all on the way out. Without ``leaf`` the test starts it
    (``Stack.start_leaf``) once it has bc-pki's CA. Ports are picked free, then bound by
    nats-server: one taken meanwhile means new ports."""
    for attempt in range(3):
        st = _build(tmp_path / f"try-{attempt}")
        try:
            for node in st.hub:
                node.start()
            if leaf:
                st.pki = CertificateAuthority.create(name="test bc-pki CA")
                st.start_leaf(st.pki.certificate_pem.encode())
            # a node that lost its port may die after it started: the cluster then never forms
            for node in st.hub:
                await eventually(f"{node.name} healthy", functools.partial(_healthy, node))
            if leaf:
                await st.leaf_up()
        except (BcError, AssertionError):
            await st.close()
            if _port_taken(st) and attempt < 2:
                continue
            print_logs(st)
            raise
        break
    try:
        yield st
    finally:
        await st.close()
        print_logs(st)


def print_logs(st: Stack) -> None:
    for node in [*st.hub, st.leaf]:  # pytest shows this only when a test failed
        tail = node.log.read_text(errors="replace").splitlines()[-30:] if node.log.exists() else []
        print(f"--- {node.name} ---", *tail, sep="\n")
    responder = st.folder / "callout.log"
    if responder.exists():
        print("--- bc-pki callout ---", *responder.read_text(errors="replace").splitlines()[-30:], sep="\n")
