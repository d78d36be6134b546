"""The engine with its peers as processes, driven from a test: one ``AgentStack`` for the e2e and
chaos tests (clients of every service, simulated site agents, profiles and workflows)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from better_compute.clients import CommandQueueClient, EngineClient, PkiClient, SecretsClient
from better_compute.config import Settings
from better_compute.service import ApiClient
from better_compute.testing.agents import SimAgent, start_sim_agent
from better_compute.wire.engine import WorkflowStep
from better_compute.wire.metal import NodeBmc

__all__ = ["FAST", "AgentStack", "sim_bmc"]

FAST = {"BC_CMDQ_HEARTBEAT": "200ms", "BC_CMDQ_SILENT_AFTER": "1500ms", "BC_CMDQ_SWEEP": "100ms"}
"""Command-queue timings that let a test see an agent come and go in seconds."""
_SIM_BMCS = itertools.count(1)


def sim_bmc() -> NodeBmc:
    """A node's BMC for tests whose nodes run BMC commands: the engine relays the node's BMC to
    them and fails a BMC step on a node without one (docs/metal.md). Each call a BMC of its own:
    one BMC, one node (issue 23)."""
    return NodeBmc(driver="sim", address=f"sim-bmc-{next(_SIM_BMCS)}")


class AgentStack:
    """A client of each service on ``api``, and the simulated agents a test started (closed by
    ``close_agents``)."""

    def __init__(self, api: ApiClient, settings: Settings, tmp: Path) -> None:
        self.api = api
        self.settings = settings
        self.tmp = tmp
        self.engine = EngineClient(api)
        self.cq = CommandQueueClient(api)
        self.pki = PkiClient(api)
        self.secrets = SecretsClient(api)
        self.agents: list[SimAgent] = []

    async def agent(self, site: str, *args: str) -> tuple[SimAgent, str]:
        """A simulated site agent of ``site`` joined and running; its id."""
        sim, agent_id = await start_sim_agent(
            self.settings, self.tmp / f"agent-{len(self.agents)}", site_id=site, pki=self.pki, cq=self.cq,
            args=list(args),
        )  # fmt: skip
        self.agents.append(sim)
        return sim, agent_id

    async def profile(self, pid: str, steps: list[dict[str, Any]]) -> None:
        doc = {"id": pid, "version": 1, "target": "metal", "role": "host", "steps": steps}
        await self.engine.create_profile(document=doc)

    async def start(self, pid: str, node: str) -> str:
        wf = await self.engine.start_workflow(profile_id=pid, node_id=node)
        return wf.id

    async def step(self, wf_id: str, idx: int = 0) -> WorkflowStep:
        steps = (await self.engine.get_workflow(id=wf_id)).steps or []
        return steps[idx]

    def close_agents(self) -> None:
        for sim in self.agents:
            sim.close()
