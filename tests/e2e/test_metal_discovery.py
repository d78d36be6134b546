"""Discovery: an unknown machine's bcd joins with its site's discovery token (from the discovery
ramdisk's kernel command line) and appears once in the engine as ``discovered``, with its
inventory and hardware claims; trusted with nothing until the operator enrolls it.

bc-pki, bc-secrets, bc-command-queue and bc-engine are processes; bcd is a real ``bcd join`` /
``bcd run`` against prepared machine trees; bcx is its own process.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from test_bcx_operator import bcx, ok_json

from better_compute.clients import EngineClient, PkiClient
from better_compute.config import Settings
from better_compute.core.errors import BcError
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, until
from better_compute.testing.bcd import BcdProcess, run_bcd
from better_compute.testing.machines import prepare_machine

pytestmark = pytest.mark.e2e

SITE = "lab1"
UUID = "5a1e0000-d15c-4000-8000-00000000c0de"
MACS = ("52:54:00:d1:5c:01", "52:54:00:d1:5c:02")


@pytest_asyncio.fixture(loop_scope="session")
async def settings(bc_settings: Settings, bc_processes: ServiceProcesses) -> AsyncIterator[Settings]:
    settings = msgspec.structs.replace(bc_settings, app="metal_test_app:app")
    bc_processes.settings = settings
    bc_processes.extra_env.update(BC_CMDQ_HEARTBEAT="200ms", BC_CMDQ_SWEEP="100ms")
    for name in ("bc-pki", "bc-secrets", "bc-command-queue", "bc-engine"):
        bc_processes.start(name)
    await bc_processes.wait_ready()
    yield settings


async def _discovery_token(api: ApiClient, site: str = SITE) -> Any:
    return await PkiClient(api).issue_join_token(
        tenant_id="root", role="discovery", site_id=site, ttl_seconds=900, max_uses=50
    )


async def _boot_discovery(settings: Settings, root: Path, token: str, site: str = SITE) -> Any:
    """What the discovery ramdisk does: ``bcd join`` with the site agent's kernel command line."""
    (root / "proc/cmdline").write_text(
        f"console=ttyS0 bcd.site={site} bcd.token={token} bcd.control_plane=nats://gw.example.test\n"
    )
    return await run_bcd(settings, root, "join", "--no-service")


async def _node(api: ApiClient, node_id: str) -> dict[str, Any]:
    doc: dict[str, Any] = await api.call("engine", "nodes.get", {"id": node_id})
    return doc


async def _nodes_with_uuid(api: ApiClient) -> list[dict[str, Any]]:
    nodes = (await api.call("engine", "nodes.list", {"siteId": SITE, "limit": 1000}))["nodes"]
    return [n for n in nodes if (n.get("hardware") or {}).get("productUuid") == UUID]


async def test_an_unknown_machine_is_discovered_once_trusted_with_nothing_then_enrolled(
    settings: Settings, bc_api: ApiClient, bcds: list[BcdProcess], tmp_path: Path
) -> None:
    token = await _discovery_token(bc_api)
    first = prepare_machine(tmp_path / "boot1", product_uuid=UUID, serial="DISC-1", macs=MACS)
    joined = await _boot_discovery(settings, first, token.token)
    assert joined.returncode == 0, joined.stderr
    node_id = json.loads(joined.stdout)["nodeId"]
    assert node_id.startswith("node_")
    assert token.token not in joined.stdout + joined.stderr
    bcds.append(BcdProcess.start(settings, first, "--mode", "ramdisk", log=tmp_path / "bcd1.log"))

    async def inventoried() -> bool:
        doc = await _node(bc_api, node_id)
        return doc["state"] == "discovered" and doc.get("inventory") is not None

    await until(inventoried, timeout=60)
    doc = await _node(bc_api, node_id)
    assert doc["siteId"] == SITE
    assert sorted(doc["macs"]) == sorted(MACS)
    assert doc["hardware"]["productUuid"] == UUID
    assert doc["hardware"]["serial"] == "DISC-1"
    assert doc["inventory"]["productUuid"] == UUID
    assert doc["inventorySummary"]["nics"] == 2
    assert doc["bmc"] is None
    first_cert = doc["hardware"]["certId"]
    assert len(await _nodes_with_uuid(bc_api)) == 1

    # the machine boots discovery again (a fresh ramdisk, a new key): claims alone never give a
    # join an existing node's id (issue 23, H2), and the same hardware is not recorded twice
    second = prepare_machine(tmp_path / "boot2", product_uuid=UUID, serial="DISC-1", macs=MACS, cpus=8)
    again = await _boot_discovery(settings, second, token.token)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["nodeId"] != node_id
    assert [n["id"] for n in await _nodes_with_uuid(bc_api)] == [node_id]
    doc = await _node(bc_api, node_id)
    assert (doc["hardware"]["certId"], doc["discoveryConflict"]) == (first_cert, None)  # same claims

    # trusted with nothing: destructive verbs are refused for its state
    engine = EngineClient(bc_api)
    for verb in ("release", "deploy", "inspect"):
        with pytest.raises(BcError) as refused:
            await engine.run_verb(verb, node_id=node_id, image="ubuntu@24.04")  # type: ignore[arg-type]
        assert refused.value.code.value == "INVALID_STATE", refused.value
        assert f"node {node_id} is discovered" in refused.value.message
    # nor does a workflow of its own reach it (t.release sends a destructive command)
    with pytest.raises(BcError) as started:
        await bc_api.call("engine", "workflows.start", {"profileId": "t.release", "nodeId": node_id})
    assert (started.value.code.value, started.value.reason) == ("INVALID_STATE", "node-discovered")
    shown = await bcx(settings, "nodes", "show", node_id)
    assert "state       discovered" in shown.stdout, shown.stdout
    assert f"hardware    uuid {UUID}  serial DISC-1" in shown.stdout, shown.stdout

    # the operator enrolls it with its BMC; its MACs stay; the discovery key is trusted no more
    enrolled = await ok_json(settings, "nodes", "enroll", node_id, "--bmc", "sim://bmc-disc")
    assert (enrolled["id"], enrolled["state"], enrolled["siteId"]) == (node_id, "enrolled", SITE)
    assert sorted(enrolled["macs"]) == sorted(MACS)
    assert enrolled["bmc"]["driver"] == "sim"
    pki = PkiClient(bc_api)

    async def discovery_keys_revoked() -> bool:
        certs = await pki.list_certificates(agent_id=node_id, include_revoked=True)
        return bool(certs) and all(c.state == "revoked" for c in certs if c.role == "discovery")

    await until(discovery_keys_revoked, timeout=30)
    # the same hardware booting discovery again now changes nothing
    third = prepare_machine(tmp_path / "boot3", product_uuid=UUID, serial="DISC-1", macs=MACS)
    late = await _boot_discovery(settings, third, token.token)
    assert late.returncode == 0, late.stderr
    assert json.loads(late.stdout)["nodeId"] != node_id  # a fresh identity, not the enrolled node's
    assert [n["id"] for n in await _nodes_with_uuid(bc_api)] == [node_id]
    assert (await _node(bc_api, node_id))["state"] == "enrolled"


async def test_a_discovery_join_claiming_a_known_machine_takes_over_nothing(
    settings: Settings, bc_api: ApiClient, tmp_path: Path
) -> None:
    """Issue 23, H2: the site's discovery token is on every unknown MAC's kernel line, so anyone
    on the boot network joins with it; claiming a discovered machine's product UUID with other
    MACs used to get that node's id and replace its MACs, so the machine's enrolment booted the
    attacker. Now: another node id, the node's MACs as they were, and the node shows the
    conflict."""
    token = await _discovery_token(bc_api)
    uuid = "5a1e0000-d15c-4000-8000-00000000d00d"
    macs = ("52:54:00:d1:5d:01", "52:54:00:d1:5d:02")
    machine = prepare_machine(tmp_path / "machine", product_uuid=uuid, serial="REAL-1", macs=macs)
    joined = await _boot_discovery(settings, machine, token.token)
    assert joined.returncode == 0, joined.stderr
    node_id = json.loads(joined.stdout)["nodeId"]
    await until(lambda: _exists(bc_api, node_id), timeout=30, what="the discovered node")

    fake = prepare_machine(tmp_path / "fake", product_uuid=uuid, serial="REAL-1", macs=("52:54:00:66:66:01",))
    faked = await _boot_discovery(settings, fake, token.token)
    assert faked.returncode == 0, faked.stderr
    assert json.loads(faked.stdout)["nodeId"] != node_id

    async def conflict_shown() -> bool:
        return (await _node(bc_api, node_id)).get("discoveryConflict") is not None

    await until(conflict_shown, timeout=30, what="the conflict on the node")
    doc = await _node(bc_api, node_id)
    assert sorted(doc["macs"]) == sorted(macs)  # 0 MAC changes without an operator
    assert sorted(doc["hardware"]["macs"]) == sorted(macs)
    assert doc["discoveryConflict"]["claims"]["macs"] == ["52:54:00:66:66:01"]
    shown = await bcx(settings, "nodes", "show", node_id)
    assert "conflict    a discovery showed this hardware with macs 52:54:00:66:66:01" in shown.stdout, (
        shown.stdout
    )


async def _exists(api: ApiClient, node_id: str) -> bool:
    try:
        await _node(api, node_id)
    except BcError:
        return False
    return True


async def test_a_discovery_token_of_another_site_is_refused_and_not_spent(
    settings: Settings, bc_api: ApiClient, tmp_path: Path
) -> None:
    token = await _discovery_token(bc_api, site="lab2")
    root = prepare_machine(tmp_path / "m", product_uuid="5a1e0000-d15c-4000-8000-0000000000b2")
    refused = await _boot_discovery(settings, root, token.token, site=SITE)
    assert refused.returncode == 1
    assert "PERMISSION_DENIED" in refused.stderr, refused.stderr
    assert "the join token is for site lab2, not lab1" in refused.stderr
    assert token.token not in refused.stderr + refused.stdout
    assert (await PkiClient(bc_api).get_join_token(join_token_id=token.join_token_id)).uses == 0
    assert not (root / "var/lib/bcd/enrollment.json").exists()
    (audit,) = await PkiClient(bc_api).list_joins(join_token_id=token.join_token_id)
    assert audit.outcome == "site-mismatch"


async def test_a_discovery_made_while_the_engine_was_away_is_recorded_when_it_is_back(
    settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> None:
    (engine,) = [p for p in bc_processes.procs if p.service == "bc-engine" and p.alive()]
    engine.kill()  # the join event goes to nobody
    token = await _discovery_token(bc_api)
    root = prepare_machine(
        tmp_path / "m", product_uuid="5a1e0000-d15c-4000-8000-0000000000a3", macs=("52:54:00:d1:5c:a3",)
    )
    joined = await _boot_discovery(settings, root, token.token)
    assert joined.returncode == 0, joined.stderr
    node_id = json.loads(joined.stdout)["nodeId"]
    bc_processes.restart(engine)
    await bc_processes.wait_ready()

    async def discovered() -> bool:
        try:
            return (await _node(bc_api, node_id))["state"] == "discovered"
        except BcError:
            return False

    await until(discovered, timeout=60)


async def test_a_deleted_discovered_node_stays_deleted(
    settings: Settings, bc_api: ApiClient, tmp_path: Path
) -> None:
    """Issue 26: deleting a discovered node revokes its discovery certificate, so neither the
    discovery sweep nor its running ramdisk brings it back; only a new discovery boot does."""
    token = await _discovery_token(bc_api)
    root = prepare_machine(
        tmp_path / "m", product_uuid="5a1e0000-d15c-4000-8000-0000000000d6", macs=("52:54:00:d1:5c:d6",)
    )
    joined = await _boot_discovery(settings, root, token.token)
    assert joined.returncode == 0, joined.stderr
    node_id = json.loads(joined.stdout)["nodeId"]

    async def discovered() -> bool:
        try:
            return (await _node(bc_api, node_id))["state"] == "discovered"
        except BcError:
            return False

    await until(discovered, timeout=60)
    deleted = await ok_json(settings, "nodes", "delete", node_id)
    assert deleted["deleted"] == node_id
    certs = await PkiClient(bc_api).list_certificates(agent_id=node_id, include_revoked=True)
    assert [c.state for c in certs if c.role == "discovery"] == ["revoked"]
    with pytest.raises(BcError) as gone:
        await _node(bc_api, node_id)
    assert gone.value.code.value == "NOT_FOUND"
