"""A host section reaches the machine: a metal verb's profile writes it, the engine sends it to the
node's bcd (a real ``bcd run`` on a prepared machine tree) and keeps the generation bcd reports."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest_asyncio

from better_compute.clients import CommandQueueClient, PkiClient
from better_compute.config import Settings
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, until
from better_compute.testing.bcd import BcdProcess, run_bcd
from better_compute.testing.machines import prepare_machine

UUID = "4c4c4544-0042-3510-8052-b4c04f4e3432"


@pytest_asyncio.fixture(loop_scope="session")
async def settings(bc_settings: Settings, bc_processes: ServiceProcesses) -> AsyncIterator[Settings]:
    settings = msgspec.structs.replace(bc_settings, app="metal_test_app:app")
    bc_processes.settings = settings
    bc_processes.extra_env.update(BC_CMDQ_HEARTBEAT="200ms", BC_CMDQ_SWEEP="100ms")
    for name in ("bc-pki", "bc-command-queue", "bc-engine"):
        bc_processes.start(name)
    await bc_processes.wait_ready()
    yield settings


async def test_the_host_section_is_converged_by_bcd_and_its_generation_kept(
    settings: Settings, bc_api: ApiClient, bcds: list[BcdProcess], tmp_path: Path
) -> None:
    node = (await bc_api.call("engine", "metal.enroll", {"siteId": "lab1"}))["id"]
    # the machine already runs an OS with bcd joined as this node
    root = prepare_machine(tmp_path / "m1", product_uuid=UUID)
    token = await PkiClient(bc_api).issue_join_token(
        tenant_id="root", role="provisioned", site_id="lab1", ttl_seconds=600, node_id=node,
        expect={"productUuid": UUID},
    )  # fmt: skip
    (root / "etc/bcd").mkdir(parents=True, exist_ok=True)
    (root / "etc/bcd/join-token").write_text(token.token + "\n")
    joined = await run_bcd(settings, root, "join", "--control-plane", "https://gw.example.test",
                           "--token-file", "/etc/bcd/join-token", "--node", node)  # fmt: skip
    assert joined.returncode == 0, joined.stderr
    bcd = BcdProcess.start(settings, root, "--mode", "installed", log=tmp_path / "bcd.log")
    bcds.append(bcd)
    cq = CommandQueueClient(bc_api)

    async def connected() -> bool:
        assert bcd.proc.poll() is None, bcd.output()
        return any(a.id == node and a.connected for a in await cq.agents(site_id="lab1"))

    await until(connected)

    await bc_api.call("engine", "metal.adopt", {"nodeId": node, "profile": "t.adopt-host"})

    async def observed() -> dict[str, object] | None:
        doc: dict[str, object] = await bc_api.call("engine", "nodes.get", {"id": node})
        return doc if doc["observedGeneration"] == 2 else None

    doc = await until(observed, what="bcd reports generation 2")
    assert (doc["state"], doc["generation"], doc["lastError"]) == ("deployed", 2, None)
    unit = {"name": "kernel-modules", "settings": {"load": [], "blacklist": ["floppy"], "options": {}}}
    assert doc["hostSection"] == {"units": [unit]}
    assert "blacklist floppy" in (root / "etc/modprobe.d/bc.conf").read_text()
    [converge] = (await cq.list_commands(node_id=node, kind="node.converge")).commands
    assert (converge.key, converge.state, converge.attested) == ("host:g2", "succeeded", True)
