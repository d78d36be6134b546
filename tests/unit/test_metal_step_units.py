"""Metal's shipped steps, each with small fakes for the command queue, the store and bc-pki.

Over 400 lines: the fakes are shared by every step's tests, and splitting the file would mean
a second copy of them or a fakes module no other test uses.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from bc_engine.metal.relay import relay_bmc
from better_compute.app import better_compute
from better_compute.core.errors import BcError, ErrorCode
from better_compute.metal import metal
from better_compute.metal.steps import deploy as deploy_module
from better_compute.metal.steps import http_via_site
from better_compute.metal.steps.http import NODE_ADDRESSES
from better_compute.metal.steps.inventory import STORE_INVENTORY
from better_compute.metal.steps.joined import JOINED_SINCE
from better_compute.metal.steps.ramdisk import RAMDISK_OVERRIDE
from better_compute.provision import Step, StepNotReady
from better_compute.provision.results import LATEST_RESULT
from better_compute.wire.cmdq import CommandView, EnqueueCommand
from better_compute.wire.commands import NodeCpus, NodeInventoryResult, NodeMemory

pytestmark = pytest.mark.unit

APP = better_compute(modules=[metal()])
STEPS = {step.id: step for step in metal().steps}
BMC = {"driver": "redfish", "address": "https://10.0.0.9", "credentialsRef": "sec_00000000000000000000000000"}
WF = "wf_0000000000000001"


@dataclass
class Node:
    id: str = "node_0000000000000001"
    site_id: str = "lab1"
    tenant_id: str = "root"
    labels: dict[str, str] = field(default_factory=dict)
    macs: tuple[str, ...] = ("52:54:00:00:00:01", "52:54:00:00:00:02")
    bmc: dict[str, Any] | None = field(default_factory=lambda: dict(BMC))
    state: str = "enrolled"


class Queue:
    """``ctx.commands`` and the command queue behind it: the engine's BMC relay (``relay_bmc``,
    from ``node``), then find-before-create by key; ``hold`` kinds stay pending."""

    def __init__(self, *, attested: bool = True, results: dict[str, Any] | None = None) -> None:
        self.node: Node | None = None
        self.views: dict[str, CommandView] = {}
        self.sent: list[EnqueueCommand] = []
        self.hold: set[str] = set()
        self.attested = attested
        self.results = results or {}

    async def enqueue(self, cmd: EnqueueCommand) -> CommandView:
        bmc = self.node.bmc if self.node is not None and self.node.id == cmd.node_id else None
        cmd = msgspec.structs.replace(cmd, payload=relay_bmc(APP, cmd.kind, cmd.payload, cmd.node_id, bmc))
        view = self.views.get(cmd.key)
        if view is None:
            self.sent.append(cmd)
            result = json.dumps(self.results.get(cmd.kind, {"ok": True})).encode()
            view = CommandView(
                id=f"cmd_{len(self.sent)}", node_id=cmd.node_id, site_id=cmd.site_id, kind=cmd.kind,
                key=cmd.key, state="pending", result=result, target=cmd.target, payload=cmd.payload,
                attested=self.attested and cmd.target == "node",
            )  # fmt: skip
        if view.state == "pending" and view.kind not in self.hold:
            view = CommandView(
                **{**{f: getattr(view, f) for f in view.__struct_fields__}, "state": "succeeded"}
            )
        self.views[cmd.key] = view
        return view

    async def site_agent_for(self, node_id: str) -> str | None:
        return "agent_site"

    def keys(self) -> list[str]:
        return [c.key.removeprefix(f"wf:{WF}:") for c in self.sent]


class Sql:
    """The statements metal's steps run, over a dict."""

    def __init__(self) -> None:
        self.results: dict[str, Any] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.since = datetime(2026, 1, 1, tzinfo=UTC)
        self.override_reads = 0

    async def query(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        if sql == LATEST_RESULT:
            found = self.results.get(args[1])
            return [] if found is None else [{"result": json.dumps(found)}]
        if sql == STORE_INVENTORY:
            self.nodes.setdefault(args[0], {})["inventory"] = json.loads(args[1])
            return []
        if sql == deploy_module.NODE_IMAGE:
            return [{"image": self.nodes.get(args[0], {}).get("image")}]
        if sql == JOINED_SINCE:
            return [{"since": self.since}]
        if sql == NODE_ADDRESSES:
            node = self.nodes.get(args[0], {})
            return [{"label": node.get("address"), "addresses": node.get("addresses")}]
        if sql == RAMDISK_OVERRIDE:
            self.override_reads += 1
            return []  # no operator's ramdisk (bcx ramdisk set): the step's own
        raise AssertionError(f"unexpected statement {sql}")

    @asynccontextmanager
    async def _tx(self) -> AsyncIterator[Sql]:
        yield self

    def transaction(self) -> Any:
        return self._tx()


@dataclass
class Cert:
    cert_id: str
    role: str
    created_at: datetime
    state: str = "valid"


class Pki:
    def __init__(self) -> None:
        self.certs: list[Cert] = []
        self.issued: list[dict[str, Any]] = []

    async def issue_join_token(self, **kw: Any) -> Any:
        """``ctx.pki`` (StepPki): keyed by the attempt, so every run gets the same token back."""
        self.issued.append(kw)
        return SimpleNamespace(join_token_id="tok_1", token="bcjt_" + "t" * 43)

    async def certificates(self, *, agent_id: str) -> list[Cert]:
        return list(self.certs)


class Secrets:
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.for_node: dict[str, bool] = {}

    async def put(
        self,
        value: bytes,
        *,
        idempotency_key: str | None = None,
        label: str | None = None,
        for_node: bool = False,
    ) -> str:
        ref = f"sec_{idempotency_key or len(self.values)}"
        self.values.setdefault(ref, value)  # the first write wins
        self.for_node[ref] = for_node
        return ref


class Log:
    def __init__(self) -> None:
        self.events: list[str] = []

    def warning(self, event: str, **_kw: Any) -> None:
        self.events.append(event)


@dataclass
class Ctx:
    node: Node | None = field(default_factory=Node)
    commands: Queue = field(default_factory=Queue)
    sql: Sql = field(default_factory=Sql)
    pki: Pki | None = field(default_factory=Pki)
    secrets: Secrets | None = field(default_factory=Secrets)
    log: Log = field(default_factory=Log)
    workflow_id: str = WF
    step: int = 3
    attempt: int = 1
    batch_id: str | None = None
    profile: Any = None
    provision: Any = None
    found: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.commands.node = self.node  # as the engine relays the workflow's node's BMC

    async def once(self, name: str, load: Callable[[], Awaitable[Any]]) -> Any:
        if name not in self.found:  # one Ctx is one attempt, as the engine's memo
            self.found[name] = await load()
        return self.found[name]

    @property
    def idempotency_key(self) -> str:
        return f"wf:{self.workflow_id}:{self.step}#{self.attempt}"


async def run(step_id: str, with_: dict[str, Any], ctx: Ctx) -> Any:
    step: Step = STEPS[step_id]
    assert step.run is not None
    return await step.run(step.input.validate(with_), ctx)  # type: ignore[arg-type]


async def refused(call: Callable[[], Coroutine[Any, Any, Any]]) -> BcError:
    with pytest.raises(BcError) as info:
        await call()
    return info.value


# -- the BMC steps ------------------------------------------------------------------------


def test_bmc_steps_relay_to_the_site_and_declare_their_one_non_destructive_kind() -> None:
    for name in ("power.setPower", "management.setBootDevice", "media.insert", "media.eject"):
        step = STEPS[name]
        assert (step.runs_on, step.relays, step.sends) == ("control-plane", ("site",), (name,))
        assert not metal().command_kinds[[k.name for k in metal().command_kinds].index(name)].destructive


async def test_power_sends_the_nodes_bmc_to_its_site_agent() -> None:
    ctx = Ctx()
    got = await run("power.setPower", {"action": "cycle"}, ctx)
    [cmd] = ctx.commands.sent
    assert (cmd.kind, cmd.target, cmd.site_id, cmd.key) == ("power.setPower", "site", "lab1", f"wf:{WF}:3#1")
    assert cmd.payload == {"action": "cycle", "bmc": BMC}  # the reference, never a password
    assert got == {"commandId": "cmd_1", "result": {"ok": True}, "action": "cycle"}


async def test_a_node_without_a_bmc_is_invalid_state_and_nothing_is_sent() -> None:
    ctx = Ctx(node=Node(bmc=None))
    err = await refused(lambda: run("management.setBootDevice", {"device": "pxe"}, ctx))
    assert (err.code, err.reason, err.path) == (ErrorCode.INVALID_STATE, "no-bmc", "bmc")
    assert "has no BMC" in err.message
    assert ctx.commands.sent == []


async def test_media_insert_reads_from_steps_url_from_the_store() -> None:
    ctx = Ctx()
    ctx.sql.results["autoinstall.renderIso"] = {"url": "https://cache.site-a/a.iso", "sha256": "ab" * 32}
    got = await run("media.insert", {"fromStep": "autoinstall.renderIso"}, ctx)
    [cmd] = ctx.commands.sent
    assert cmd.payload == {
        "url": "https://cache.site-a/a.iso",
        "device": "cd",
        "bmc": BMC,
        "sha256": "ab" * 32,
    }
    assert got["url"] == "https://cache.site-a/a.iso"


@pytest.mark.parametrize(
    ("with_", "code", "path"),
    [
        ({"fromStep": "autoinstall.renderIso"}, ErrorCode.NOT_FOUND, "fromStep"),  # not run (yet)
        ({"fromStep": "other.step"}, ErrorCode.INVALID_INPUT, "fromStep"),  # returned no url
        ({"fromStep": "other.step", "url": "https://x/a.iso"}, ErrorCode.INVALID_INPUT, "fromStep"),
        ({}, ErrorCode.INVALID_INPUT, "url"),
    ],
)
async def test_media_insert_refusals(with_: dict[str, Any], code: ErrorCode, path: str) -> None:
    ctx = Ctx()
    ctx.sql.results["other.step"] = {"ref": "sec_x"}
    err = await refused(lambda: run("media.insert", with_, ctx))
    assert (err.code, err.path) == (code, path)
    assert ctx.commands.sent == []


# -- metal.ensureRamdisk ------------------------------------------------------------------

RAMDISK = {"kernel": "https://cache/vmlinuz", "initrd": "https://cache/initrd"}


async def test_ensure_ramdisk_sends_each_command_once_across_re_runs() -> None:
    ctx = Ctx()
    ctx.commands.hold.add("netboot.setEntry")
    for _ in range(2):  # woken twice while the first boot entry is still pending
        with pytest.raises(StepNotReady):
            await run("metal.ensureRamdisk", RAMDISK, ctx)
    assert ctx.commands.keys() == ["3#1:boot-device", "3#1:netboot-0"]

    ctx.commands.hold.clear()
    got = await run("metal.ensureRamdisk", RAMDISK, ctx)
    assert ctx.commands.keys() == ["3#1:boot-device", "3#1:netboot-0", "3#1:netboot-1", "3#1:power-cycle"]
    boot, entry, _, cycle = ctx.commands.sent
    assert boot.payload == {"device": "pxe", "persistent": False, "bmc": BMC}
    ref = "sec_ramdisk-join-token"
    assert entry.payload == {
        **RAMDISK, "cmdline": "", "mac": "52:54:00:00:00:01", "oneTime": True, "joinTokenRef": ref,
    }  # fmt: skip
    assert cycle.payload == {"action": "cycle", "bmc": BMC}
    assert [e["mac"] for e in got["netbootEntries"]] == list(Node().macs)
    # the ramdisk's join token: single use, a node token of the node's site, bound to the MAC
    # it boots from, stored as a secret; only its id is in the result, only its ref in commands
    assert ctx.pki is not None
    assert ctx.secrets is not None
    assert {(t["role"], t["max_uses"], t["site_id"], t["expect"]["mac"]) for t in ctx.pki.issued} == {
        ("node", 1, "lab1", "52:54:00:00:00:01")
    }
    assert ctx.secrets.values == {ref: ("bcjt_" + "t" * 43).encode()}
    assert got["joinTokenId"] == "tok_1"
    assert "bcjt_" not in json.dumps(got) + "".join(json.dumps(c.payload) for c in ctx.commands.sent)

    await run("metal.ensureRamdisk", RAMDISK, ctx)  # a re-run after a crash sends nothing again
    assert len(ctx.commands.sent) == 4


async def test_ensure_ramdisk_reads_the_operators_ramdisk_once_an_attempt() -> None:
    """Issue 25: the step runs again at each of its commands' ends; the ramdisk in force is what
    the attempt's first run found (its commands carry it), read again by the next attempt."""
    ctx = Ctx(attempt=41)
    ctx.commands.hold.add("netboot.setEntry")
    for _ in range(3):
        with pytest.raises(StepNotReady):
            await run("metal.ensureRamdisk", RAMDISK, ctx)
    ctx.commands.hold.clear()
    await run("metal.ensureRamdisk", RAMDISK, ctx)
    assert ctx.sql.override_reads == 1
    again = Ctx(attempt=42, sql=ctx.sql)
    await run("metal.ensureRamdisk", RAMDISK, again)
    assert ctx.sql.override_reads == 2


async def test_a_node_whose_bmc_has_virtual_media_gets_its_token_on_a_medium_not_the_boot_network() -> None:
    """Issue 23: ``tokenDelivery: media`` puts the ramdisk's token on a virtual CD the BMC
    fetches: minted without ``held``, sent by reference in ``media.insert`` before the boot
    device and the power cycle; the boot entries carry no token and say ``bcd.token_from=media``.
    ``wait.agentJoined`` ejects the medium once the node joined."""
    bmc = {**BMC, "tokenDelivery": "media"}
    ctx = Ctx(node=Node(bmc=bmc))
    got = await run("metal.ensureRamdisk", RAMDISK, ctx)
    assert ctx.commands.keys() == [
        "3#1:media-insert", "3#1:boot-device", "3#1:netboot-0", "3#1:netboot-1", "3#1:power-cycle",
    ]  # fmt: skip
    insert, _, entry, _, _ = ctx.commands.sent
    ref = "sec_ramdisk-join-token"
    assert insert.kind == "media.insert"
    assert insert.payload == {"device": "cd", "joinTokenRef": ref, "bmc": bmc}
    # nothing secret in it: not one-time, so a host that asks first does not take the machine's boot
    assert entry.payload == {**RAMDISK, "cmdline": "bcd.token_from=media", "mac": "52:54:00:00:00:01",
                             "oneTime": False}  # fmt: skip
    assert ctx.pki is not None
    assert [t["held"] for t in ctx.pki.issued] == [False]
    assert got["tokenDelivery"] == "media"
    assert got["mediaInsertCommand"] == "cmd_1"
    assert "bcjt_" not in json.dumps(got) + "".join(json.dumps(c.payload) for c in ctx.commands.sent)

    ctx.pki.certs = [Cert("cert_ramdisk", "node", ctx.sql.since + timedelta(seconds=5))]
    joined = await run("wait.agentJoined", {"role": "node"}, ctx)
    assert joined["certId"] == "cert_ramdisk"
    eject, *clears = ctx.commands.sent[5:]
    assert (eject.kind, eject.payload) == ("media.eject", {"device": "cd", "bmc": bmc})
    assert [(c.kind, c.payload["mac"]) for c in clears] == [
        ("netboot.clearEntry", mac) for mac in Node().macs
    ]
    await run("wait.agentJoined", {"role": "node"}, ctx)
    assert len(ctx.commands.sent) == 8  # found by their keys, not sent twice

    # the default, and an IPMI BMC: the held token on the boot network, nothing to eject
    ipmi = {"driver": "ipmi", "address": "10.0.0.9", "credentialsRef": BMC["credentialsRef"]}
    for node_bmc in (dict(BMC), {**ipmi, "tokenDelivery": "media"}):
        plain = Ctx(node=Node(bmc=node_bmc))
        got = await run("metal.ensureRamdisk", RAMDISK, plain)
        assert got["tokenDelivery"] == "network"
        assert plain.commands.sent[0].kind == "management.setBootDevice"
        assert plain.pki is not None
        assert [t["held"] for t in plain.pki.issued] == [True]
        plain.pki.certs = [Cert("cert_ramdisk", "node", plain.sql.since + timedelta(seconds=5))]
        await run("wait.agentJoined", {"role": "node"}, plain)
        assert [c.kind for c in plain.commands.sent][-1] == "power.setPower"  # nothing after the join


@pytest.mark.parametrize(
    ("ctx", "with_", "code", "path"),
    [
        (Ctx(), {}, ErrorCode.INVALID_CONFIG, "kernel"),
        (Ctx(node=Node(macs=())), RAMDISK, ErrorCode.INVALID_STATE, "macs"),
        (Ctx(node=Node(bmc=None)), RAMDISK, ErrorCode.INVALID_STATE, "bmc"),
        (Ctx(node=None), RAMDISK, ErrorCode.INVALID_CONFIG, "nodeId"),
        (Ctx(secrets=None), RAMDISK, ErrorCode.INVALID_CONFIG, "pki"),
    ],
)
async def test_ensure_ramdisk_refusals(ctx: Ctx, with_: dict[str, Any], code: ErrorCode, path: str) -> None:
    err = await refused(lambda: run("metal.ensureRamdisk", with_, ctx))
    assert (err.code, err.path) == (code, path)
    assert ctx.commands.sent == []


# -- wait.agentJoined ---------------------------------------------------------------------


async def test_wait_agent_joined_counts_only_a_fresh_join_of_the_asked_role() -> None:
    ctx = Ctx()
    since = ctx.sql.since
    with pytest.raises(StepNotReady):
        await run("wait.agentJoined", {"role": "node"}, ctx)
    # an earlier boot's join, and a site agent's certificate, do not count
    ctx.pki.certs = [Cert("cert_old", "node", since - timedelta(minutes=5)),  # type: ignore[union-attr]
                     Cert("cert_site", "site", since + timedelta(seconds=1)),
                     Cert("cert_revoked", "node", since + timedelta(seconds=1), state="revoked")]  # fmt: skip
    with pytest.raises(StepNotReady):
        await run("wait.agentJoined", {"role": "node"}, ctx)
    assert (await run("wait.agentJoined", {"fresh": False}, ctx))["certId"] == "cert_old"

    # the installed OS re-keys the node with its provisioned token
    ctx.pki.certs.insert(0, Cert("cert_new", "provisioned", since + timedelta(seconds=30)))  # type: ignore[union-attr]
    got = await run("wait.agentJoined", {"role": "node"}, ctx)
    assert (got["certId"], got["role"], got["agentId"]) == ("cert_new", "provisioned", Node().id)


async def test_wait_agent_joined_needs_pki() -> None:
    err = await refused(lambda: run("wait.agentJoined", {}, Ctx(pki=None)))
    assert (err.code, err.path) == (ErrorCode.INVALID_CONFIG, "pki")


# -- node commands: attested or nothing ---------------------------------------------------

# bcd's node.inventory, as it sends it (every field said, null where it could not read one)
INVENTORY = msgspec.to_builtins(
    NodeInventoryResult(
        serial="7XK2Q63", cpus=NodeCpus(model="x", cores=8), memory=NodeMemory(total_bytes=1 << 34)
    )
)


async def test_inspect_collect_stores_an_attested_inventory_on_the_node() -> None:
    ctx = Ctx(commands=Queue(results={"node.inventory": INVENTORY}))
    got = await run("inspect.collect", {}, ctx)
    [cmd] = ctx.commands.sent
    assert (cmd.kind, cmd.target) == ("node.inventory", "node")
    assert ctx.sql.nodes[Node().id]["inventory"] == INVENTORY
    assert got == {"commandId": "cmd_1", "attested": True, "inventory": sorted(INVENTORY)}


async def test_inspect_collect_refuses_a_result_that_is_not_an_inventory() -> None:
    ctx = Ctx(commands=Queue(results={"node.inventory": {"cpus": [{"model": "x"}]}}))
    err = await refused(lambda: run("inspect.collect", {}, ctx))
    assert (err.code, err.path) == (ErrorCode.DRIVER_ERROR, "result")
    assert ctx.sql.nodes == {}


@pytest.mark.parametrize(("step", "with_"), [("inspect.collect", {}), ("disk.wipe", {})])
async def test_an_unattested_node_result_fails_the_step_and_changes_nothing(
    step: str, with_: dict[str, Any]
) -> None:
    ctx = Ctx(commands=Queue(attested=False, results={"node.inventory": INVENTORY}))
    err = await refused(lambda: run(step, with_, ctx))
    assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "not-attested")
    assert err.details["commandId"] == "cmd_1"
    assert ctx.sql.nodes == {}
    assert ctx.log.events == ["result_not_attested"]


async def test_disk_wipe_is_a_declared_destructive_node_command() -> None:
    step = STEPS["disk.wipe"]
    assert step.sends == ("node.wipe",)
    ctx = Ctx()
    got = await run("disk.wipe", {"mode": "secure"}, ctx)
    [cmd] = ctx.commands.sent
    assert (cmd.kind, cmd.target, cmd.payload) == ("node.wipe", "node", {"mode": "secure"})
    assert got == {"commandId": "cmd_1", "attested": True, "mode": "secure"}


# -- deploy.deploy ------------------------------------------------------------------------

IMAGE = {"name": "ubuntu", "version": "24.04", "url": "https://img/u.raw.zst", "sha256": "cd" * 32,
         "format": "raw.zst", "size": 1, "signer": "ops"}  # fmt: skip


async def test_deploy_writes_the_resolved_image_with_the_rendered_user_data(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[tuple[str, str, Any]] = []

    async def resolve(_tx: Any, tenant_id: str, ref: str, *, verifier: Any = None) -> dict[str, Any]:
        asked.append((tenant_id, ref, verifier))
        if ref == "ubuntu@missing":
            raise BcError(ErrorCode.NOT_FOUND, "no image", {"path": "image"})
        return IMAGE

    monkeypatch.setattr(deploy_module, "resolve_image_ref", resolve)
    ctx = Ctx()
    ctx.sql.nodes[Node().id] = {"image": "ubuntu@24.04"}
    ctx.sql.results["userdata.render"] = {"userDataRef": "sec_00000000000000aa", "kind": "cloud-init"}
    got = await run("deploy.deploy", {}, ctx)
    [cmd] = ctx.commands.sent
    assert asked == [("root", "ubuntu@24.04", None)]
    assert (cmd.kind, cmd.target) == ("node.imageWrite", "node")
    assert cmd.payload == {"url": IMAGE["url"], "sha256": IMAGE["sha256"], "format": "raw.zst",
                           "userDataRef": "sec_00000000000000aa"}  # fmt: skip
    assert (got["image"], got["attested"]) == ("ubuntu@24.04", True)

    # with.image wins over the node's, the app's image_verifier is handed on, and an
    # unattested write does not count
    verifier = object()
    ctx = Ctx(commands=Queue(attested=False), profile=None)
    ctx.provision = SimpleNamespace(image_verifier=verifier)
    err = await refused(lambda: run("deploy.deploy", {"image": "ubuntu@24.10"}, ctx))
    assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "not-attested")
    assert asked[-1] == ("root", "ubuntu@24.10", verifier)

    # an image the catalog does not resolve: nothing is sent
    ctx = Ctx()
    err = await refused(lambda: run("deploy.deploy", {"image": "ubuntu@missing"}, ctx))
    assert (err.code, err.path, ctx.commands.sent) == (ErrorCode.NOT_FOUND, "image", [])


async def test_deploy_without_an_image_is_refused_before_sending() -> None:
    ctx = Ctx(profile=SimpleNamespace(image=None))
    err = await refused(lambda: run("deploy.deploy", {}, ctx))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "image")
    assert ctx.commands.sent == []


# -- http_via_site ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "https://169.254.169.254/latest/meta-data",
        "http://127.0.0.1:50000/",
        "https://[::1]/",
        "https://0.0.0.0/",
        "https://10.0.0.99:50000/machine/version",  # not the node's
        "https://user:pw@10.0.0.5/",
        "ftp://10.0.0.5/",
        "https://evil.example/",
    ],
)
async def test_http_via_site_refuses_targets_that_are_not_the_nodes_own(url: str) -> None:
    ctx = Ctx()
    ctx.sql.nodes[Node().id] = {"address": "10.0.0.5", "addresses": ["fd00::5"]}
    err = await refused(lambda: http_via_site(ctx, {"url": url}))
    assert (err.code, err.reason) == (ErrorCode.INVALID_INPUT, "ssrf-refused")
    assert ctx.commands.sent == []


async def test_http_via_site_relays_with_the_nodes_addresses() -> None:
    ctx = Ctx(commands=Queue(results={"site.httpProxy": {"status": 200, "body": "v1.7"}}))
    ctx.sql.nodes[Node().id] = {"address": "10.0.0.5", "addresses": ["fd00::5"]}
    got = await http_via_site(
        ctx, {"url": "https://[fd00::5]:50000/machine/version", "poll": True}, key="version"
    )
    [cmd] = ctx.commands.sent
    assert (cmd.kind, cmd.key) == ("site.httpProxy", f"wf:{WF}:3#1:version")
    assert cmd.payload == {"url": "https://[fd00::5]:50000/machine/version",
                           "nodeAddresses": ["10.0.0.5", "fd00::5"], "poll": True}  # fmt: skip
    assert got == {"status": 200, "body": "v1.7"}
    err = await refused(lambda: http_via_site(Ctx(), {"url": "https://10.0.0.5/"}))
    assert (err.code, err.reason) == (ErrorCode.INVALID_STATE, "no-address")


async def test_the_pages_talos_ready_waits_for_a_200() -> None:
    from metal_steps_app import talos_ready

    ctx = Ctx(commands=Queue(results={"site.httpProxy": {"status": 503}}))
    ctx.sql.nodes[Node().id] = {"address": "10.0.0.5"}
    assert talos_ready.run is not None
    with pytest.raises(StepNotReady):
        await talos_ready.run(talos_ready.input.validate({}), ctx)  # type: ignore[arg-type]
    assert ctx.commands.sent[0].payload["url"] == "https://10.0.0.5:50000/machine/version"
    ctx = Ctx(commands=Queue(results={"site.httpProxy": {"status": 200, "body": "v1.7"}}))
    ctx.sql.nodes[Node().id] = {"address": "10.0.0.5"}
    got = await talos_ready.run(talos_ready.input.validate({"port": 50001}), ctx)  # type: ignore[arg-type]
    assert got == {"status": 200, "version": "v1.7"}
