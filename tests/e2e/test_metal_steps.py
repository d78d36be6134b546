"""Metal's shipped steps end to end: engine, command queue, PKI and secrets each their own process,
simulated agents (a site agent answering BMC and network-boot commands, a node's bcd) on the
agent SDK, and the reference page's ``ubuntu-24.04-autoinstall`` profile as written."""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import pytest_asyncio
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from better_compute.clients import CommandQueueClient, PkiClient
from better_compute.config import Settings
from better_compute.metal.signatures import sign_image
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, bcx, until
from better_compute.testing.agents import SimAgent, start_sim_agent
from better_compute.testing.workflows import wait_workflow

FAST = {"BC_CMDQ_HEARTBEAT": "200ms", "BC_CMDQ_SILENT_AFTER": "1500ms", "BC_CMDQ_SWEEP": "100ms"}
BMC = {"driver": "redfish", "address": "https://10.0.0.9", "credentialsRef": "sec_" + "0" * 26}
MACS = ["52:54:00:00:00:01", "52:54:00:00:00:02"]
SIGNER = ed25519.Ed25519PrivateKey.generate()  # the allowlisted image signer ([images] in bc.toml)


class Stack:
    def __init__(self, api: ApiClient, settings: Settings, tmp: Path) -> None:
        self.api = api
        self.settings = settings
        self.tmp = tmp
        self.cq = CommandQueueClient(api)
        self.pki = PkiClient(api)
        self.agents: list[SimAgent] = []

    async def agent(self, site: str, *args: str, node_id: str | None = None) -> SimAgent:
        sim, _ = await start_sim_agent(
            self.settings, self.tmp / f"agent-{len(self.agents)}", site_id=site, pki=self.pki, cq=self.cq,
            role="node" if node_id else "site", node_id=node_id, args=list(args),
        )  # fmt: skip
        self.agents.append(sim)
        return sim

    async def node(self, site: str, *, bmc: dict[str, Any] | None = BMC) -> str:
        node = await self.api.call("engine", "nodes.create", {"siteId": site})
        conn = await asyncpg.connect(self.settings.database_url)
        try:  # the BMC and MACs an operator enrols (bcx nodes enroll, issue 11 item 1)
            await conn.execute(
                "UPDATE engine.nodes SET bmc = $2::jsonb, macs = $3 WHERE id = $1",
                node["id"], json.dumps(bmc) if bmc else None, MACS,
            )  # fmt: skip
        finally:
            await conn.close()
        return str(node["id"])

    async def node_state(self, node_id: str) -> tuple[str, Any]:
        conn = await asyncpg.connect(self.settings.database_url)
        try:
            row = await conn.fetchrow("SELECT state, inventory FROM engine.nodes WHERE id = $1", node_id)
        finally:
            await conn.close()
        inventory = row["inventory"]
        return row["state"], json.loads(inventory) if inventory is not None else None

    async def run(self, pid: str, node: str, steps: list[dict[str, Any]] | None = None) -> str:
        if steps is not None:
            doc = {"id": pid, "version": 1, "target": "metal", "role": "host", "steps": steps}
            await self.api.call("engine", "profiles.create", {"document": doc})
        wf = await self.api.call("engine", "workflows.start", {"profileId": pid, "nodeId": node})
        return str(wf["id"])

    async def commands(self, wf_id: str) -> dict[str, Any]:
        """The workflow's commands by key, without the ``wf:<id>:`` prefix."""
        views = (await self.cq.list_commands(workflow_id=wf_id)).commands
        return {v.key.removeprefix(f"wf:{wf_id}:"): v for v in views}


@pytest_asyncio.fixture(loop_scope="session")
async def stack(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> AsyncIterator[Stack]:
    settings = msgspec.structs.replace(bc_settings, app="metal_steps_app:app")
    bc_processes.settings = settings
    raw = SIGNER.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    config = tmp_path / "bc.toml"
    signer = f'{{ id = "acme-release", publicKey = "{base64.b64encode(raw).decode()}" }}'
    config.write_text(f"[images]\nsigners = [{signer}]\n")
    bc_processes.extra_env.update(
        {
            **FAST,
            "BC_PKI_KEY_FILE": str(tmp_path / "pki.key"),
            "BC_SECRETS_KEY_FILE": str(tmp_path / "sec.key"),
            "BC_CONFIG": str(config),
        }
    )
    for name in ("bc-pki", "bc-secrets", "bc-command-queue", "bc-engine"):
        bc_processes.start(name)
    await bc_processes.wait_ready()
    s = Stack(bc_api, settings, tmp_path)
    yield s
    for sim in s.agents:
        sim.close()


async def test_the_pages_autoinstall_profile_runs_to_succeeded(stack: Stack) -> None:
    site = await stack.agent("site-a")
    node = await stack.node("site-a")
    wf_id = await stack.run("ubuntu-24.04-autoinstall", node)

    async def waiting_for_the_join() -> bool:
        wf = await stack.api.call("engine", "workflows.get", {"id": wf_id})
        assert wf["state"] == "running", wf
        return bool(wf["steps"][4]["state"] == "running")

    await until(waiting_for_the_join, timeout=60, what="wait.agentJoined running")
    # the installed OS comes up and its bcd joins for this node
    await stack.agent("site-a", node_id=node)
    done = await wait_workflow(stack.api, wf_id, timeout=60)
    assert done.state == "succeeded", done
    assert [s.action for s in done.steps] == [
        "autoinstall.renderIso", "media.insert", "management.setBootDevice", "power.setPower",
        "wait.agentJoined", "media.eject",
    ]  # fmt: skip
    iso = done.steps[0].result["url"]
    assert done.steps[1].result["url"] == iso  # fromStep, read from the store
    assert done.steps[4].result["agentId"] == node

    commands = await stack.commands(wf_id)
    assert {k: (v.kind, v.target, v.state) for k, v in commands.items()} == {
        "1#1": ("media.insert", "site", "succeeded"),
        "2#1": ("management.setBootDevice", "site", "succeeded"),
        "3#1": ("power.setPower", "site", "succeeded"),
        "5#1": ("media.eject", "site", "succeeded"),
    }
    insert = await stack.cq.get(id=commands["1#1"].id)
    assert insert.payload == {"url": iso, "device": "cd", "bmc": {**BMC, "insecure": False}}
    assert not any(v.destructive for v in commands.values())  # BMC steps wait for no quorum
    assert len(site.executions()) == 4  # each BMC command ran once


async def test_ensure_ramdisk_woken_while_a_command_runs_sends_nothing_twice(stack: Stack) -> None:
    # each boot entry takes a while: the step runs again on every wake-up meanwhile
    site = await stack.agent("site-b", "--delay", "netboot.setEntry=1500")
    node = await stack.node("site-b")
    ramdisk = {"kernel": "https://cache.site-b/vmlinuz", "initrd": "https://cache.site-b/initrd"}
    wf_id = await stack.run("ramdisk", node, [{"use": "metal.ensureRamdisk", "on": "site", "with": ramdisk}])
    done = await wait_workflow(stack.api, wf_id, timeout=60)
    assert done.state == "succeeded", done
    commands = await stack.commands(wf_id)
    assert sorted(commands) == ["0#1:boot-device", "0#1:netboot-0", "0#1:netboot-1", "0#1:power-cycle"]
    entries = [await stack.cq.get(id=commands[f"0#1:netboot-{i}"].id) for i in (0, 1)]
    assert [e.payload["mac"] for e in entries] == MACS
    assert len(site.executions()) == 4  # at the agent, too: one execution per command

    # issue 26: a ramdisk set while the engine runs is what the next run boots, with no restart.
    # A step that names none fails asking for one; once `bcx ramdisk set` ran, its retry boots it.
    bare = await stack.run("bare-ramdisk", node, [{"use": "metal.ensureRamdisk", "on": "site", "with": {}}])
    failed = await wait_workflow(stack.api, bare, timeout=60)
    assert failed.state == "failed", failed
    kernel, initrd = "https://cache.site-b/set/vmlinuz", "https://cache.site-b/set/initrd.img"
    set_ = await bcx(
        stack.settings, "ramdisk", "set", "--kernel", kernel, "--initrd", initrd, "--cmdline", "quiet"
    )
    assert set_.returncode == 0, set_.stderr
    assert "the shipped profiles boot it" in set_.stdout
    await stack.api.call("engine", "workflows.retry", {"id": bare})
    done = await wait_workflow(stack.api, bare, timeout=60)
    assert done.state == "succeeded", done
    retried = {k: v for k, v in (await stack.commands(bare)).items() if "netboot" in k}
    entries = [await stack.cq.get(id=v.id) for v in retried.values()]
    assert [(e.payload["kernel"], e.payload["initrd"], e.payload["cmdline"].split()[0]) for e in entries] == [
        (kernel, initrd, "quiet")
    ] * len(MACS)
    shown = await bcx(stack.settings, "ramdisk", "show", "--json")
    assert msgspec.json.decode(shown.stdout)["kernel"] == kernel
    cleared = await bcx(stack.settings, "ramdisk", "clear")
    assert cleared.stdout.startswith("ramdisk: none set"), cleared.stdout


async def test_an_unattested_wipe_fails_the_step_and_the_node_does_not_move(stack: Stack) -> None:
    await stack.agent("site-c")
    node = await stack.node("site-c")
    bcd = await stack.agent("site-c", "--unsigned", node_id=node)
    before = await stack.node_state(node)
    wf_id = await stack.run("wipe", node, [{"use": "disk.wipe", "with": {"mode": "quick"}}])
    done = await wait_workflow(stack.api, wf_id, timeout=60)
    assert done.state == "failed", done
    error = done.steps[0].error
    assert (error["code"], error["details"]["reason"]) == ("UNAUTHENTICATED", "not-attested")
    [wipe] = (await stack.commands(wf_id)).values()
    assert (wipe.kind, wipe.state, wipe.attested) == ("node.wipe", "succeeded", False)
    assert len(bcd.executions()) == 1
    assert await stack.node_state(node) == before  # nothing recorded, no move


async def test_a_signed_inventory_is_stored_on_the_node(stack: Stack) -> None:
    node = await stack.node("site-d")
    await stack.agent("site-d", node_id=node)  # signs with the node's key
    wf_id = await stack.run("inspect", node, [{"use": "inspect.collect"}])
    done = await wait_workflow(stack.api, wf_id, timeout=60)
    assert done.state == "succeeded", done
    assert done.steps[0].result["attested"] is True
    _, inventory = await stack.node_state(node)
    # the simulated bcd's answer, as it signed it
    assert inventory == {
        "ok": True,
        "kind": "node.inventory",
        "commandId": done.steps[0].result["commandId"],
    }


async def test_a_node_without_a_bmc_fails_the_bmc_step_with_its_reason(stack: Stack) -> None:
    node = await stack.node("site-e", bmc=None)
    wf_id = await stack.run(
        "power-off", node, [{"use": "power.setPower", "on": "site", "with": {"action": "off"}}]
    )
    done = await wait_workflow(stack.api, wf_id, timeout=60)
    error = done.steps[0].error
    assert (done.state, error["code"], error["details"]["reason"]) == ("failed", "INVALID_STATE", "no-bmc")
    assert await stack.commands(wf_id) == {}


# -- the shipped lifecycle profiles, started by metal's verbs -----------------------------


async def enrolled(stack: Stack, site: str, macs: list[str] = MACS[:1]) -> str:
    # a BMC of its own: one BMC, one node (issue 23), also across this module's tests
    bmc = {**BMC, "address": f"https://10.0.{next(_BMC_HOSTS)}.9"}
    node = await stack.api.call("engine", "metal.enroll", {"siteId": site, "macs": macs, "bmc": bmc})
    return str(node["id"])


_BMC_HOSTS = itertools.count(1)


async def bcd_joins_when_waited_for(stack: Stack, node: str, *args: str) -> SimAgent:
    """Start the node's bcd once its workflow waits for the join (after the ramdisk boot)."""

    async def waiting() -> bool:
        doc = await stack.api.call("engine", "nodes.get", {"id": node})
        assert doc["state"] != "failed", doc
        wf = await stack.api.call("engine", "workflows.get", {"id": doc["workflowId"]})
        return bool(wf["steps"][1]["state"] == "running")

    await until(waiting, timeout=60, what="wait.agentJoined running")
    return await stack.agent(_SITES[node], *args, node_id=node)


_SITES: dict[str, str] = {}  # node id -> its site, as enrolled


async def node_reaches(stack: Stack, node: str, *states: str) -> dict[str, Any]:
    async def check() -> dict[str, Any] | None:
        doc: dict[str, Any] = await stack.api.call("engine", "nodes.get", {"id": node})
        return doc if doc["state"] in states else None

    return await until(check, timeout=60, what=f"node {node} in {states}")


async def test_inspect_with_the_shipped_profile_records_the_signed_inventory(stack: Stack) -> None:
    site = await stack.agent("site-f")
    node = await enrolled(stack, "site-f")
    _SITES[node] = "site-f"
    got = await stack.api.call("engine", "metal.inspect", {"nodeId": node})
    assert got["state"] == "inspecting"
    await bcd_joins_when_waited_for(stack, node)
    doc = await node_reaches(stack, node, "inspected", "failed")
    assert doc["state"] == "inspected", doc
    wf = await stack.api.call("engine", "workflows.list", {"nodeId": node})
    [workflow] = wf["workflows"]
    assert workflow["profile"]["id"] == "metal.inspect"
    # the ramdisk boot (boot device, an entry for the one MAC, a cycle) and the power-off, once each
    assert sorted(line.split()[1] for line in site.executions()) == [
        "management.setBootDevice", "netboot.setEntry", "power.setPower", "power.setPower",
    ]  # fmt: skip
    _, inventory = await stack.node_state(node)
    assert inventory["kind"] == "node.inventory"


async def test_retire_with_an_unattested_wipe_fails_and_the_node_is_never_retired(stack: Stack) -> None:
    await stack.agent("site-g")
    node = await enrolled(stack, "site-g")
    _SITES[node] = "site-g"
    await stack.api.call("engine", "metal.retire", {"nodeId": node})
    bcd = await bcd_joins_when_waited_for(stack, node, "--unsigned")
    doc = await node_reaches(stack, node, "retired", "failed")
    assert doc["state"] == "failed", doc
    reason = doc["stateReason"]
    assert (reason["step"], reason["code"]) == ("disk.wipe", "UNAUTHENTICATED")
    assert [line.split()[1] for line in bcd.executions()] == ["node.wipe"]  # ran, but does not count


async def step_running(stack: Stack, node: str, index: int) -> bool:
    doc = await stack.api.call("engine", "nodes.get", {"id": node})
    assert doc["state"] != "failed", doc
    wf = await stack.api.call("engine", "workflows.get", {"id": doc["workflowId"]})
    assert wf["state"] == "running", [(s["action"], s["state"], s.get("result")) for s in wf["steps"]]
    return bool(wf["steps"][index]["state"] == "running")


async def test_deploy_with_the_shipped_profile_writes_the_signed_image_and_the_os_joins(stack: Stack) -> None:
    digest = hashlib.sha256(b"ubuntu 24.04 raw image").hexdigest()
    url = "https://images.example.com/ubuntu-24.04.raw.zst"
    signed = sign_image(SIGNER, name="ubuntu", version="24.04", sha256=digest, url=url)
    image = {"name": "ubuntu", "version": "24.04", "url": url, "sha256": digest, "format": "raw.zst",
             "signer": "acme-release", "signature": base64.b64encode(signed).decode()}  # fmt: skip
    await stack.api.call("engine", "images.register", image)
    await stack.agent("site-h")
    node = await enrolled(stack, "site-h")
    _SITES[node] = "site-h"
    # enrolled -> inspected -> ready through the verbs, each booting the ramdisk anew
    for verb, done in (("inspect", "inspected"), ("commission", "ready")):
        got = await stack.api.call("engine", f"metal.{verb}", {"nodeId": node})
        assert got["profile"]["id"] == f"metal.{verb}"
        booted = await bcd_joins_when_waited_for(stack, node)
        doc = await node_reaches(stack, node, done, "failed")
        assert doc["state"] == done, doc
        booted.close()  # powered off at the end of the profile
    assert doc["inventory"]["kind"] == "node.inventory"
    runs = (await stack.api.call("engine", "workflows.list", {"nodeId": node}))["workflows"]
    [commission] = [w for w in runs if w["profile"]["id"] == "metal.commission"]
    wiped = (await stack.cq.list_commands(workflow_id=commission["id"], kind="node.wipe")).commands
    assert [(c.state, c.attested) for c in wiped] == [("succeeded", True)]

    got = await stack.api.call("engine", "metal.deploy", {"nodeId": node, "image": "ubuntu@24.04"})
    assert got["state"] == "deploying"
    ramdisk = await bcd_joins_when_waited_for(stack, node)  # the ramdisk's bcd writes the image
    await until(lambda: step_running(stack, node, 6), timeout=60, what="the installed OS awaited")
    ramdisk.close()  # the machine reboots into the installed OS, whose bcd joins anew
    await stack.agent("site-h", node_id=node)
    doc = await node_reaches(stack, node, "deployed", "failed")
    assert doc["state"] == "deployed", doc

    listed = (await stack.api.call("engine", "workflows.list", {"nodeId": node}))["workflows"]
    [listed] = [w for w in listed if w["profile"]["id"] == "metal.deploy"]
    wf = await stack.api.call("engine", "workflows.get", {"id": listed["id"]})
    steps = {s["action"]: s for s in wf["steps"]}
    write = await stack.cq.get(id=steps["deploy.deploy"]["result"]["commandId"])
    assert (write.kind, write.target, write.attested, write.destructive) == (
        "node.imageWrite",
        "node",
        True,
        True,
    )
    assert write.payload == {"url": image["url"], "sha256": digest, "format": "raw.zst",
                             "userDataRef": steps["userdata.render"]["result"]["userDataRef"]}  # fmt: skip
    joins = [s["result"]["certId"] for s in wf["steps"] if s["action"] == "wait.agentJoined"]
    assert len(set(joins)) == 2  # the ramdisk's join and the installed OS's, told apart


async def test_the_pages_talos_ready_runs_through_http_via_site(stack: Stack) -> None:
    answer = json.dumps({"status": 200, "headers": {}, "body": "Tag: v1.7.6"})
    site = await stack.agent("site-i", "--answer", f"site.httpProxy={answer}")
    node = await stack.api.call(
        "engine", "nodes.create", {"siteId": "site-i", "labels": {"address": "10.0.0.5"}}
    )
    wf_id = await stack.run("talos", node["id"])
    done = await wait_workflow(stack.api, wf_id, timeout=60)
    assert done.state == "succeeded", done
    assert done.steps[0].result == {"status": 200, "version": "Tag: v1.7.6"}
    assert done.command_kinds == ["site.httpProxy"]  # declared in sends: in the batch's scope
    [relay] = (await stack.commands(wf_id)).values()
    relay = await stack.cq.get(id=relay.id)
    assert (relay.kind, relay.destructive) == ("site.httpProxy", True)
    assert relay.payload["url"] == "https://10.0.0.5:50000/machine/version"
    assert relay.payload["nodeAddresses"] == ["10.0.0.5"]  # the site agent relays only to these
    assert len(site.executions()) == 1


async def test_adopt_with_the_shipped_profile_reads_the_bmc_and_destroys_nothing(stack: Stack) -> None:
    on = json.dumps({"system": {"powerState": "On"}})
    site = await stack.agent("site-j", "--answer", f"management.inventory={on}")
    node = await enrolled(stack, "site-j")
    bcd = await stack.agent("site-j", node_id=node)  # the installed OS's bcd, joined before the adopt
    got = await stack.api.call("engine", "metal.adopt", {"nodeId": node})
    assert (got["state"], got["profile"]["id"]) == ("adopting", "metal.adopt")
    doc = await node_reaches(stack, node, "deployed", "failed")
    assert doc["state"] == "deployed", doc
    assert doc["powerState"] == "on"  # what the BMC said
    assert doc["inventory"]["kind"] == "node.inventory"  # collected from the running OS, node-signed
    wf = await stack.api.call("engine", "workflows.get", {"id": got["workflowId"]})
    assert [s["action"] for s in wf["steps"]] == ["power.getPower", "wait.agentJoined", "inspect.collect"]
    commands = await stack.commands(got["workflowId"])
    assert sorted(v.kind for v in commands.values()) == ["management.inventory", "node.inventory"]
    assert not any(v.destructive for v in commands.values())  # no wipe, no image write, no boot
    assert [line.split()[1] for line in site.executions()] == ["management.inventory"]
    assert [line.split()[1] for line in bcd.executions()] == ["node.inventory"]

    # a BMC that does not say whether the machine is on fails the adopt at its first step
    await stack.agent("site-k")
    mute = await enrolled(stack, "site-k", ["52:54:00:00:00:0b"])
    await stack.api.call("engine", "metal.adopt", {"nodeId": mute})
    doc = await node_reaches(stack, mute, "deployed", "failed")
    reason = doc["stateReason"]
    assert (doc["state"], reason["step"], reason["code"]) == ("failed", "power.getPower", "DRIVER_ERROR")
