"""``SiteDriver``: what the engine sends to a simulated machine, without the engine: site-agent
commands with the BMC credential stored per step in bc-secrets, a network or media boot of a
node's ramdisk, and node commands. For tests and demos of the simulator."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ...clients.cmdq import CommandQueueClient
from ...clients.pki import PkiClient
from ...clients.secrets import SecretsClient
from ...core.ids import new_id
from ...wire.cmdq import CommandView, EnqueueCommand
from .fleet import MetalSim
from .hardware import SimMachine

__all__ = ["SiteDriver"]

_BMC_KINDS = ("power.", "management.", "media.")


@dataclass
class SiteDriver:
    sim: MetalSim
    cq: CommandQueueClient
    pki: PkiClient
    secrets: SecretsClient
    wf: str = ""
    steps: int = 0

    def __post_init__(self) -> None:
        self.wf = self.wf or new_id("wf")

    async def command(
        self, m: SimMachine, node: str, kind: str, payload: dict[str, Any], *, timeout: float = 60.0
    ) -> CommandView:
        """One site-agent command of a new workflow step for machine ``m``, settled."""
        self.steps += 1
        if kind.startswith(_BMC_KINDS):
            creds = json.dumps(self.sim.emulator.credentials).encode()
            ref = await self.secrets.put(value=creds, tenant_id="root", workflow_id=self.wf, step=self.steps)
            payload = {**payload, "bmc": m.bmc(ref.ref)}
        view = await self.cq.enqueue(
            EnqueueCommand(node_id=node, site_id=self.sim.site_id, kind=kind, workflow_id=self.wf,
                           step=self.steps, key=f"wf:{self.wf}:{self.steps}#1:{kind}", payload=payload,
                           timeout_ms=int(timeout * 1000))
        )  # fmt: skip
        return await self.cq.wait(id=view.id, timeout=timeout + 5)

    async def ok(self, m: SimMachine, node: str, kind: str, payload: dict[str, Any]) -> dict[str, Any]:
        """``command`` that must succeed; its result."""
        done = await self.command(m, node, kind, payload)
        if done.state != "succeeded":
            raise AssertionError(f"{kind}: {done.state}: {done.reason}")
        result: dict[str, Any] = json.loads(done.result or "{}")
        return result

    async def boot_cmdline(self, m: SimMachine, node: str) -> str:
        """The kernel command line of the node's ramdisk: a single-use join token bound to the
        node and the machine's product UUID, and where the control plane is."""
        token = await self.pki.issue_join_token(
            tenant_id="root", role="provisioned", site_id=self.sim.site_id, ttl_seconds=600, node_id=node,
            expect={"productUuid": m.uuid},
        )  # fmt: skip
        return f"bcd.token={token.token} bcd.control_plane=nats://gw.invalid:4222"

    async def network_boot(self, m: SimMachine, node: str) -> None:
        """A one-time iPXE entry with the ramdisk's command line, PXE once, power on."""
        await self.ok(m, node, "netboot.setEntry", {
            "mac": m.macs[0], "kernel": "http://127.0.0.1:9/bcd-ramdisk/vmlinuz",
            "cmdline": await self.boot_cmdline(m, node),
        })  # fmt: skip
        await self.ok(m, node, "management.setBootDevice", {"device": "pxe"})
        await self.ok(m, node, "power.setPower", {"action": "on"})

    async def media_boot(self, m: SimMachine, node: str, url: str) -> None:
        """The medium at ``url`` in the virtual CD, CD once, power on."""
        await self.ok(m, node, "media.insert", {"url": url, "device": "cd"})
        await self.ok(m, node, "management.setBootDevice", {"device": "cd"})
        await self.ok(m, node, "power.setPower", {"action": "on"})

    async def node_command(self, node: str, kind: str, payload: dict[str, Any], key: str) -> CommandView:
        view = await self.cq.enqueue(
            EnqueueCommand(node_id=node, site_id=self.sim.site_id, kind=kind, payload=payload, key=key,
                           target="node")
        )  # fmt: skip
        return await self.cq.wait(id=view.id, timeout=60)
