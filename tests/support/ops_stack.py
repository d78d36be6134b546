"""A small control plane for the operations tests (metrics, event feed, audit): bc-pki,
bc-secrets, bc-command-queue and bc-engine as processes, each on a health port, and a site agent
(its own process) whose sim BMCs run power steps."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from better_compute.clients import EngineClient
from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.pki import PkiClient
from better_compute.config import Settings
from better_compute.runtime.embedded import free_port
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses
from better_compute.testing.agents import until
from better_compute.testing.site_agent import SiteAgentProcess

SERVICES = ("bc-pki", "bc-secrets", "bc-command-queue", "bc-engine")
PROFILE = "ops-lab"


@dataclass
class OpsStack:
    site: str
    ports: dict[str, int]
    agent: SiteAgentProcess

    def metrics_url(self, service: str) -> str:
        if service == "site-agent":
            return self.agent.metrics_url
        return f"http://127.0.0.1:{self.ports[service]}/metrics"


@asynccontextmanager
async def ops_stack(
    api: ApiClient, processes: ServiceProcesses, settings: Settings, folder: Path, *, site: str
) -> AsyncIterator[OpsStack]:
    ports = {service: free_port() for service in SERVICES}
    for service, port in ports.items():
        processes.start(service, "--health-port", str(port))
    await processes.wait_ready(timeout=60)
    token = await PkiClient(api).issue_join_token(
        tenant_id="root", role="site", site_id=site, ttl_seconds=600
    )
    agent = SiteAgentProcess(
        folder=folder / "site-agent",
        nats_url=settings.nats_url or "",
        subject_root=settings.subject_root,
        site_id=site,
    )
    agent.write_config(token.token)
    agent.start()
    try:
        await until(lambda: CommandQueueClient(api).agents(site_id=site, connected=True))
        yield OpsStack(site=site, ports=ports, agent=agent)
    finally:
        agent.close()
        print("--- site agent ---", agent.output()[-4000:], sep="\n")


async def create_power_profile(engine: EngineClient, actions: Sequence[str], *, address: str) -> None:
    """Profile ``ops-lab``: one ``power.setPower`` step per action, on the site's sim BMC."""
    bmc = {"driver": "sim", "address": address}
    await engine.create_profile(
        document={
            "id": PROFILE,
            "version": 1,
            "target": "metal",
            "role": "host",
            "steps": [
                {"use": "power.setPower", "on": "site", "with": {"action": action, "bmc": bmc}}
                for action in actions
            ],
        }
    )
