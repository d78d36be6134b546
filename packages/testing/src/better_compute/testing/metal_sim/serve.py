"""``python -m better_compute.testing.metal_sim.serve``: the simulated fleet as a process of its
own, for ``bcx sim up`` (docs/metal-sim.md, "bcx sim").

It builds a ``MetalSim`` in ``--folder`` (machines, sushy-emulator, notifier), points the
machines' network boot at ``--boot-url`` (the site agent's HTTP), writes ``machines.json``
(who the machines are and where their BMC answers) once everything is up, and runs until
SIGTERM or SIGINT, when it closes the simulator (every bcd it booted, the emulator).

``--vms N`` starts N QEMU VMs next to the simulated machines (``better_compute.testing.vmlab``),
behind a sushy-emulator of their own with the same credential, network-booting from the same
site agent as the guests reach it (10.0.2.2); ``machines.json`` lists them under ``vms``.

``--power-on I`` (repeatable) switches machine I on with a network boot once the fleet is up:
what a person does to a machine nobody enrolled, so that it shows up by discovery.

The BMC password is read from ``--credentials-file`` (JSON ``{"username", "password"}``), never
from the command line; ``machines.json`` names the file, not the password.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import sys
import threading
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from ...config import load_settings
from ..vmlab import VmLab
from .fleet import MetalSim
from .stack import MediaServer

__all__ = ["main"]

MACHINES_FILE = "machines.json"


def _redfish(sim: MetalSim, method: str, path: str, body: dict[str, Any]) -> None:
    emulator = sim.emulator
    req = urllib.request.Request(
        f"{emulator.url}{path}", data=json.dumps(body).encode(), method=method,
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    auth = base64.b64encode(f"{emulator.username}:{emulator.password}".encode()).decode()
    req.add_header("Authorization", f"Basic {auth}")
    with urllib.request.urlopen(req, timeout=10) as resp:
        resp.read()


def power_on_network(sim: MetalSim, index: int) -> None:
    """Boot machine ``index`` from the network, as its owner would with the power button."""
    m = sim.machine(index)
    system = f"/redfish/v1/Systems/{m.uuid}"
    _redfish(sim, "PATCH", system, {"Boot": {"BootSourceOverrideTarget": "Pxe"}})
    _redfish(sim, "POST", f"{system}/Actions/ComputerSystem.Reset", {"ResetType": "On"})


def describe(sim: MetalSim, credentials_file: str, lab: VmLab | None = None) -> dict[str, Any]:
    host_port = sim.emulator.url.split("://", 1)[1]
    vms = []
    if lab is not None and lab.redfish is not None:
        vm_host_port = lab.redfish.url.split("://", 1)[1]
        vms = [
            {
                "index": v.index, "name": v.spec.name, "uuid": v.uuid, "serial": v.serial,
                "macs": list(v.macs),
                "bmc": f"redfish+http://{vm_host_port}/redfish/v1/Systems/{v.uuid}", "folder": str(v.folder),
                "disk": str(v.disk), "console": str(v.console),
            }
            for v in lab.vms
        ]  # fmt: skip
    return {
        "site": sim.site_id,
        "seed": sim.seed,
        "pid": os.getpid(),
        "bmcUrl": sim.emulator.url,
        "credentialsFile": credentials_file,
        "bootUrl": sim.boot_url,
        "machines": [
            {
                "index": m.index,
                "name": m.name,
                "uuid": m.uuid,
                "serial": m.serial,
                "macs": list(m.macs),
                "bmc": f"redfish+http://{host_port}/redfish/v1/Systems/{m.uuid}",
                "folder": str(m.folder),
            }
            for m in sim.machines
        ],
        "vms": vms,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="metal-sim", description=__doc__)
    p.add_argument("--folder", required=True, type=Path)
    p.add_argument("--site", required=True)
    p.add_argument("--machines", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--power-delay", default="0.2,1.0", help="lo,hi seconds before a power change lands")
    p.add_argument("--boot-url", required=True, help="the site agent's HTTP (iPXE scripts)")
    p.add_argument("--credentials-file", required=True, help='the BMC credential: {"username", "password"}')
    p.add_argument("--vms", type=int, default=0, help="QEMU VMs next to the simulated machines")
    p.add_argument("--power-on", type=int, action="append", default=[], help="machine index, repeatable")
    p.add_argument("--media-dir", type=Path, help="serve this folder (the fleet app's ISOs) at --media-url")
    p.add_argument("--media-url", help="http://127.0.0.1:PORT the engine was told (BC_SIM_MEDIA_URL)")
    p.add_argument("--lean", action="store_true", default=None, help="every bcd a task of one process")
    args = p.parse_args(argv)

    creds = json.loads(Path(args.credentials_file).read_text())
    lo, _, hi = args.power_delay.partition(",")
    settings = load_settings(None)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    sim = MetalSim(
        args.folder, settings=settings, machines=args.machines, site_id=args.site, seed=args.seed,
        power_delay=(float(lo), float(hi or lo)), boot_url=args.boot_url, lean=args.lean,
    )  # fmt: skip
    sim.emulator.username = str(creds["username"])
    sim.emulator.password = str(creds["password"])
    lab: VmLab | None = None
    if args.vms > 0:
        lab = VmLab(args.folder / "vms", vms=args.vms, boot_url=args.boot_url, seed=args.seed)
        assert lab.redfish is not None
        lab.redfish.emulator.username = str(creds["username"])
        lab.redfish.emulator.password = str(creds["password"])
    media: MediaServer | None = None
    try:
        if args.media_dir is not None and args.media_url:  # at the port the engine was told
            media = MediaServer(args.media_dir, port=urllib.parse.urlsplit(args.media_url).port or 80)
        sim.start()
        if lab is not None:
            lab.start()
        for index in args.power_on:
            power_on_network(sim, index)
        out = args.folder / MACHINES_FILE
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(describe(sim, args.credentials_file, lab), indent=2) + "\n")
        tmp.replace(out)
        print(
            f"metal-sim: {len(sim.machines)} machines and {args.vms} VMs of site {args.site} up, "
            f"BMC {sim.emulator.url}",
            flush=True,
        )
        stop.wait()
    finally:
        print("metal-sim: closing", flush=True)
        sim.close()
        if lab is not None:
            lab.close()
        if media is not None:
            media.close()
        (args.folder / MACHINES_FILE).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
