"""``sites_stack()``: the fleet stack over several sites, each behind its own NATS leaf node.

The services connect to a hub nats-server (JetStream, every site's command stream, or with
``leaf_domains`` each site's streams on its own leaf); each site
has its own leaf node (``better_compute.testing.leaves``), metal simulator, site agent and
machines, and every one of the site's agents (the site agent, each bcd) reaches the control
plane only through its leaf, whose link to the hub a test cuts with ``stack.leaves.gate(site)``.
``fleet_stack`` (one site on the session's nats-server) stays what the other tests use.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from ...config import Settings
from ...service import ApiClient
from ...service.client import connect
from ...wire import Subjects
from ..images import register_sim_image
from ..leaves import SiteLeaves
from ..processes import ServiceProcesses
from ..site_agent import SiteAgentProcess
from .fleet import MetalSim
from .stack import APP, FAST_ENV, SERVICES, FleetStack, MediaServer

__all__ = ["SitesStack", "sites_stack"]


@dataclass
class SitesStack:
    """The hub and its leaves, the services, and one ``FleetStack`` per site (sharing the
    services, the API client and the media server)."""

    folder: Path
    settings: Settings
    leaves: SiteLeaves
    processes: ServiceProcesses
    api: ApiClient
    sites: dict[str, FleetStack] = field(default_factory=dict)

    def site(self, site_id: str) -> FleetStack:
        return self.sites[site_id]

    def tails(self, lines: int = 40) -> str:
        return "\n".join(s.tails(lines) for s in self.sites.values())


@contextlib.asynccontextmanager
async def sites_stack(
    folder: Path,
    settings: Settings,
    *,
    sites: list[str],
    machines: int = 2,
    power_delay: Mapping[str, tuple[float, float]] | None = None,
    env: Mapping[str, str] | None = None,
    app: str = APP,
    leaf_domains: bool = False,
) -> AsyncIterator[SitesStack]:
    """Start the hub, a leaf per site in ``sites``, the services on the hub (``settings``' database
    and subject root; its ``nats_url`` is replaced by the hub's), and per site a simulator of
    ``machines`` machines (``power_delay[site]`` at its BMC) and its site agent, each enrolled;
    stop all of it on the way out. ``leaf_domains``: each leaf runs JetStream in a domain named
    after its site and the command queue keeps the site's streams there
    (``BC_CMDQ_SITE_DOMAIN={site}``)."""
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    leaves = await asyncio.to_thread(SiteLeaves(folder / "nats", list(sites), domains=leaf_domains).start)
    settings = msgspec.structs.replace(settings, nats_url=leaves.hub_url, app=app)
    processes = ServiceProcesses(settings, folder / "logs")
    media = MediaServer(folder / "media")
    processes.extra_env.update(
        {**FAST_ENV, "BC_SIM_MEDIA_DIR": str(media.folder), "BC_SIM_MEDIA_URL": media.url, **(env or {})}
    )
    if leaf_domains:
        processes.extra_env["BC_CMDQ_SITE_DOMAIN"] = "{site}"
    nc = await connect(leaves.hub_url, name="bc-sites")
    api = ApiClient(nc, Subjects(settings.subject_root))
    stack = SitesStack(folder=folder, settings=settings, leaves=leaves, processes=processes, api=api)
    try:
        for service in SERVICES:
            processes.start(service)
        for n, site in enumerate(sites):
            at_site = msgspec.structs.replace(settings, nats_url=leaves.url(site))
            sim = MetalSim(
                folder / site / "sim", settings=at_site, machines=machines, site_id=site, seed=n + 1,
                power_delay=(power_delay or {}).get(site, (0.0, 0.0)),
            )  # fmt: skip
            agent = SiteAgentProcess(
                folder=folder / site / "site-agent", nats_url=leaves.url(site),
                subject_root=settings.subject_root, site_id=site, quiet_seconds=0.5,
            )  # fmt: skip
            sim.boot_url = agent.url
            stack.sites[site] = FleetStack(
                folder=folder / site, settings=at_site, api=api, processes=processes, sim=sim, agent=agent,
                media=media,
            )  # fmt: skip
        await asyncio.gather(
            processes.wait_ready(timeout=180), *(asyncio.to_thread(s.sim.start) for s in stack.sites.values())
        )
        for fleet in stack.sites.values():
            await fleet.agent.join(api)
        await register_sim_image(next(iter(stack.sites.values())).engine)
        for fleet in stack.sites.values():
            for index in range(machines):
                await fleet.enroll(index)
        yield stack
    finally:
        for fleet in stack.sites.values():
            fleet.agent.close()
            await asyncio.to_thread(fleet.sim.close)
        media.close()
        processes.close()
        with contextlib.suppress(Exception):
            await nc.close()
        await asyncio.to_thread(leaves.close)
