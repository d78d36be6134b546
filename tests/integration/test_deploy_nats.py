"""deploy/nats: a 3-node hub cluster and a site leaf node, run from the committed files.

Each nats-server runs as its own process with ``-c deploy/nats/<file>``; the test supplies
only what the files read from the environment (addresses, store folders, passwords), so
what is checked here is what an operator installs (tests/support/deploy_stack.py).

The leaf's agents connect through its auth callout, answered by ``bc-pki callout`` as its own
process; here the test plays bc-pki (its CA issues the agents' certificates, and it answers the
responder's ``certs.get``), since what is checked is what NATS lets each one do.
tests/integration/test_deploy_callout.py runs the real bc-pki behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from urllib.parse import quote, urlsplit

import nats.errors
import nats.js.errors
import pytest
import pytest_asyncio
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext, api

from better_compute.cli.bus_commands import CA_KEY
from better_compute.config import EventsSettings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.crypto import issue_bus_certificate, new_bus_ca
from better_compute.logging import get_logger
from better_compute.runtime.embedded import nats_server_binary
from better_compute.service.audit import requester
from better_compute.service.client import connect, tls_context
from better_compute.service.events import ensure_events_stream
from better_compute.testing import bcx
from better_compute.wire.envelope import unwrap
from deploy_stack import DEPLOY, SERVICES, SUBJECTS, WAIT, Stack, eventually, inbox_prefix, run_stack

EU1 = SUBJECTS.site_stream("eu1")


@pytest_asyncio.fixture(loop_scope="session")
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    async with run_stack(tmp_path) as st:
        yield st


async def _agents(stack: Stack) -> None:
    """The leaf's auth callout, answering: its responder as a process, the test as bc-pki."""
    await stack.answer_certs_get()
    stack.start_responder()
    await stack.responder_ready()


async def _agent(stack: Stack, agent_id: str, *, role: str = "node") -> Nats:
    """Agent ``agent_id`` of eu1 connected to the leaf with its certificate, as itself."""
    return await stack.connect_agent(agent_id, stack.agent_tls(agent_id, role=role))


def _site_js(nc: Nats, site: str) -> JetStreamContext:
    """The JetStream of a site's leaf, as the command queue reaches it across the link: the
    site's domain (bc.toml cmdq.site_domain = "{site}")."""
    return nc.jetstream(domain=site, timeout=5)


async def _site_stream(nc: Nats, site: str) -> str:
    """The site's command stream and results stream on its leaf (eu1's: the one leaf here), as
    the command queue makes them (bc_command_queue.delivery, cmdq.site_domain)."""
    js = _site_js(nc, site)
    for name, subject in [
        (SUBJECTS.site_stream(site), SUBJECTS.site_cmd_all(site)),
        (SUBJECTS.site_results_stream(site), SUBJECTS.site_results_all(site)),
    ]:
        config = api.StreamConfig(
            name=name,
            subjects=[subject],
            retention=api.RetentionPolicy.WORK_QUEUE,
            storage=api.StorageType.FILE,
            num_replicas=1,
            duplicate_window=120.0,
        )
        await eventually(f"stream {name}", functools.partial(js.add_stream, config))
    return SUBJECTS.site_stream(site)


async def _hub_stream(nc: Nats, site: str) -> str:
    """A command stream on the hub cluster, R3 (a site whose leaf is not in this stack: the
    hub's JetStream and its permissions still take one, as without cmdq.site_domain)."""
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


async def _agent_consumer(nc: Nats, site: str, agent: str, *, on_hub: bool = False) -> None:
    """The agent's durable pull consumer, as the command queue makes it on the agent's hello
    (on the site's leaf; ``on_hub``: on the hub's stream of ``_hub_stream``)."""
    config = api.ConsumerConfig(
        durable_name=agent,
        filter_subject=SUBJECTS.site_cmd(site, agent),
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=30.0,
    )
    js = nc.jetstream(timeout=5) if on_hub else _site_js(nc, site)
    await js.add_consumer(SUBJECTS.site_stream(site), config)


async def _fetch_one(nc: Nats, stream: str, consumer: str, *, timeout: float = 3.0) -> Msg:
    """One message of ``consumer``. A consumer just made on a cluster may not have elected its
    leader yet: its pull request then has no responder (503, nothing delivered) and is asked
    again; a fetch that times out still fails."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while True:
        psub = await nc.jetstream(timeout=5).pull_subscribe_bind(durable=consumer, stream=stream)
        try:
            (msg,) = await psub.fetch(1, timeout=timeout)
            return msg
        except nats.js.errors.ServiceUnavailableError:
            if loop.time() > deadline:
                raise
        finally:
            await psub.unsubscribe()
        await asyncio.sleep(0.2)


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


def _code(name: str) -> str:
    """A file of deploy/nats without its comment lines."""
    lines = (DEPLOY / name).read_text().splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith("#"))


def _start_server(conf: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        argv = [str(nats_server_binary()), "-c", str(conf)]
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)


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
    stream = await _hub_stream(cmdq_1, "us1")
    info = await cmdq_2.jetstream().stream_info(stream)
    assert info.config.num_replicas == 3
    assert info.cluster is not None
    assert info.cluster.leader in {s.name for s in stack.hub}
    assert len(info.cluster.replicas or []) == 2

    ack = await cmdq_1.jetstream().publish(
        SUBJECTS.site_cmd("us1", "agent1"), b"power-on", headers={"Nats-Msg-Id": "c1:agent1"}
    )
    assert (ack.stream, ack.seq) == (stream, 1)
    await _agent_consumer(cmdq_2, "us1", "agent1", on_hub=True)
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

    await _agents(stack)
    agent = await _agent(stack, "agent1", role="site")
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

    # its commands: pulled from the leaf's own JetStream (the site's domain), and acknowledged
    msg = await _fetch_one(agent, stream, "agent1", timeout=5)
    assert (msg.subject, msg.data) == (SUBJECTS.site_cmd("eu1", "agent1"), b"boot-pxe")
    await msg.ack()
    info = await agent.jetstream().consumer_info(stream, "agent1")
    assert info.name == "agent1"

    async def drained(name: str) -> bool | None:
        state = (await _site_js(cmdq, "eu1").stream_info(name)).state
        return True if state.messages == 0 else None  # work queue: gone once acknowledged

    await eventually("the command queue sees the ack", functools.partial(drained, stream))

    # its result: stored on the leaf, read by the command queue across the link and acked
    results = SUBJECTS.site_results_stream("eu1")
    stored = await agent.jetstream(timeout=5).publish(SUBJECTS.site_results("eu1", "agent1"), b"done")
    assert (stored.stream, stored.domain) == (results, "eu1")
    reader = await _site_js(cmdq, "eu1").pull_subscribe(
        SUBJECTS.site_results_all("eu1"), durable="command-queue", stream=results
    )
    (got,) = await reader.fetch(1, timeout=5)
    assert (got.subject, got.data) == (SUBJECTS.site_results("eu1", "agent1"), b"done")
    await got.ack()
    await eventually("the result read", functools.partial(drained, results))

    heartbeat = SUBJECTS.agent_event("eu1", "agent1", "heartbeat")
    await agent.publish(heartbeat, b"alive")

    async def heard() -> Msg | None:
        msg = await events.next_msg(timeout=1)
        return msg if msg.subject == heartbeat else None  # skips the hello seen before

    assert (await eventually("heartbeat on the hub", heard, timeout=5)).data == b"alive"
    assert not stack.errors["agent1"], stack.errors


async def test_site_agent_is_confined_to_its_site(stack: Stack) -> None:
    cmdq = await stack.connect("command-queue")
    bcx = await stack.connect("bcx")
    secrets_svc = await stack.connect("secrets")
    await _site_stream(cmdq, "eu1")
    us1 = await _hub_stream(cmdq, "us1")
    await _agent_consumer(cmdq, "us1", "agent9", on_hub=True)
    await cmdq.jetstream().publish(SUBJECTS.site_cmd("us1", "agent9"), b"wipe")
    events = await cmdq.subscribe("bc.agent.>")

    async def get(msg: Msg) -> None:
        await msg.respond(b"control-plane-secret")

    await secrets_svc.subscribe("bc.api.secrets.secrets.get", cb=get)
    await secrets_svc.flush()
    await cmdq.flush()

    await _agents(stack)
    agent = await _agent(stack, "agent1", role="site")
    node = await _agent(stack, "node1")
    inboxes = await node.subscribe("_INBOX.node1.>")  # allowed to bcd: its own replies come there
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
        errs = stack.errors["agent1"]
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

    # replies to the control plane's own requests never reach a site
    got = await bcx.request("bc.api.secrets.secrets.get", b"ref", timeout=5)
    assert got.data == b"control-plane-secret"
    assert await _drain(inboxes) == []


async def test_stream_survives_losing_its_leader(stack: Stack) -> None:
    """A stream of the hub (R3) takes writes again once a new leader is chosen; and the site's
    leaf, whose link may have been to the killed node, reconnects to another one, through which
    the command queue reaches the site's own streams again."""
    cmdq = await stack.connect("command-queue")
    stream = await _hub_stream(cmdq, "us1")
    await _agent_consumer(cmdq, "us1", "agent1", on_hub=True)
    eu1 = await _site_stream(cmdq, "eu1")
    await _agent_consumer(cmdq, "eu1", "agent1")
    js = cmdq.jetstream(timeout=2)
    await js.publish(SUBJECTS.site_cmd("us1", "agent1"), b"before")
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
        js.publish, SUBJECTS.site_cmd("us1", "agent1"), b"after", headers={"Nats-Msg-Id": "after"}
    )
    assert (await eventually("publish after the kill", after)).seq == 2
    psub = await js.pull_subscribe_bind(durable="agent1", stream=stream)
    got: list[bytes] = []

    async def fetch_both() -> bool | None:
        # the consumer chooses its own leader after the stream's: a fetch meanwhile answers 503
        # (a fresh-clone run failed on it with ServiceUnavailableError); until then, not yet
        got.extend(m.data for m in await psub.fetch(2 - len(got), timeout=2))
        return True if len(got) == 2 else None

    await eventually("the consumer's new leader serves a fetch", fetch_both)
    assert got == [b"before", b"after"]

    # the site's leaf (which moves to a surviving hub node if it has to) takes the next one
    to_eu1 = functools.partial(
        js.publish, SUBJECTS.site_cmd("eu1", "agent1"), b"after", headers={"Nats-Msg-Id": "eu1-after"}
    )
    assert (await eventually("publish to eu1 after the kill", to_eu1)).seq == 2
    await _agents(stack)
    agent = await eventually("the agent connects", lambda: _agent(stack, "agent1", role="site"))
    apsub = await agent.jetstream(timeout=5).pull_subscribe_bind(durable="agent1", stream=eu1)
    read: list[bytes] = []

    async def read_both() -> bool | None:
        for msg in await apsub.fetch(2 - len(read), timeout=1):
            read.append(msg.data)
            await msg.ack()
        return True if len(read) == 2 else None

    await eventually("both commands on the leaf", read_both)
    assert read == [b"before", b"after"]


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
        others = [inbox_prefix(o) + ".>" for o in clients if o != user]
        heard[user] = [await nc.subscribe(subject) for subject in [*others, "_INBOX.>", "_INBOX_OPS.>"]]
        await nc.flush()
    for user, subject in asks.items():
        reply = await eventually(
            f"{user} asks", lambda u=user, s=subject: clients[u].request(s, b"{}", timeout=1)
        )
        assert reply.data == b"for " + subject.encode()

    for user in clients:
        for subject in [*(inbox_prefix(o) + ".>" for o in clients if o != user), "_INBOX.>", "_INBOX_OPS.>"]:
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
    TLS with certificates from the bus CA (the stack formed), the leaf takes no client without a
    certificate, and the servers' environment holds only bcrypt hashes."""
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
    assert (varz["tls_required"], varz.get("tls_verify")) == (True, True), varz
    # on the leaf every client shows a certificate: a password alone gets no connection
    with pytest.raises(BcError):
        await connect(
            f"tls://bcx:{password}@127.0.0.1:{stack.leaf.client_port}", name="t", ca=str(stack.ca),
            allow_reconnect=False,
        )  # fmt: skip
    for node in [*stack.hub, stack.leaf]:
        for var, value in node.env.items():
            if var.endswith("_PASSWORD"):
                assert value.startswith('"$2b$'), var
                assert value not in stack.passwords.values(), var


async def test_the_leaf_link_authenticates_by_the_leaf_certificate_alone(stack: Stack) -> None:
    """Issue 23: the leaf kept its own password in plain text (nats-leaf.env) to dial the hub.
    Now the hub maps the leaf's certificate to the site's leaf user (verify_and_map): no leaf
    password exists, the link still carries the site's traffic, and a leaf node dialing with
    another certificate of the bus CA, or with none, gets no link."""
    # no leaf password: not in the leaf's dial addresses, the hub's environment or its configs
    for text in [stack.leaf.env, stack.hub[0].env]:
        assert not any(var.startswith("BC_NATS_LEAF_") and var.endswith("_PASSWORD") for var in text), text
    for var, value in stack.leaf.env.items():
        if var.startswith("BC_NATS_HUB_"):
            assert urlsplit(value).username is None, var
            assert urlsplit(value).password is None, var
    for name in ["nats-leaf.env.example", "nats.env.example", "hub-site-eu1.conf", "leaf-site.conf"]:
        code = _code(name)
        assert "leaf-eu1:" not in code, name
        assert "LEAF_EU1_PASSWORD" not in code, name
    assert "password" not in _code("hub-site-eu1.conf")
    # the link carries the site's traffic: the leaf's responder asks bc-pki (the test, on the
    # hub) about a certificate, up the link and back
    await stack.answer_certs_get()
    stack.agent_tls("agent1")
    (cert_id,) = stack.certs
    made = stack.callout
    assert made is not None
    responder = await connect(
        f"tls://callout:{made.password.read_text().strip()}@127.0.0.1:{stack.leaf.client_port}",
        name="test-callout", tls=stack.client_tls("callout", made.responder_cert.read_bytes(),
                                                  made.responder_key.read_bytes()),
        inbox_prefix="_INBOX.callout",
    )  # fmt: skip
    stack.clients.append(responder)
    ask = json.dumps({"certId": cert_id}).encode()
    reply = await eventually(
        "certs.get across the leaf link", lambda: responder.request(SUBJECTS.api("pki", "certs", "get"), ask)
    )
    assert unwrap(reply.data)["certId"] == cert_id
    # the leaf's user has no password, but only a leaf link can be it: a client naming it is refused
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.hub[0].client_port)
    await asyncio.wait_for(reader.readline(), WAIT)  # INFO, then TLS
    await writer.start_tls(tls_context(str(stack.ca)), server_hostname="localhost")
    writer.write(b'CONNECT {"user":"CN=bc-leaf-eu1,O=Better Compute","pass":"","verbose":false}\r\nPING\r\n')
    await writer.drain()
    answer = await asyncio.wait_for(reader.readline(), WAIT)
    writer.close()
    assert answer.startswith(b"-ERR 'Authorization Violation'"), answer
    # a leaf node of a stranger: the site's joining certificate (bus CA, mapped to no leaf user),
    # the same naming the leaf user, and no certificate at all, one hub node each; and a bus
    # certificate whose DNS name is a service user's (`bcx bus cert --dns engine`), which
    # verify_and_map maps to that user
    ports = [int(node.env["BC_NATS_LEAF_LISTEN"].rsplit(":", 1)[1]) for node in stack.hub]
    join = f'cert_file: "{made.joining_cert}", key_file: "{made.joining_key}", '
    cert, key = issue_bus_certificate(
        stack.ca.read_bytes(),
        (stack.ca.parent / CA_KEY).read_bytes(),
        name="x",
        dns=["engine", "localhost"],
        ips=[],
    )
    engine_cert, engine_key = stack.folder / "engine-named.pem", stack.folder / "engine-named-key.pem"
    engine_cert.write_bytes(cert)
    engine_key.write_bytes(key)
    engine = f'cert_file: "{engine_cert}", key_file: "{engine_key}", '
    remotes = [
        (f"nats-leaf://127.0.0.1:{ports[0]}", join),
        (f"nats-leaf://{quote('CN=bc-leaf-eu1,O=Better Compute')}@127.0.0.1:{ports[1]}", join),
        (f"nats-leaf://127.0.0.1:{ports[2]}", ""),
        (f"nats-leaf://localhost:{ports[0]}", engine),
    ]
    conf = stack.folder / "rogue-leaf.conf"
    conf.write_text(
        "server_name: rogue\nlisten: 127.0.0.1:-1\naccounts { A: {}, B: {}, C: {}, D: {} }\n"
        + "leafnodes { remotes: [\n"
        + "".join(
            f'{{ url: "{url}", account: {acc}, tls {{ {cert}ca_file: "{stack.ca}", timeout: 5 }} }}\n'
            for (url, cert), acc in zip(remotes, "ABCD", strict=True)
        )
        + "] }\n"
    )
    log = stack.folder / "rogue-leaf.log"
    rogue = _start_server(conf, log)
    try:

        async def refused_everywhere() -> bool | None:
            lines = log.read_text(errors="replace").splitlines()
            seen = [
                any(f":{port} " in ln and what in ln for ln in lines)
                for port, what in zip(
                    ports, ["'Authorization Violation'"] * 2 + ["Leafnode connection closed"], strict=True
                )
            ]
            # the hub names the user it mapped the engine-named certificate to, and refuses it
            seen.append(
                'authentication error - User "engine"' in stack.hub[0].log.read_text(errors="replace")
            )
            return True if all(seen) else None

        # the two with a certificate are told "Authorization Violation"; the one without fails
        # the TLS handshake (the hub wants a certificate)
        await eventually("every rogue leaf dial refused", refused_everywhere)
        # the hub lets none of them in: the only leaf it holds is eu1's own
        leafs = []
        for node in stack.hub:
            _, leafz = await asyncio.to_thread(node.monitor, "/leafz")
            leafs += [leaf.get("account") for leaf in leafz.get("leafs") or []]
        assert leafs == ["SITE_EU1"], (leafs, log.read_text(errors="replace"))
    finally:
        rogue.kill()
        rogue.wait(timeout=WAIT)


async def test_each_agent_reads_and_pulls_only_its_own(stack: Stack) -> None:
    """Issue 23 M4: every bcd of a site shared the ``node`` user, which pulled, read and
    terminated any consumer of its site (the site agent's too) and read every node's replies.
    Now each agent is a NATS user of its own (the leaf's auth callout): a bcd reads nothing of the
    site agent's (its consumer, its replies) nor of another bcd's, and the site agent pulls no
    other agent's consumer. Each one's own replies and commands still come."""
    cmdq = await stack.connect("command-queue")
    stream = await _site_stream(cmdq, "eu1")
    for agent_id in ("site1", "node1", "node2"):
        await _agent_consumer(cmdq, "eu1", agent_id)
        await cmdq.jetstream().publish(SUBJECTS.site_cmd("eu1", agent_id), f"for {agent_id}".encode())

    async def welcome(msg: Msg) -> None:
        await msg.respond(b"welcome " + msg.subject.encode())

    await cmdq.subscribe("bc.agent.*.*.hello", queue="cmdq", cb=welcome)
    await cmdq.flush()
    await _agents(stack)
    site = await _agent(stack, "site1", role="site")
    node1 = await _agent(stack, "node1")
    node2 = await _agent(stack, "node2")

    # everyone tries to hear everyone else's replies, and all of them at once
    sniffers = {
        "node1": [await node1.subscribe(s) for s in ("_INBOX.>", "_INBOX.site1.>", "_INBOX.node2.>")],
        "node2": [await node2.subscribe(s) for s in ("_INBOX.>", "_INBOX.site1.>", "_INBOX.node1.>")],
        "site1": [await site.subscribe(s) for s in ("_INBOX.>", "_INBOX.node1.>")],
    }
    for nc in (site, node1, node2):
        await nc.flush()
    for name, nc in [("site1", site), ("node1", node1), ("node2", node2)]:
        hello = SUBJECTS.agent_event("eu1", name, "hello")
        reply = await eventually(f"{name}'s hello", lambda nc=nc, h=hello: nc.request(h, b"hi", timeout=1))
        assert reply.data == b"welcome " + hello.encode()
        assert reply.subject.startswith(f"_INBOX.{name}.")
        # its own command, pulled from the leaf's JetStream
        assert (await _fetch_one(nc, stream, name, timeout=5)).data == f"for {name}".encode()

    # another agent's consumer: the pull never leaves the leaf (a node's, the site agent's)
    for nc, other in [(node1, "site1"), (node1, "node2"), (site, "node1")]:
        psub = await nc.jetstream().pull_subscribe_bind(durable=other, stream=stream)
        with pytest.raises(TimeoutError):
            await psub.fetch(1, timeout=1)
    # ... nor does asking about it, or terminating its message
    await node1.publish(f"$JS.API.CONSUMER.INFO.{stream}.site1", b"")
    await node1.publish(f"$JS.ACK.{stream}.site1.1.1.1.1.1", b"+TERM")
    await node1.publish(SUBJECTS.agent_event("eu1", "site1", "heartbeat"), b"forged")
    await node1.flush()
    for who, subjects in {
        "node1": [
            "_INBOX.>", "_INBOX.site1.>", "_INBOX.node2.>",
            f"$js.api.consumer.msg.next.{stream}.site1", f"$js.api.consumer.msg.next.{stream}.node2",
            f"$js.api.consumer.info.{stream}.site1", f"$js.ack.{stream}.site1",
            "bc.agent.eu1.site1.heartbeat",
        ],
        "node2": ["_INBOX.>", "_INBOX.site1.>", "_INBOX.node1.>"],
        "site1": ["_INBOX.>", "_INBOX.node1.>", f"$js.api.consumer.msg.next.{stream}.node1"],
    }.items():  # fmt: skip
        for subject in subjects:
            await eventually(f"{who} refused {subject}", functools.partial(_refused, stack, who, subject))
    for who, subs in sniffers.items():
        for sub in subs:
            assert await _drain(sub, wait=0.2) == [], (who, sub.subject)
    # the site agent's command was pulled by it alone and acked by nobody: still there
    info = await _site_js(cmdq, "eu1").consumer_info(stream, "site1")
    assert info.num_ack_pending == 1


async def test_a_machine_without_a_certificate_may_only_join(stack: Stack) -> None:
    """Issue 23: a machine that has no certificate yet connects with the site's joining
    certificate. It may ask bc-pki to join and hear its own answer, nothing else: no events, no
    commands, no other joining machine's answer, no agent's replies."""
    pki = await stack.connect("pki")

    async def joined(msg: Msg) -> None:
        await msg.respond(b"joined")

    await pki.subscribe("bc.api.pki.agents.join", queue="pki", cb=joined)
    await pki.flush()
    await _agents(stack)
    machine = await stack.connect_joining()
    other = await stack.connect_joining()
    sniff = [await machine.subscribe(s) for s in ("_INBOX.>", "_INBOX.join.>")]
    await machine.flush()
    reply = await eventually(
        "a join answered", lambda: other.request("bc.api.pki.agents.join", b"{}", timeout=1)
    )
    assert reply.data == b"joined"
    assert (await machine.request("bc.api.pki.agents.join", b"{}", timeout=5)).data == b"joined"
    for subject in [
        SUBJECTS.agent_event("eu1", "node1", "hello"), "bc.api.secrets.secrets.fetch",
        f"$JS.API.CONSUMER.MSG.NEXT.{EU1}.node1", "bc.api.pki.tokens.burn", "bc.api.pki.tokens.confirm",
    ]:  # fmt: skip
        await machine.publish(subject, b"{}")
    await machine.flush()
    for subject in [
        "_INBOX.>", "_INBOX.join.>", "bc.agent.eu1.node1.hello", "bc.api.secrets.secrets.fetch",
        f"$js.api.consumer.msg.next.{EU1}.node1", "bc.api.pki.tokens.burn",
        "bc.api.pki.tokens.confirm",
    ]:  # fmt: skip
        await eventually(f"refused {subject}", functools.partial(_refused, stack, "joining", subject))
    for sub in sniff:
        assert await _drain(sub, wait=0.2) == [], sub.subject
