"""``fleet_stack()``: the whole system around a simulated fleet, every part its own process.

bc-pki, bc-secrets, bc-command-queue and bc-engine (loading ``metal_sim.app``), the metal
simulator (one sushy-emulator for N machines), the site agent of the fleet's site with its real
Redfish driver, and a media server for the autoinstall ISOs. Each machine is enrolled as a node
with its MACs and a ``redfish`` BMC whose credential is the node's standing secret in bc-secrets
(``credentialsRef``), through the typed clients. For tests, the demo, benchmarks and chaos runs;
see docs/metal-sim.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.server
import json
import shutil
import tempfile
import threading
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from ...clients import CommandQueueClient, EngineClient, PkiClient, SecretsClient
from ...config import Settings
from ...core.ids import new_id
from ...service import ApiClient
from ...service.client import connect
from ...wire import Subjects
from ...wire.engine import NodeView
from ...wire.metal import NodeBmc, VerbRun
from ..images import register_sim_image
from ..processes import ServiceProcesses
from ..site_agent import SiteAgentProcess
from ..waiting import until
from .fleet import MetalSim
from .hardware import Faults, SimMachine

if TYPE_CHECKING:  # vmlab builds on metal_sim's emulator: imported where the VMs start
    from ..vmlab import LabVm, VmLab

__all__ = ["APP", "FAST_ENV", "SERVICES", "FleetStack", "MediaServer", "fleet_stack"]

APP = "better_compute.testing.metal_sim.app:app"
SERVICES = ("bc-pki", "bc-secrets", "bc-command-queue", "bc-engine")
# Agents judged silent and commands redelivered in about a second, not tens of seconds.
FAST_ENV = {"BC_CMDQ_HEARTBEAT": "200ms", "BC_CMDQ_SWEEP": "100ms", "BC_CMDQ_REDELIVER_AFTER": "1s"}


class MediaServer:
    """Serves a folder over HTTP on loopback: the autoinstall ISOs the BMC inserts, or a file a
    test puts there with ``add`` (a medium, an image). Without a folder, a temporary one that
    ``close`` removes; ``port`` 0 picks a free port."""

    def __init__(self, folder: Path | None = None, *, port: int = 0) -> None:
        self._own = folder is None
        folder = Path(tempfile.mkdtemp(prefix="bc-media-")) if folder is None else folder
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder

        class Quiet(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

        handler = functools.partial(Quiet, directory=str(folder))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, name="fleet-media", daemon=True).start()

    def add(self, name: str, body: bytes) -> str:
        """Serve ``body`` as ``name``; its URL."""
        (self.folder / name).write_bytes(body)
        return f"{self.url}/{name}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        if self._own:
            shutil.rmtree(self.folder, ignore_errors=True)


@dataclass
class FleetStack:
    """A running fleet: its clients, processes, simulator and the node id of each machine."""

    folder: Path
    settings: Settings
    api: ApiClient
    processes: ServiceProcesses
    sim: MetalSim
    agent: SiteAgentProcess
    media: MediaServer
    nodes: dict[int, str] = field(default_factory=dict)
    """Machine index -> node id, for the enrolled machines."""
    lab: VmLab | None = None
    """The VMs (``vms=N``), behind their BMCs, booting from the same site agent."""
    vm_nodes: dict[int, str] = field(default_factory=dict)
    """VM index -> node id, for the enrolled VMs."""

    @property
    def site_id(self) -> str:
        return self.sim.site_id

    @functools.cached_property
    def engine(self) -> EngineClient:
        return EngineClient(self.api)

    @functools.cached_property
    def cq(self) -> CommandQueueClient:
        return CommandQueueClient(self.api, timeout=5.0)

    @functools.cached_property
    def pki(self) -> PkiClient:
        return PkiClient(self.api)

    @functools.cached_property
    def secrets(self) -> SecretsClient:
        return SecretsClient(self.api)

    def machine(self, key: int | str) -> SimMachine:
        """By index, product UUID, name, or the node id it was enrolled as."""
        if isinstance(key, str) and key.startswith("node_"):
            key = next(i for i, n in self.nodes.items() if n == key)
        return self.sim.machine(key)

    async def enroll(self, index: int, *, labels: Mapping[str, str] | None = None) -> NodeView:
        """Enroll machine ``index``: its MACs, and its BMC with the credential stored first as the
        node's standing secret (what ``bcx nodes enroll --bmc redfish://…`` does)."""
        m = self.sim.machine(index)
        node_id = new_id("node")
        credential = json.dumps(self.sim.emulator.credentials).encode()
        info = await self.secrets.put_for_node(credential, tenant_id="root", node_id=node_id, label="bmc")
        bmc = NodeBmc(driver="redfish", address=m.bmc_url, credentials_ref=info.ref, system_id=m.uuid)
        node = await self.engine.enroll_node(
            site_id=self.site_id, id=node_id, macs=list(m.macs), bmc=bmc, labels=dict(labels or {})
        )
        self.nodes[index] = node.id
        return node

    def vm(self, index: int) -> LabVm:
        assert self.lab is not None, "fleet_stack(vms=N) starts the VMs"
        return self.lab.vms[index]

    async def enroll_vm(self, index: int, *, labels: Mapping[str, str] | None = None) -> NodeView:
        """Enroll VM ``index`` with its MAC and its BMC (Redfish: the emulator and the VM's
        system id; IPMI: its pyghmi BMC), the credential stored first as the node's secret."""
        v = self.vm(index)
        assert self.lab is not None
        node_id = new_id("node")
        credential = json.dumps(self.lab.credentials(index)).encode()
        info = await self.secrets.put_for_node(credential, tenant_id="root", node_id=node_id, label="bmc")
        system_id = v.uuid if v.bmc_protocol == "redfish" else None
        bmc = NodeBmc(
            driver=v.bmc_protocol, address=v.bmc_address, credentials_ref=info.ref, system_id=system_id
        )
        node = await self.engine.enroll_node(
            site_id=self.site_id, id=node_id, macs=list(v.macs), bmc=bmc, labels={"vm": "1", **(labels or {})}
        )
        self.vm_nodes[index] = node.id
        return node

    async def verb(self, verb: Any, index: int, **kw: Any) -> VerbRun:
        """Run a lifecycle verb on machine ``index``'s node (``deploy`` takes ``image``, ``profile``)."""
        run: VerbRun = await self.engine.run_verb(verb, node_id=self.nodes[index], **kw)
        return run

    async def reaches(self, index: int, *states: str, timeout: float = 120.0) -> NodeView:
        """Wait until the node is in one of ``states``; a ``failed`` node not asked for is an
        ``AssertionError`` naming its reason."""
        return await self.node_reaches(self.nodes[index], *states, timeout=timeout, what=f"machine {index}")

    async def node_reaches(
        self, node_id: str, *states: str, timeout: float = 120.0, what: str = "node"
    ) -> NodeView:
        """``reaches`` for any node (a VM's: ``stack.vm_nodes[i]``)."""

        async def look() -> Any:  # the node, or None while it is not there yet
            node = await self.engine.get_node(id=node_id)
            if node.state == "failed" and "failed" not in states:
                raise AssertionError(f"{what} ({node.id}) failed: {node.state_reason}")
            return node if node.state in states else None

        node: NodeView = await until(look, timeout=timeout, what=f"{what} in {states}")
        return node

    def log_files(self) -> list[Path]:
        """Every log the system wrote: services, site agent, emulator, each machine's bcd."""
        found = [p.log for p in self.processes.procs] + list(self.agent.logs)
        found += sorted((self.folder / "sim").rglob("*.log"))
        found += sorted((self.folder / "vms").rglob("*.log"))
        return found

    def tails(self, lines: int = 40) -> str:
        """The last lines of each process's log: what a failing test prints."""
        out = []
        for path in self.log_files():
            with contextlib.suppress(OSError):
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {path.relative_to(self.folder.parent)} ---\n" + "\n".join(tail))
        return "\n".join(out)


def _folders(folder: Path) -> Path:
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    return folder / "logs"


@contextlib.asynccontextmanager
async def fleet_stack(
    folder: Path,
    settings: Settings,
    *,
    machines: int = 4,
    enroll: int | None = None,
    site_id: str = "lab1",
    seed: int = 0,
    power_delay: tuple[float, float] = (0.0, 0.0),
    faults: Mapping[int, Faults] | None = None,
    processes: ServiceProcesses | None = None,
    api: ApiClient | None = None,
    env: Mapping[str, str] | None = None,
    app: str = APP,
    vms: int = 0,
    vm_bmc: Literal["redfish", "ipmi"] = "redfish",
    enroll_vms: bool = True,
    vm_disk_bytes: int = 2 << 30,
    quiet_seconds: float = 0.5,
    lean: bool | None = None,
) -> AsyncIterator[FleetStack]:
    """Start the fleet and everything around it; stop all of it on the way out.

    ``settings`` point at NATS and PostgreSQL (the test's, or ``bcx dev``'s); the services load
    ``APP``. ``enroll`` machines (all by default) are enrolled in index order; the rest are
    powered-off machines nobody enrolled. ``power_delay`` is the BMC's (0: it answers at once;
    sushy-tools' own is 1-11 s). Pass the test's ``processes`` and ``api`` to share them;
    otherwise they are made here (logs under ``folder/logs``).

    ``vms`` QEMU VMs (``better_compute.testing.vmlab``) start next to the simulated machines,
    behind ``vm_bmc`` BMCs, and are enrolled (``enroll_vms``) like them; the site agent then
    serves its scripts and cache at 10.0.2.2 (what the guests reach), so the engine's app
    (``app``) must boot a ramdisk they can run (``better_compute.testing.vmlab.app``).
    ``quiet_seconds`` is the site agent's ``netboot.quiet_seconds``. ``lean``: every bcd a task of
    one process (``MetalSim(lean=)``; ``BC_SIM_LEAN=1`` by default).
    """
    logs = _folders(folder)
    settings = msgspec.structs.replace(settings, app=app)
    own_processes = processes is None
    if processes is None:
        processes = ServiceProcesses(settings, logs)
    processes.settings = settings
    own_nc = None
    if api is None:
        own_nc = await connect(settings.nats_url or "", name="bc-fleet")
        api = ApiClient(own_nc, Subjects(settings.subject_root))
    media = MediaServer(folder / "media")
    processes.extra_env.update(
        {**FAST_ENV, "BC_SIM_MEDIA_DIR": str(media.folder), "BC_SIM_MEDIA_URL": media.url, **(env or {})}
    )
    sim = MetalSim(
        folder / "sim", settings=settings, machines=machines, site_id=site_id, seed=seed,
        power_delay=power_delay, faults=faults, lean=lean,
    )  # fmt: skip
    agent = SiteAgentProcess(
        folder=folder / "site-agent", nats_url=settings.nats_url or "", subject_root=settings.subject_root,
        site_id=site_id, quiet_seconds=quiet_seconds,
    )  # fmt: skip
    sim.boot_url = agent.url
    from ..vmlab import VmLab, guest_url

    lab = (
        VmLab(folder / "vms", vms=vms, boot_url=agent.url, bmc=vm_bmc, seed=seed, disk_bytes=vm_disk_bytes)
        if vms
        else None
    )
    if lab is not None:
        agent.public_url = guest_url(agent.url)
        agent.media_url = agent.url  # the BMC emulators fetch token media from this host
    stack = FleetStack(
        folder=folder, settings=settings, api=api, processes=processes, sim=sim, agent=agent, media=media,
        lab=lab,
    )  # fmt: skip
    try:
        for service in SERVICES:
            processes.start(service)
        await asyncio.gather(
            processes.wait_ready(timeout=180),
            asyncio.to_thread(sim.start),
            *([asyncio.to_thread(lab.start)] if lab is not None else []),
        )
        await agent.join(api)
        await register_sim_image(stack.engine)  # what the tests and the demo deploy
        for index in range(machines if enroll is None else enroll):
            await stack.enroll(index)
        for index in range(vms if enroll_vms else 0):
            await stack.enroll_vm(index)
        yield stack
    finally:
        agent.close()
        if lab is not None:
            await asyncio.to_thread(lab.close)
        await asyncio.to_thread(sim.close)
        media.close()
        if own_processes:
            processes.close()
        if own_nc is not None:
            await own_nc.close()
