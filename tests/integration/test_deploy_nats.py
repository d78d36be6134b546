"""deploy/nats: a 3-node hub cluster and a site leaf node, run from the committed files.

Each nats-server runs as its own process with ``-c deploy/nats/<file>``; the test supplies
only what the files read from the environment (addresses, store folders, passwords), so
what is checked here is what an operator installs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import re
import secrets
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import nats
import nats.errors
import pytest
import pytest_asyncio
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import api

from better_compute.config import EventsSettings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.crypto import bcrypt_password, issue_bus_certificate, new_bus_ca
from better_compute.logging import get_logger
from better_compute.runtime.embedded import free_port as pick_free_port
from better_compute.runtime.embedded import nats_server_binary, wait_port
from better_compute.service.audit import requester
from better_compute.service.client import connect, tls_context
from better_compute.service.events import ensure_events_stream
from better_compute.testing import bcx, until
from better_compute.wire import Subjects
from better_compute.wire.subjects import (
    SITE_AGENT_INBOX_PREFIX,
    operator_inbox_prefix,
    service_inbox_prefix,
)

T = TypeVar("T")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "nats"
SUBJECTS = Subjects()  # the configs are written for the default root, "bc"
EU1 = SUBJECTS.site_stream("eu1")
PASSWORD_VARS = [
    "SYS", "ENGINE", "COMMAND_QUEUE", "PKI", "SECRETS", "BCX", "ALICE", "LEAF_EU1",
    "SITE_AGENT", "NODE",
]  # fmt: skip
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
    """The hub cluster, the eu1 leaf node, and a way to connect as any of their users."""

    hub: list[Server]
    leaf: Server
    passwords: dict[str, str]
    ca: Path  # the bus CA's certificate, which every server's chains to
    clients: list[Nats] = field(default_factory=list)
    errors: dict[str, list[str]] = field(default_factory=dict)

    async def connect(self, user: str, *servers: Server) -> Nats:
        """Connect as ``user`` (to ``servers``, or to every hub node); permission errors are kept
        in ``self.errors[user]``."""
        password = self.passwords[user.upper().replace("-", "_")]
        seen = self.errors.setdefault(user, [])

        async def on_error(err: Exception) -> None:
            seen.append(str(err))

        nc = await nats.connect(
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
            inbox_prefix=_inbox_prefix(user),
        )
        self.clients.append(nc)
        return nc

    async def close(self) -> None:
        for nc in self.clients:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), timeout=2)
        for server in [self.leaf, *self.hub]:
            server.kill()


def _inbox_prefix(user: str) -> str:
    if user in OPERATORS:
        return operator_inbox_prefix(user)
    if user in SERVICES:
        return service_inbox_prefix(user)
    if user == "site-agent":
        return SITE_AGENT_INBOX_PREFIX
    return "_INBOX"  # bcd's (user node)


def _env(**values: object) -> dict[str, str]:
    return {f"BC_NATS_{k}": str(v) for k, v in values.items()}


async def eventually(what: str, probe: Callable[[], Awaitable[T | None]], *, timeout: float = WAIT) -> T:
    """``until()`` as this file uses it: ``probe()`` until it returns something other than None;
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
    (folder / "ca.pem").write_bytes(ca_cert)
    env: dict[str, dict[str, object]] = {}
    for name in names:
        cert, key = issue_bus_certificate(ca_cert, ca_key, name=name, dns=["localhost"], ips=["127.0.0.1"])
        (folder / f"{name}.pem").write_bytes(cert)
        (folder / f"{name}-key.pem").write_bytes(key)
        env[name] = {
            "TLS_CERT": folder / f"{name}.pem",
            "TLS_KEY": folder / f"{name}-key.pem",
            "TLS_CA": folder / "ca.pem",
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
        shared |= _env(**{f"HUB_{n}": f"nats-leaf://leaf-eu1:{passwords['LEAF_EU1']}@127.0.0.1:{port}"})

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
    leaf = server("bc-leaf-eu1", "leaf-site.conf")
    return Stack(hub=hub, leaf=leaf, passwords=passwords, ca=tmp_path / "tls" / "ca.pem")


def _port_taken(st: Stack) -> bool:
    """A node died because a port picked for it was taken before it listened: another process,
    or a node's own route dial, whose loopback source port can be any free port."""
    logs = [n.log.read_text(errors="replace") for n in [*st.hub, st.leaf] if n.log.exists()]
    return any("address already in use" in text for text in logs)


@contextlib.asynccontextmanager
async def run_stack(tmp_path: Path) -> AsyncIterator[Stack]:
    """Start the hub cluster and the eu1 leaf from deploy/nats; kill them all on the way out.
    Ports are picked free, then bound by nats-server: one taken meanwhile means new ports."""
    for attempt in range(3):
        st = _build(tmp_path / f"try-{attempt}")
        (tmp_path / f"try-{attempt}").mkdir(exist_ok=True)  # _build wrote the certificates there
        try:
            for node in [*st.hub, st.leaf]:
                node.start()
            # a node that lost its port may die after it started: the cluster then never forms
            for node in st.hub:
                await eventually(f"{node.name} healthy", functools.partial(_healthy, node))
            await eventually("leaf node connected", functools.partial(_leaf_connected, st.leaf))
        except (BcError, AssertionError):
            await st.close()
            if _port_taken(st) and attempt < 2:
                continue
            _print_logs(st)
            raise
        break
    try:
        yield st
    finally:
        await st.close()
        _print_logs(st)


def _print_logs(st: Stack) -> None:
    for node in [*st.hub, st.leaf]:  # pytest shows this only when a test failed
        tail = node.log.read_text(errors="replace").splitlines()[-30:] if node.log.exists() else []
        print(f"--- {node.name} ---", *tail, sep="\n")


@pytest_asyncio.fixture(loop_scope="session")
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    async with run_stack(tmp_path) as st:
        yield st


async def _site_stream(nc: Nats, site: str) -> str:
    """The site's stream, R3, as the command queue makes it (bc_command_queue.delivery)."""
    name = SUBJECTS.site_stream(site)
    js = nc.jetstream(timeout=5)
    config = api.StreamConfig(
        name=name,
        subjects=[SUBJECTS.site_cmd_all(site)],
        retention=api.RetentionPolicy.WORK_QUEUE,
        storage=api.StorageType.FILE,
        num_replicas=3,
        duplicate_window=120.0,
    )
    await eventually(f"stream {name}", lambda: js.add_stream(config))
    return name


async def _agent_consumer(nc: Nats, site: str, agent: str) -> None:
    """The agent's durable pull consumer, as the command queue makes it on the agent's hello."""
    config = api.ConsumerConfig(
        durable_name=agent,
        filter_subject=SUBJECTS.site_cmd(site, agent),
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=30.0,
    )
    await nc.jetstream(timeout=5).add_consumer(SUBJECTS.site_stream(site), config)


async def _fetch_one(nc: Nats, stream: str, consumer: str, *, timeout: float = 3.0) -> Msg:
    psub = await nc.jetstream(timeout=5).pull_subscribe_bind(durable=consumer, stream=stream)
    try:
        (msg,) = await psub.fetch(1, timeout=timeout)
        return msg
    finally:
        await psub.unsubscribe()


async def _drain(sub: Subscription, *, wait: float = 0.5) -> list[str]:
    """Subjects of whatever ``sub`` receives until it has been quiet for ``wait`` seconds."""
    got: list[str] = []
    with contextlib.suppress(TimeoutError):
        while len(got) < 100:
            got.append((await sub.next_msg(timeout=wait)).subject)
    return got


def _variables(*confs: str) -> set[str]:
    text = "\n".join((DEPLOY / c).read_text() for c in confs)
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    return set(re.findall(r"\$(BC_NATS_\w+)", code))


def _example(name: str) -> set[str]:
    lines = (DEPLOY / name).read_text().splitlines()
    return {line.split("=", 1)[0] for line in lines if line and not line.startswith("#")}


def test_env_examples_set_exactly_what_the_configs_read() -> None:
    # nats-server refuses to start on a variable the environment lacks
    hub = _variables("hub.conf", "accounts.conf", "hub-site-eu1.conf")
    assert "BC_NATS_ENGINE_PASSWORD" in hub
    assert _example("nats.env.example") == hub
    assert _example("nats-leaf.env.example") == _variables("leaf-site.conf")


async def test_cluster_forms_and_replicates_a_stream_across_nodes(stack: Stack) -> None:
    n1, n2, n3 = stack.hub
    for node in stack.hub:  # every write reaches the disk before JetStream acknowledges it
        _, varz = await asyncio.to_thread(node.monitor, "/varz")
        assert varz["jetstream"]["config"].get("sync_always") is True, node.name
    cmdq_1 = await stack.connect("command-queue", n1)
    cmdq_2 = await stack.connect("command-queue", n2)
    stream = await _site_stream(cmdq_1, "eu1")
    info = await cmdq_2.jetstream().stream_info(stream)
    assert info.config.num_replicas == 3
    assert info.cluster is not None
    assert info.cluster.leader in {s.name for s in stack.hub}
    assert len(info.cluster.replicas or []) == 2

    ack = await cmdq_1.jetstream().publish(
        SUBJECTS.site_cmd("eu1", "agent1"), b"power-on", headers={"Nats-Msg-Id": "c1:agent1"}
    )
    assert (ack.stream, ack.seq) == (stream, 1)
    await _agent_consumer(cmdq_2, "eu1", "agent1")
    msg = await _fetch_one(cmdq_2, stream, "agent1")
    assert msg.data == b"power-on"  # left unacknowledged: only agents ack (see the next test)

    # core messages cross the routes too: an event published on node 1 reaches bcx on node 3
    bcx = await stack.connect("bcx", n3)
    sub = await bcx.subscribe(SUBJECTS.events_all("workflow"))
    await bcx.flush()
    engine = await stack.connect("engine", n1)

    async def delivered() -> Msg | None:
        await engine.publish(SUBJECTS.event("workflow", "wf1"), b"changed")
        with contextlib.suppress(nats.errors.TimeoutError):
            return await sub.next_msg(timeout=0.5)
        return None

    got = await eventually("event across nodes", delivered)
    assert got.data == b"changed"
    assert not any(stack.errors.values()), stack.errors


async def test_site_agent_pulls_its_commands_and_reaches_the_control_plane_through_the_leaf(
    stack: Stack,
) -> None:
    cmdq = await stack.connect("command-queue")
    secrets_svc = await stack.connect("secrets")
    stream = await _site_stream(cmdq, "eu1")
    await _agent_consumer(cmdq, "eu1", "agent1")
    await cmdq.jetstream().publish(SUBJECTS.site_cmd("eu1", "agent1"), b"boot-pxe")

    # the control plane's side: agent events, and the three requests an agent makes
    events = await cmdq.subscribe("bc.agent.>")
    pki = await stack.connect("pki")

    def answer(text: bytes) -> Callable[[Msg], Awaitable[None]]:
        async def respond(msg: Msg) -> None:
            await msg.respond(text + b" " + msg.subject.encode())

        return respond

    await cmdq.subscribe("bc.agent.*.*.hello", queue="cmdq", cb=answer(b"welcome"))
    await pki.subscribe("bc.api.pki.agents.join", queue="pki", cb=answer(b"joined"))
    await secrets_svc.subscribe("bc.api.secrets.secrets.fetch", queue="secrets", cb=answer(b"secret"))
    for nc in (cmdq, pki, secrets_svc):
        await nc.flush()

    agent = await stack.connect("site-agent", stack.leaf)
    hello = SUBJECTS.agent_event("eu1", "agent1", "hello")
    reply = await eventually("hello answered", lambda: agent.request(hello, b"hi", timeout=1))
    assert reply.data == b"welcome " + hello.encode()
    await pki.subscribe("bc.api.pki.tokens.burn", queue="pki", cb=answer(b"burnt"))
    await pki.subscribe("bc.api.pki.tokens.confirm", queue="pki", cb=answer(b"confirmed"))
    await pki.flush()
    for subject, text in [
        ("bc.api.pki.agents.join", b"joined"), ("bc.api.secrets.secrets.fetch", b"secret"),
        ("bc.api.pki.tokens.burn", b"burnt"),  # its report of a boot entry asked for twice
        ("bc.api.pki.tokens.confirm", b"confirmed"),  # and of one closed clean
    ]:  # fmt: skip
        reply = await agent.request(subject, b"{}", timeout=5)
        assert reply.data == text + b" " + subject.encode()

    # its commands: pulled from the hub's JetStream through the leaf, and acknowledged
    msg = await _fetch_one(agent, stream, "agent1", timeout=5)
    assert (msg.subject, msg.data) == (SUBJECTS.site_cmd("eu1", "agent1"), b"boot-pxe")
    await msg.ack()
    info = await agent.jetstream().consumer_info(stream, "agent1")
    assert info.name == "agent1"

    async def drained() -> bool | None:
        state = (await cmdq.jetstream().stream_info(stream)).state
        return True if state.messages == 0 else None  # work queue: gone once acknowledged

    await eventually("ack reached the hub", drained)

    heartbeat = SUBJECTS.agent_event("eu1", "agent1", "heartbeat")
    await agent.publish(heartbeat, b"alive")

    async def heard() -> Msg | None:
        msg = await events.next_msg(timeout=1)
        return msg if msg.subject == heartbeat else None  # skips the hello seen before

    assert (await eventually("heartbeat on the hub", heard, timeout=5)).data == b"alive"
    assert not stack.errors["site-agent"], stack.errors


async def test_site_agent_is_confined_to_its_site(stack: Stack) -> None:
    cmdq = await stack.connect("command-queue")
    bcx = await stack.connect("bcx")
    secrets_svc = await stack.connect("secrets")
    await _site_stream(cmdq, "eu1")
    us1 = await _site_stream(cmdq, "us1")
    await _agent_consumer(cmdq, "us1", "agent9")
    await cmdq.jetstream().publish(SUBJECTS.site_cmd("us1", "agent9"), b"wipe")
    events = await cmdq.subscribe("bc.agent.>")

    async def get(msg: Msg) -> None:
        await msg.respond(b"control-plane-secret")

    await secrets_svc.subscribe("bc.api.secrets.secrets.get", cb=get)
    await secrets_svc.flush()
    await cmdq.flush()

    agent = await stack.connect("site-agent", stack.leaf)
    node = await stack.connect("node", stack.leaf)
    inboxes = await node.subscribe("_INBOX.>")  # allowed to bcd: its own replies come there
    await agent.subscribe(SUBJECTS.site_cmd_all("us1"))
    await agent.subscribe(SUBJECTS.site_cmd_all("eu1"))  # commands come only by pulling
    await agent.publish(SUBJECTS.agent_event("us1", "agent1", "heartbeat"), b"forged")
    await agent.publish("bc.api.secrets.secrets.get", b"ref", reply="_INBOX.x")
    psub = await agent.jetstream().pull_subscribe_bind(durable="agent9", stream=us1)
    with pytest.raises(TimeoutError):  # the pull request never leaves the leaf
        await psub.fetch(1, timeout=1)
    with pytest.raises(TimeoutError):
        await agent.jetstream(timeout=1).add_consumer(
            EU1, api.ConsumerConfig(durable_name="agent2", filter_subject=SUBJECTS.site_cmd("eu1", "agent2"))
        )
    await agent.publish(SUBJECTS.agent_event("eu1", "agent1", "heartbeat"), b"marker")
    await agent.flush()

    # the server said no to each of them ...
    async def refusals() -> list[str] | None:
        errs = stack.errors["site-agent"]
        return errs if len(errs) >= 6 else None

    errs = "\n".join(await eventually("permission errors", refusals, timeout=5))
    for refused in [
        'publish to "bc.agent.us1.agent1.heartbeat"',
        'subscription to "bc.site.us1.cmd.>"',
        'subscription to "bc.site.eu1.cmd.>"',
        'publish to "bc.api.secrets.secrets.get"',
        f'publish to "$js.api.consumer.msg.next.{us1}.agent9"',
        f"create.{EU1}.agent2",  # nats-py picks CONSUMER.CREATE or CONSUMER.DURABLE.CREATE
    ]:
        assert refused.lower() in errs, (refused, errs)  # nats-py lower-cases the server's text

    # ... and nothing of it reached the control plane: the marker sent after them arrives alone
    first = await events.next_msg(timeout=5)
    assert (first.subject, first.data) == (SUBJECTS.agent_event("eu1", "agent1", "heartbeat"), b"marker")
    assert await _drain(events) == []
    assert (await cmdq.jetstream().stream_info(us1)).state.messages == 1  # the us1 command is still there

    # replies to the control plane's own requests never reach a site, even on _INBOX.>
    got = await bcx.request("bc.api.secrets.secrets.get", b"ref", timeout=5)
    assert got.data == b"control-plane-secret"
    assert await _drain(inboxes) == []


async def test_stream_survives_losing_its_leader(stack: Stack) -> None:
    cmdq = await stack.connect("command-queue")
    stream = await _site_stream(cmdq, "eu1")
    await _agent_consumer(cmdq, "eu1", "agent1")
    js = cmdq.jetstream(timeout=2)
    await js.publish(SUBJECTS.site_cmd("eu1", "agent1"), b"before")
    info = await js.stream_info(stream)
    assert info.cluster is not None
    leader = next(s for s in stack.hub if s.name == info.cluster.leader)
    leader.kill()

    async def new_leader() -> str | None:
        cluster = (await js.stream_info(stream)).cluster
        return cluster.leader if cluster and cluster.leader not in (None, leader.name) else None

    assert await eventually("a new stream leader", new_leader) != leader.name
    # retried until a new leader takes it; the message id keeps a retry from adding a copy
    after = functools.partial(
        js.publish, SUBJECTS.site_cmd("eu1", "agent1"), b"after", headers={"Nats-Msg-Id": "after"}
    )
    assert (await eventually("publish after the kill", after)).seq == 2

    # the agent, through the leaf (which moves to a surviving hub node if it has to), reads both
    agent = await stack.connect("site-agent", stack.leaf)
    psub = await agent.jetstream(timeout=5).pull_subscribe_bind(durable="agent1", stream=stream)
    got: list[bytes] = []

    async def read_both() -> bool | None:
        for msg in await psub.fetch(2 - len(got), timeout=1):
            got.append(msg.data)
            await msg.ack()
        return True if len(got) == 2 else None

    await eventually("both commands through the leaf", read_both)
    assert got == [b"before", b"after"]


async def test_the_event_feed_works_under_the_deployed_permissions(stack: Stack) -> None:
    n1, n2, n3 = stack.hub
    cmdq = await stack.connect("command-queue", n1)

    async def created() -> bool:
        await ensure_events_stream(cmdq, SUBJECTS, EventsSettings(replicas=3), get_logger())
        return True

    await eventually("events stream", created)
    info = await cmdq.jetstream().stream_info(SUBJECTS.events_stream())
    assert (info.config.name, info.config.num_replicas) == ("BC_EVENTS", 3)
    engine = await stack.connect("engine", n2)
    await engine.publish(SUBJECTS.event("workflow", "wf_1"), b'{"event":"finished","workflowId":"wf_1"}')
    await cmdq.publish(SUBJECTS.event("batch", "batch_1"), b'{"event":"batch","id":"batch_1"}')
    await engine.flush()
    await cmdq.flush()

    async def stored() -> bool | None:
        return True if (await cmdq.jetstream().stream_info("BC_EVENTS")).state.messages == 2 else None

    await eventually("both events kept", stored)
    # bcx, as the operator user, reads the stored feed by direct get (it may create no consumer)
    url = f"tls://bcx:{stack.passwords['BCX']}@127.0.0.1:{n3.client_port}"
    code, out, err = await bcx(
        None, "events", "tail", "--since", "all", "--no-follow", "--json", "--nats-url", url,
        isolated=True, env={"BC_NATS_CA": str(stack.ca)},
    )  # fmt: skip
    assert code == 0, (out, err)
    # two publishers on two nodes: the stream's order between them is not theirs to choose
    assert sorted((e["kind"], e["id"]) for e in map(json.loads, out.splitlines())) == [
        ("batch", "batch_1"),
        ("workflow", "wf_1"),
    ]

    # following: new workflow events as they come, batch events filtered out, until --limit
    tail = ("events", "tail", "--kind", "workflow", "--limit", "3", "--json", "--nats-url", url)
    follow = asyncio.create_task(bcx(None, *tail, isolated=True, env={"BC_NATS_CA": str(stack.ca)}))
    n = 0
    while not follow.done() and n < 200:  # it starts with the next event: publish until it has 3
        n += 1
        await cmdq.publish(SUBJECTS.event("batch", f"batch_f{n}"), b'{"event":"batch"}')
        await engine.publish(SUBJECTS.event("workflow", f"wf_f{n}"), b'{"event":"finished"}')
        await asyncio.wait({follow}, timeout=0.2)
    code, out, err = await follow
    assert code == 0, (out, err)
    got = [json.loads(line) for line in out.splitlines()]
    assert [e["kind"] for e in got] == ["workflow"] * 3
    ids = [int(e["id"].removeprefix("wf_f")) for e in got]
    assert ids == sorted(ids)
    assert ids[-1] - ids[0] == 2, ids  # none skipped between the first and the last
    assert [e["seq"] for e in got] == sorted(e["seq"] for e in got)
    assert not any(stack.errors.values()), stack.errors


async def test_an_operator_is_named_by_the_server_not_by_what_they_say(stack: Stack) -> None:
    """An operator's request reaches the services through the OPS account's shared import, so
    nats-server names its user in Nats-Request-Info, over whatever header the sender wrote:
    the audit's "who" is the credential's identity, not a claim."""
    engine = await stack.connect("engine")
    seen: list[dict[str, str]] = []

    async def respond(msg: Msg) -> None:
        seen.append(dict(msg.headers or {}))
        await msg.respond(b"{}")

    await engine.subscribe("bc.api.engine.>", queue="engine", cb=respond)
    await engine.flush()
    alice = await stack.connect("alice")
    forged = {
        "Nats-Request-Info": json.dumps({"acc": "BC", "user": "engine"}),
        "Bc-Actor": "service:bc-engine",
    }
    await eventually(
        "alice reaches the engine",
        lambda: alice.request("bc.api.engine.workflows.abort", b"{}", headers=forged, timeout=1),
    )
    who = requester(seen[-1])
    assert (who.actor, who.verified, who.claimed, who.is_service) == (
        "alice",
        True,
        "service:bc-engine",
        False,
    )
    assert json.loads(seen[-1]["Nats-Request-Info"])["acc"] == "OPS"

    # the services' own replies stay in BC: an operator cannot listen on BC's _INBOX.>
    await alice.subscribe("_INBOX.>")
    await alice.flush()
    await eventually("the refusal", lambda: _refused(stack, "alice", "_INBOX.>"))


async def _refused(stack: Stack, user: str, subject: str) -> bool | None:
    said = [e.lower() for e in stack.errors[user]]
    return True if any(subject.lower() in e and "permissions violation" in e for e in said) else None


async def test_only_the_engine_reaches_the_command_queues_enqueue_unmarked(stack: Stack) -> None:
    """Issue 22 gap 6, the deployed half: the command queue takes a command naming a workflow
    only from the engine, and judges it from what nats-server says. An operator's enqueue comes
    through OPS's import, stamped with Nats-Request-Info (whatever the sender wrote), which the
    queue refuses; inside BC only the engine's user may publish an enqueue at all (bc-secrets
    may ask live_with_ref, nothing more)."""
    cmdq = await stack.connect("command-queue")
    seen: dict[str, list[dict[str, str]]] = {}

    async def respond(msg: Msg) -> None:
        seen.setdefault(msg.subject, []).append(dict(msg.headers or {}))
        await msg.respond(b"{}")

    await cmdq.subscribe("bc.api.command-queue.>", queue="command-queue", cb=respond)
    await cmdq.flush()
    enqueue = "bc.api.command-queue.commands.enqueue"
    engine = await stack.connect("engine")
    await eventually("the engine's enqueue", lambda: engine.request(enqueue, b"{}", timeout=1))
    assert requester(seen[enqueue][-1]).imported is False  # the engine's: taken
    alice = await stack.connect("alice")
    unstamped = {"Bc-Actor": "service:bc-engine"}  # says it is the engine, writes no Nats-Request-Info
    await eventually("alice's enqueue", lambda: alice.request(enqueue, b"{}", headers=unstamped, timeout=1))
    assert requester(seen[enqueue][-1]).imported is True  # stamped by the server: refused
    assert json.loads(seen[enqueue][-1]["Nats-Request-Info"])["acc"] == "OPS"

    secrets_svc = await stack.connect("secrets")
    live = "bc.api.command-queue.commands.live_with_ref"
    await eventually("secrets asks live_with_ref", lambda: secrets_svc.request(live, b"{}", timeout=1))
    before = len(seen[enqueue])
    await secrets_svc.publish(enqueue, b"{}")
    await secrets_svc.flush()
    await eventually("the refusal", lambda: _refused(stack, "secrets", enqueue))
    await engine.request(enqueue, b"{}", timeout=5)  # a marker after it: it arrives alone
    assert len(seen[enqueue]) == before + 1


async def test_no_service_or_operator_reads_another_ones_replies(stack: Stack) -> None:
    """Issue 23 M5 and L2: each service user reads replies only under ``_INBOX.<service>.>``,
    each operator only under ``_INBOX_OPS.<user>.>``. The command queue, which parses what agents
    send, once heard every reply in BC (the engine's join tokens, bc-secrets' values), and any
    operator heard another's revealed secrets."""
    pki = await stack.connect("pki")

    async def answer(msg: Msg) -> None:
        await msg.respond(b"for " + msg.subject.encode())

    await pki.subscribe("bc.api.pki.>", queue="pki", cb=answer)
    await pki.flush()
    # what each one may ask bc-pki (its own permission lines)
    asks = {
        "engine": "bc.api.pki.tokens.issue",
        "command-queue": "bc.api.pki.signatures.verify",
        "secrets": "bc.api.pki.signatures.verify",
        "bcx": "bc.api.pki.tokens.issue",
        "alice": "bc.api.pki.certs.revoke",
    }
    clients = {user: await stack.connect(user) for user in [*asks, "pki"]}
    # everyone tries to listen to everyone else's replies, and to all of them at once
    heard: dict[str, list[Subscription]] = {}
    for user, nc in clients.items():
        others = [_inbox_prefix(o) + ".>" for o in clients if o != user]
        heard[user] = [await nc.subscribe(subject) for subject in [*others, "_INBOX.>", "_INBOX_OPS.>"]]
        await nc.flush()
    for user, subject in asks.items():
        reply = await eventually(
            f"{user} asks", lambda u=user, s=subject: clients[u].request(s, b"{}", timeout=1)
        )
        assert reply.data == b"for " + subject.encode()

    for user in clients:
        for subject in [*(_inbox_prefix(o) + ".>" for o in clients if o != user), "_INBOX.>", "_INBOX_OPS.>"]:
            await eventually(f"{user} refused {subject}", functools.partial(_refused, stack, user, subject))
        for sub in heard[user]:
            assert await _drain(sub, wait=0.2) == [], (user, sub.subject)


async def test_each_service_calls_only_the_routes_it_uses(stack: Stack) -> None:
    """Issue 23 item 3: a service user publishes only the routes its code calls. The command
    queue asks bc-pki to verify and to look up a certificate, nothing else: a compromised one
    cannot issue join tokens, read secrets or drive the engine."""
    seen: list[str] = []

    async def answer(msg: Msg) -> None:
        seen.append(msg.subject)
        await msg.respond(b"{}")

    for service in SERVICES:
        nc = await stack.connect(service)
        await nc.subscribe(f"bc.api.{service}.>", queue=service, cb=answer)
        await nc.flush()
    refused = {
        "command-queue": [
            "bc.api.pki.tokens.issue", "bc.api.pki.certs.revoke", "bc.api.secrets.secrets.get",
            "bc.api.engine.workflows.start", "bc.api.command-queue.commands.enqueue",
        ],
        "secrets": [
            "bc.api.pki.tokens.issue", "bc.api.engine.nodes.delete",
            "bc.api.command-queue.commands.cancel",
        ],
        "pki": [
            "bc.api.secrets.secrets.get", "bc.api.engine.nodes.delete",
            "bc.api.command-queue.commands.enqueue",
        ],
        "engine": [
            "bc.api.pki.keys.rewrap", "bc.api.secrets.secrets.describe",
            "bc.api.command-queue.batches.approve",
        ],
    }  # fmt: skip
    callers = {service: await stack.connect(service) for service in refused}
    for service, subjects in refused.items():
        nc = callers[service]
        for subject in subjects:
            await nc.publish(subject, b"{}")
        await nc.flush()
        for subject in subjects:
            await eventually(
                f"{service} refused {subject}", functools.partial(_refused, stack, service, subject)
            )
    # a call the engine may make arrives, and none of the refused ones did
    engine = callers["engine"]
    await eventually("a permitted call", lambda: engine.request("bc.api.pki.certs.get", b"{}", timeout=1))
    assert seen[-1] == "bc.api.pki.certs.get"
    assert not [s for s in seen if s != "bc.api.pki.certs.get"], seen


async def test_an_operator_cannot_deliver_into_the_control_plane(stack: Stack) -> None:
    """Issue 23 M1: an operator created a durable push consumer on BC_EVENTS delivering to
    bc.api.pki.certs.revoke, and every newly joined agent's certificate was revoked, by no one,
    even after the operator's user was gone. Operators now create no consumer at all (bcx events
    tail reads by direct get) and delete none of the services'."""
    cmdq = await stack.connect("command-queue")

    async def created() -> bool:
        await ensure_events_stream(cmdq, SUBJECTS, EventsSettings(replicas=3), get_logger())
        return True

    await eventually("events stream", created)
    stream = SUBJECTS.events_stream()
    js = cmdq.jetstream(timeout=5)
    await js.add_consumer(stream, api.ConsumerConfig(durable_name="watcher", ack_policy=api.AckPolicy.NONE))
    pki = await stack.connect("pki")
    revoked = await pki.subscribe("bc.api.pki.certs.revoke")
    await pki.flush()

    alice = await stack.connect("alice")
    ajs = alice.jetstream(timeout=1)
    for config in [
        api.ConsumerConfig(durable_name="evil", deliver_subject="bc.api.pki.certs.revoke"),
        api.ConsumerConfig(deliver_subject="bc.api.pki.certs.revoke"),  # ephemeral
        api.ConsumerConfig(name="evil2", deliver_subject="bc.api.pki.certs.revoke"),
    ]:
        with pytest.raises(TimeoutError):
            await ajs.add_consumer(stream, config)
    with pytest.raises(TimeoutError):
        await ajs.delete_consumer(stream, "watcher")
    engine = await stack.connect("engine")
    await engine.publish(SUBJECTS.event("node", "node_1"), b'{"event":"joined"}')
    await engine.flush()

    async def stored() -> bool | None:
        return True if (await js.stream_info(stream)).state.messages >= 1 else None

    await eventually("the event kept", stored)
    errs = "\n".join(stack.errors["alice"])
    for said in [f"consumer.durable.create.{stream}.evil", f"consumer.create.{stream}", "consumer.delete"]:
        assert said.lower() in errs.lower(), (said, errs)
    assert [c.name for c in await js.consumers_info(stream)] == ["watcher"]
    assert await _drain(revoked, wait=0.5) == []

    # what an operator does see: the feed, read by direct get, answered on its own inbox
    url = f"tls://alice:{stack.passwords['ALICE']}@127.0.0.1:{stack.hub[0].client_port}"
    code, out, err = await bcx(
        None, "events", "tail", "--since", "all", "--no-follow", "--json", "--nats-url", url,
        isolated=True, env={"BC_NATS_CA": str(stack.ca)},
    )  # fmt: skip
    assert code == 0, (out, err)
    assert [(e["kind"], e["id"]) for e in map(json.loads, out.splitlines())] == [("node", "node_1")]


async def test_every_listener_speaks_tls_and_the_servers_keep_no_plain_password(stack: Stack) -> None:
    """Issue 23: no listener took TLS and the configs held plain passwords. Now a client without
    TLS gets nowhere on a hub node or the leaf, the cluster's routes and the leaf link ran over
    TLS with certificates from the bus CA (the stack formed), and the servers' environment
    holds only bcrypt hashes."""
    stranger = stack.ca.parent / "stranger.pem"
    stranger.write_bytes(new_bus_ca("not the bus CA")[0])
    password = stack.passwords["BCX"]
    for node in [stack.hub[0], stack.leaf]:
        # a plain-text client: the server asks for TLS and answers nothing else
        reader, writer = await asyncio.open_connection("127.0.0.1", node.client_port)
        info = json.loads((await asyncio.wait_for(reader.readline(), WAIT)).split(b" ", 1)[1])
        assert info["tls_required"] is True
        writer.write(b'CONNECT {"user":"bcx","pass":"%s"}\r\nPING\r\n' % password.encode())
        await writer.drain()
        assert b"PONG" not in await asyncio.wait_for(reader.read(4096), WAIT)
        writer.close()
        # a client trusting the system's CAs, or a CA of its own, does not trust the server, and
        # is told which setting to fix (at once, not after a hang: nats-py alone hangs here)
        for url, ca in [
            (f"tls://bcx:{password}@127.0.0.1:{node.client_port}", None),
            (f"nats://bcx:{password}@127.0.0.1:{node.client_port}", None),  # nats-py upgrades
            (f"tls://bcx:{password}@127.0.0.1:{node.client_port}", str(stranger)),
        ]:
            with pytest.raises(BcError) as err:
                await connect(url, name="test-untrusted", ca=ca, allow_reconnect=False)
            assert (err.value.code, err.value.details["path"]) == (ErrorCode.INVALID_CONFIG, "nats_ca")
            assert password not in str(err.value)
    # the bus CA and a wrong password: refused as such, not "cannot reach"
    with pytest.raises(BcError) as err:
        await connect(f"tls://bcx:wrong@127.0.0.1:{stack.hub[0].client_port}", name="t", ca=str(stack.ca))
    assert err.value.code is ErrorCode.UNAUTHENTICATED
    for node in stack.hub:  # the routes and the leaf link came up over these listeners
        _, varz = await asyncio.to_thread(node.monitor, "/varz")
        tls = [varz.get("tls_required"), varz.get("tls_verify")]  # clients prove who they are by password
        tls += [varz[k].get(f) for k in ("cluster", "leaf") for f in ("tls_required", "tls_verify")]
        assert tls == [
            True, None, True, True, True, True,
        ], node.name  # fmt: skip
    _, varz = await asyncio.to_thread(stack.leaf.monitor, "/varz")
    assert varz["tls_required"], varz
    for node in [*stack.hub, stack.leaf]:
        for var, value in node.env.items():
            if var.endswith("_PASSWORD"):
                assert value.startswith('"$2b$'), var
                assert value not in stack.passwords.values(), var


async def test_a_node_does_not_read_the_site_agents_replies(stack: Stack) -> None:
    """Issue 23 M4, the part that config can fix: the site agent hears its replies on
    ``_INBOX.site-agent.>``, which the site's ``node`` user (whose password the boot network
    sees) may not read; the node's own replies still reach it. Nodes still share one user: per-agent
    identities are docs/security.md's design."""
    cmdq = await stack.connect("command-queue")

    async def welcome(msg: Msg) -> None:
        await msg.respond(b"welcome " + msg.subject.encode())

    await cmdq.subscribe("bc.agent.*.*.hello", queue="cmdq", cb=welcome)
    await cmdq.flush()
    node = await stack.connect("node", stack.leaf)
    sniff_all = await node.subscribe("_INBOX.>")
    await node.subscribe(f"{SITE_AGENT_INBOX_PREFIX}.>")
    await node.flush()
    agent = await stack.connect("site-agent", stack.leaf)
    hello = SUBJECTS.agent_event("eu1", "site1", "hello")
    reply = await eventually(
        "the site agent's hello answered", lambda: agent.request(hello, b"hi", timeout=1)
    )
    assert reply.data == b"welcome " + hello.encode()
    assert reply.subject.startswith(SITE_AGENT_INBOX_PREFIX + ".")
    assert [s for s in await _drain(sniff_all) if s.startswith(SITE_AGENT_INBOX_PREFIX)] == []
    await eventually(
        "the refusal", functools.partial(_refused, stack, "node", f"{SITE_AGENT_INBOX_PREFIX}.>")
    )

    mine = SUBJECTS.agent_event("eu1", "node1", "hello")  # the node's own replies still come
    assert (await node.request(mine, b"hi", timeout=5)).data == b"welcome " + mine.encode()
    await agent.subscribe("_INBOX.>")  # and the site agent hears nothing but its own
    await agent.flush()
    await eventually("the site agent's refusal", functools.partial(_refused, stack, "site-agent", "_INBOX.>"))
