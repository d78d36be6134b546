"""Enrollment rules: a discovered machine whose inventory and labels match a rule is enrolled by it
when its discovery inventory arrives; one that matches none stays discovered.

bc-pki, bc-secrets, bc-command-queue and bc-engine are processes; bcd is a real ``bcd join`` /
``bcd run`` against prepared machine trees (their inventory is what the rules see); bcx is its
own process.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from better_compute.clients import EngineClient, PkiClient, SecretsClient
from better_compute.config import Settings
from better_compute.core.errors import BcError
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, bcx, until
from better_compute.testing.bcd import BcdProcess, run_bcd
from better_compute.testing.machines import prepare_machine
from better_compute.wire.metal import NodeBmc
from doc_blocks import doc_block

pytestmark = pytest.mark.e2e

SITE = "lab1"
PASSWORD = "rule-bmc-s3cret"
GIB_KIB = 1024 * 1024
BIG = 'inventory.vendor="Better Compute" and inventory.memory_gib>=32 and inventory.cpu_cores>=8'


def doc_examples() -> list[str]:
    """docs/metal.md's confirmation of a pending rule enrolment, which this test runs as written."""
    return doc_block("docs/metal.md", "tests/e2e/test_metal_enrollment_rules.py")


@pytest_asyncio.fixture(loop_scope="session")
async def settings(bc_settings: Settings, bc_processes: ServiceProcesses) -> AsyncIterator[Settings]:
    settings = msgspec.structs.replace(bc_settings, app="metal_test_app:app")
    bc_processes.settings = settings
    bc_processes.extra_env.update(BC_CMDQ_HEARTBEAT="200ms", BC_CMDQ_SWEEP="100ms")
    for name in ("bc-pki", "bc-secrets", "bc-command-queue", "bc-engine"):
        bc_processes.start(name)
    await bc_processes.wait_ready(timeout=90)  # four services starting on a loaded machine
    yield settings


async def rules(settings: Settings, *args: str) -> Any:
    out = await bcx(settings, "enrollment-rules", *args, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert PASSWORD not in out.stdout + out.stderr
    return json.loads(out.stdout)


async def refused(settings: Settings, *args: str) -> dict[str, Any]:
    out = await bcx(settings, "enrollment-rules", "create", *args, "--no-prompt", "--json")
    assert out.returncode != 0, out.stdout
    assert PASSWORD not in out.stdout + out.stderr
    err: dict[str, Any] = json.loads(out.stdout or out.stderr)["error"]
    return err


async def discover(settings: Settings, api: ApiClient, root: Path, bcds: list[BcdProcess], log: Path) -> str:
    """What the discovery ramdisk does: ``bcd join`` with the site's discovery token, then bcd runs."""
    token = await PkiClient(api).issue_join_token(
        tenant_id="root", role="discovery", site_id=SITE, ttl_seconds=900, max_uses=5
    )
    (root / "proc/cmdline").write_text(
        f"console=ttyS0 bcd.site={SITE} bcd.token={token.token} bcd.control_plane=nats://gw.example.test\n"
    )
    joined = await run_bcd(settings, root, "join", "--no-service")
    assert joined.returncode == 0, joined.stderr
    bcds.append(BcdProcess.start(settings, root, "--mode", "ramdisk", log=log))
    return str(json.loads(joined.stdout)["nodeId"])


async def inventoried(api: ApiClient, node_id: str) -> dict[str, Any]:
    async def check() -> dict[str, Any] | None:
        try:
            doc: dict[str, Any] = await api.call("engine", "nodes.get", {"id": node_id})
        except Exception:
            return None
        return doc if doc.get("inventory") is not None else None

    return await until(check, timeout=60, what=f"{node_id} inventoried")


@pytest.mark.timeout(240)  # two discovery boots and bcx processes on a loaded machine
async def test_a_discovered_machine_matching_a_rule_is_enrolled_by_it(
    settings: Settings, bc_api: ApiClient, bcds: list[BcdProcess], tmp_path: Path
) -> None:
    creds = tmp_path / "bmc.json"
    creds.write_text(json.dumps({"username": "admin", "password": PASSWORD}))
    big = await rules(
        settings, "create", "big-sim", "--site", SITE, "--priority", "10",
        "--selector", BIG,
        "--label", "pool=big", "--label", "rack=r7", "--name-template", "r7-{inventory.serial}",
        "--bmc", "redfish://10.9.0.7/redfish/v1/Systems/1", "--bmc-credentials-file", str(creds),
    )  # fmt: skip
    assert (big["name"], big["siteId"], big["labels"]) == ("big-sim", SITE, {"pool": "big", "rack": "r7"})
    assert big["nameTemplate"] == "r7-{inventory.serial}"
    template_ref = big["bmc"]["credentialsRef"]
    # a rule of another site is never tried for lab1's machines
    engine = EngineClient(bc_api)
    await engine.create_enrollment_rule(name="elsewhere", site_id="lab9", selector="inventory.cpu_cores>=1")
    listed = await engine.list_enrollment_rules()
    assert [r.name for r in listed.rules] == ["big-sim", "elsewhere"]

    machine = prepare_machine(
        tmp_path / "big", product_uuid="5a1e0000-0001-4000-8000-00000000b16a", serial="BIG-1",
        macs=("52:54:00:e1:00:01",), cpus=8, memory_kib=32 * GIB_KIB,
    )  # fmt: skip
    node_id = await discover(settings, bc_api, machine, bcds, tmp_path / "big.log")
    doc = await inventoried(bc_api, node_id)
    assert (doc["state"], doc["enrolledByRule"]) == ("enrolled", big["id"]), doc
    assert doc["name"] == "r7-big-1"  # the rule's name template, over its host name
    assert doc["labels"] == {"pool": "big", "rack": "r7"}
    assert doc["macs"] == ["52:54:00:e1:00:01"]  # the MACs it showed
    bmc = doc["bmc"]
    assert (bmc["driver"], bmc["address"], bmc["systemId"]) == (
        "redfish",
        "https://10.9.0.7",
        "/redfish/v1/Systems/1",
    )
    # the node has its own copy of the credential, bound to it, never the rule's template
    assert bmc["credentialsRef"].startswith("sec_")
    assert bmc["credentialsRef"] != template_ref
    secrets = SecretsClient(bc_api)
    assert json.loads(await secrets.get(ref=bmc["credentialsRef"]))["password"] == PASSWORD
    shown = await bcx(settings, "nodes", "show", "r7-big-1")  # its name stands for its id
    assert f"enrolled    by rule {big['id']}" in shown.stdout, shown.stdout
    assert PASSWORD not in shown.stdout

    async def discovery_keys_revoked() -> bool:
        certs = await PkiClient(bc_api).list_certificates(agent_id=node_id, include_revoked=True)
        return bool(certs) and all(c.state == "revoked" for c in certs if c.role == "discovery")

    await until(discovery_keys_revoked, timeout=30)

    # a smaller machine matches no rule: it appears with its inventory and stays discovered
    small = prepare_machine(
        tmp_path / "small", product_uuid="5a1e0000-0001-4000-8000-0000000005a1", serial="SMALL-1",
        macs=("52:54:00:e1:00:02",), cpus=4, memory_kib=16 * GIB_KIB, hostname="R12-n3.lab1.example.com",
    )  # fmt: skip
    small_id = await discover(settings, bc_api, small, bcds, tmp_path / "small.log")
    doc = await inventoried(bc_api, small_id)
    assert (doc["state"], doc["enrolledByRule"], doc["bmc"]) == ("discovered", None, None), doc
    assert doc["name"] == "r12-n3"  # named by the host name it reported (the first label, lowercase)
    agents = await bcx(settings, "agents", "list", "--role", "discovery")  # its bcd, under its name
    assert agents.returncode == 0, agents.stderr
    assert re.search(rf"^{small_id}\s+r12-n3\s+{SITE}\s+discovery\b", agents.stdout, re.M), agents.stdout

    # deleting a rule leaves what it enrolled as it is
    deleted = await engine.delete_enrollment_rule(id=big["id"])
    assert deleted.id == big["id"]
    assert [r.name for r in (await engine.list_enrollment_rules()).rules] == ["elsewhere"]
    assert (await bc_api.call("engine", "nodes.get", {"id": node_id}))["state"] == "enrolled"


async def test_bad_rules_are_refused_with_their_path(settings: Settings, bc_api: ApiClient) -> None:
    ipmi = {"driver": "ipmi", "address": "ipmi-{inventory.bmc_address}"}
    cases = [
        ({"selector": "inventory.memory_gib>=lots"}, "selector"),
        ({"bmc": {"driver": "ipmi", "address": "{inventory.bmc_address}"}}, "bmc.addressCidrs"),
        ({"bmc": {"driver": "ipmi", "address": "{inventory.colour}", "addressCidrs": ["10.0.0.0/8"]}},
         "bmc.address"),
        ({"bmc": {**ipmi, "addressCidrs": ["10.0.0.0/33"]}}, "bmc.addressCidrs[0]"),
        ({"labels": {"bad key": "x"}}, "labels"),
        ({"bmc": {"driver": "ipmi", "address": "10.0.0.1", "password": PASSWORD}}, "bmc.password"),
        ({"nameTemplate": "r7-{inventory.colour}"}, "nameTemplate"),
        ({"nameTemplate": "r7 {hostname}"}, "nameTemplate"),
    ]  # fmt: skip
    for body, path in cases:
        err = await refusal(bc_api, {"name": "bad", "selector": "a=b", **body})
        assert (err.code.value, err.details["path"]) == ("INVALID_INPUT", path), (body, err)
        assert PASSWORD not in err.message
    # through bcx: the same refusal, and a name is unique in its tenant
    err = await refused(settings, "bad", "--selector", "a=b", "--bmc", "ipmi://{inventory.bmc_address}")
    assert (err["code"], err["details"]["path"]) == ("INVALID_INPUT", "bmc.addressCidrs")
    await rules(settings, "create", "twice", "--selector", "a=b")
    err = await refused(settings, "twice", "--selector", "a=c")
    assert (err["code"], err["details"]["path"]) == ("CONFLICT", "name")
    with pytest.raises(BcError) as caught:
        await bc_api.call("engine", "enrollmentRules.delete", {"id": "rule_01JB0000000000000000000000"})
    assert caught.value.code.value == "NOT_FOUND"


async def refusal(api: ApiClient, body: dict[str, Any]) -> Any:
    with pytest.raises(BcError) as caught:
        await api.call("engine", "enrollmentRules.create", body)
    return caught.value


@pytest.mark.timeout(240)  # two discovery boots and bcx processes on a loaded machine
async def test_one_bmc_one_node_and_a_reported_bmc_address_waits_for_an_operator(
    settings: Settings, bc_api: ApiClient, bcds: list[BcdProcess], tmp_path: Path
) -> None:
    """Issue 23, M3: a rule took the BMC address from what the machine reported, so a made-up
    machine reporting another machine's BMC was enrolled with it (and the rule's credential),
    and inspecting it power-cycled the victim. Now such an enrolment waits for an operator, and
    no enrolment (by rule or by hand) gives a node a BMC another node has."""
    creds = tmp_path / "bmc.json"
    creds.write_text(json.dumps({"username": "admin", "password": PASSWORD}))
    engine = EngineClient(bc_api)
    victim = await engine.enroll_node(
        site_id=SITE, macs=["52:54:00:e2:00:01"],
        bmc=NodeBmc(driver="redfish", address="https://10.77.0.9", system_id="/redfish/v1/Systems/1"),
    )  # fmt: skip
    # the test machines' inventory has no BMC section: their serial is the reported fact here
    rule = await rules(
        settings, "create", "from-report", "--site", SITE, "--selector", 'inventory.vendor="Better Compute"',
        "--bmc", "redfish://{inventory.serial}/redfish/v1/Systems/1", "--bmc-cidr", "10.77.0.0/16",
        "--bmc-credentials-file", str(creds),
    )  # fmt: skip
    # a made-up machine reporting the victim's BMC: refused, it stays discovered saying why
    fake = prepare_machine(
        tmp_path / "fake", product_uuid="5a1e0000-0002-4000-8000-0000000000f1", serial="10.77.0.9",
        macs=("52:54:00:e2:00:02",),
    )  # fmt: skip
    fake_id = await discover(settings, bc_api, fake, bcds, tmp_path / "fake.log")
    doc = await until(lambda: _with(bc_api, fake_id, "lastError"), timeout=60, what="the fake refused")
    assert (doc["state"], doc["bmc"], doc["pendingEnrollment"]) == ("discovered", None, None), doc
    assert (doc["lastError"]["code"], doc["lastError"]["reason"]) == ("CONFLICT", "bmc-taken"), doc
    assert doc["lastError"]["nodeId"] == victim.id

    # a new machine reporting a free address: matched, but its enrolment waits for an operator
    new = prepare_machine(
        tmp_path / "new", product_uuid="5a1e0000-0002-4000-8000-0000000000a2", serial="10.77.0.10",
        macs=("52:54:00:e2:00:03",),
    )  # fmt: skip
    new_id = await discover(settings, bc_api, new, bcds, tmp_path / "new.log")
    doc = await until(lambda: _with(bc_api, new_id, "pendingEnrollment"), timeout=60, what="pending")
    assert (doc["state"], doc["bmc"], doc["enrolledByRule"]) == ("discovered", None, None), doc
    assert doc["pendingEnrollment"]["bmc"]["address"] == "https://10.77.0.10"
    listed = await rules(settings, "pending")
    assert [(n["nodeId"], n["ruleId"]) for n in listed["nodes"]] == [(new_id, rule["id"])]
    table = await bcx(settings, "enrollment-rules", "pending")
    assert table.returncode == 0, table.stderr
    assert "BMC (reported)" in table.stdout
    assert f"from-report ({rule['id']})" in table.stdout
    assert "redfish https://10.77.0.10 /redfish/v1/Systems/1" in table.stdout, table.stdout
    # docs/metal.md's confirm, as written there
    (line,) = doc_examples()
    argv = [new_id if w == "node_…" else w for w in shlex.split(line, comments=True)[1:]]
    confirmed = await bcx(settings, *argv)
    assert confirmed.returncode == 0, confirmed.stdout + confirmed.stderr
    assert new_id in confirmed.stdout
    doc = json.loads((await bcx(settings, "nodes", "get", new_id, "--json")).stdout)
    assert (doc["state"], doc["enrolledByRule"], doc["pendingEnrollment"]) == ("enrolled", rule["id"], None)
    assert doc["bmc"]["address"] == "https://10.77.0.10"
    again = await bcx(settings, "enrollment-rules", "confirm", fake_id, "--json")
    assert again.returncode != 0
    err = json.loads(again.stdout or again.stderr)["error"]
    assert (err["code"], err["details"]["reason"]) == ("INVALID_STATE", "nothing-pending"), err

    # by hand too, whatever the spelling of the address
    for address in ("https://10.77.0.9", "10.77.0.9", "HTTPS://10.77.0.9/"):
        with pytest.raises(BcError) as taken:
            await engine.enroll_node(
                site_id=SITE, macs=["52:54:00:e2:00:09"],
                bmc=NodeBmc(driver="redfish", address=address, system_id="/redfish/v1/Systems/1"),
            )  # fmt: skip
        assert (taken.value.code.value, taken.value.path) == ("CONFLICT", "bmc.address"), taken.value
    # another system behind the same BMC address is another machine
    other = await engine.enroll_node(
        site_id=SITE, macs=["52:54:00:e2:00:0a"],
        bmc=NodeBmc(driver="redfish", address="https://10.77.0.9", system_id="/redfish/v1/Systems/2"),
    )  # fmt: skip
    assert other.state == "enrolled"
    nodes = (await bc_api.call("engine", "nodes.list", {"siteId": SITE, "limit": 1000}))["nodes"]
    bmcs = [(n["bmc"]["address"], n["bmc"].get("systemId")) for n in nodes if n.get("bmc")]
    assert len(bmcs) == len(set(bmcs))  # 0 nodes share a BMC


async def _with(api: ApiClient, node_id: str, key: str) -> dict[str, Any] | None:
    """The node once it has ``key`` (None until then, or while it is not there)."""
    try:
        doc: dict[str, Any] = await api.call("engine", "nodes.get", {"id": node_id})
    except BcError:
        return None
    return doc if doc.get(key) else None
