"""A workflow started with bcx drives a Redfish BMC through bc-site-agent: the engine, the
command-queue and bc-pki as processes, sushy-emulator (fake driver, power lands 1-11 s late; no
BMC authentication here: until the engine fills ``bmc`` from the node record, the profile passes
it in ``with``, and a per-step credential cannot exist before the workflow does)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from better_compute.clients import EngineClient
from better_compute.clients.cmdq import CommandQueueClient
from better_compute.config import Settings
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, bcx
from better_compute.testing.agents import until
from better_compute.testing.bmcs import SYSTEM_MACS, SYSTEM_UUID, FaultyProxy, RedfishEmulator
from better_compute.testing.site_agent import SiteAgentProcess

SITE = "lab-wf"
ISO = b"an ISO image, small\n" * 64


@dataclass
class Lab:
    emulator: RedfishEmulator
    proxy: FaultyProxy
    agent: SiteAgentProcess


@pytest_asyncio.fixture(loop_scope="session")
async def lab(
    bc_api: ApiClient, bc_processes: ServiceProcesses, bc_settings: Settings, tmp_path: Path
) -> AsyncIterator[Lab]:
    for service in ("bc-pki", "bc-command-queue", "bc-engine"):
        bc_processes.start(service)
    await bc_processes.wait_ready()
    emulator = RedfishEmulator(tmp_path / "redfish", auth=False).start()
    proxy = FaultyProxy(tmp_path / "proxy", emulator.url).start()
    agent = SiteAgentProcess(
        folder=tmp_path / "site-agent",
        nats_url=bc_settings.nats_url or "",
        subject_root=bc_settings.subject_root,
        site_id=SITE,
    )
    try:
        await agent.join(bc_api)
        yield Lab(emulator=emulator, proxy=proxy, agent=agent)
    finally:
        agent.close()
        proxy.close()
        emulator.close()
        print("--- site agent ---", agent.output()[-4000:], sep="\n")


def _get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        doc: dict[str, Any] = json.loads(resp.read())
        return doc


@pytest.mark.timeout(180)
async def test_a_bcx_workflow_power_cycles_pxe_boots_and_reads_inventory(
    lab: Lab, bc_api: ApiClient, bc_settings: Settings, tmp_path: Path
) -> None:
    iso_file = tmp_path / "image.iso"
    iso_file.write_bytes(ISO)
    source = await asyncio.to_thread(_serve_file, iso_file)
    sha = hashlib.sha256(ISO).hexdigest()
    bmc = {"driver": "redfish", "address": lab.proxy.url}
    profile = {
        "id": "redfish-lab",
        "version": 1,
        "target": "metal",
        "role": "host",
        "writesDisk": False,  # the medium is a few bytes nothing boots
        "steps": [
            {"use": "media.insert", "on": "site", "with": {"url": source, "sha256": sha, "bmc": bmc}},
            {"use": "management.setBootDevice", "on": "site", "with": {"device": "pxe", "bmc": bmc}},
            {"use": "power.setPower", "on": "site", "with": {"action": "on", "bmc": bmc}},
            {"use": "power.setPower", "on": "site", "with": {"action": "cycle", "bmc": bmc}},
            {"use": "media.eject", "on": "site", "with": {"bmc": bmc}},
            {"use": "management.inventory", "on": "site", "with": {"bmc": bmc}},
        ],
    }
    doc = tmp_path / "profile.json"
    doc.write_text(json.dumps(profile))
    code, out, err = await bcx(bc_settings, "profiles", "create", str(doc))
    assert code == 0, err
    node = await EngineClient(bc_api).create_node(site_id=SITE)
    code, out, err = await bcx(
        bc_settings,
        "workflows",
        "start",
        "--profile",
        "redfish-lab",
        "--node",
        node.id,
        "--wait",
        "--json",
        timeout=100,
    )
    assert code == 0, out + err
    last = json.loads(out.strip().splitlines()[-1])
    assert last["workflowState"] == "succeeded", out

    system = await asyncio.to_thread(_get_json, f"{lab.emulator.url}/redfish/v1/Systems/{SYSTEM_UUID}")
    assert system["PowerState"] == "On"
    assert system["Boot"]["BootSourceOverrideTarget"] == "Pxe"
    assert sum("ComputerSystem.Reset" in r for r in lab.proxy.requests()) == 2  # on, then the cycle
    inserts = [b for b in lab.proxy.bodies() if "InsertMedia" in b]
    assert len(inserts) == 1
    assert f"{lab.agent.url}/cache/{sha}" in inserts[0]  # the BMC was handed the site cache's copy
    cq = CommandQueueClient(bc_api, timeout=5.0)

    async def cache_told() -> Any:  # the agent's heartbeat says it (its /healthz no longer does)
        (agent,) = await cq.agents(site_id=SITE)
        status = agent.status
        return (
            status if status is not None and (status.cache_objects, status.cache_pinned) == (1, 0) else None
        )

    await until(cache_told, timeout=30)  # one object, and ejected: the image may be evicted again
    health = await asyncio.to_thread(_get_json, f"{lab.agent.url}/healthz")
    assert "cache" not in health
    code, out, err = await bcx(bc_settings, "workflows", "get", last["workflowId"], "--json")
    assert code == 0, err
    steps = json.loads(out)["steps"]
    inventory = steps[-1]["result"]["result"]
    assert sorted(n["mac"] for n in inventory["nics"]) == sorted(SYSTEM_MACS)


def _serve_file(path: Path) -> str:
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    class Handler(SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(path.parent), **kwargs)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}/{path.name}"
