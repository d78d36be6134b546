"""The site agent's Redfish driver alone: CPU and HTTP requests per BMC command.

    uv run python bench/bench_redfish_driver.py --rounds 20

Starts one ``sushy-emulator`` (fake driver, Basic auth, one system; a power change lands within
the second it was asked in, as the fleet benchmark's BMCs that "answer at once") and drives the
site agent's own driver code against it as ``SiteHandlers`` does: per command a driver from
``make_driver`` with the command's credentials, the operation, ``close``. One round is the BMC
commands of a deploy and then some: power on, boot device pxe, media insert (cd), media eject,
power cycle, power off, inventory. Prints, per command kind, the CPU milliseconds of this process
(the driver, sushy, requests and the event loop: the emulator is another process) and the HTTP
requests by method, as medians over the rounds, and the load average before and after.

``--no-system-id`` leaves ``bmc.systemId`` out (the driver then lists the systems).
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import os
import statistics
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import requests.adapters

from bc_site_agent.drivers import BmcCredentials, Driver, make_driver
from better_compute.testing.bmcs import SYSTEM_UUID, RedfishEmulator
from better_compute.wire.commands import MediaEject, MediaInsert, SetBootDevice, SetPower
from better_compute.wire.metal import NodeBmc

_SENT: Counter[str] = Counter()
_send = requests.adapters.HTTPAdapter.send


def _counting_send(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    _SENT[request.method] += 1
    return _send(self, request, *args, **kwargs)


requests.adapters.HTTPAdapter.send = _counting_send  # type: ignore[method-assign]


def _serve_image() -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            data = b"iso" * 100
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


async def run(args: argparse.Namespace, emu: RedfishEmulator, image_url: str) -> None:
    target = NodeBmc(driver="redfish", address=emu.url, system_id=None if args.no_system_id else SYSTEM_UUID)
    cpu: dict[str, list[float]] = defaultdict(list)
    sent: dict[str, list[Counter[str]]] = defaultdict(list)

    async def command(kind: str, op: Callable[[Driver], Awaitable[Any]]) -> None:
        _SENT.clear()
        t0 = time.process_time()
        driver = make_driver(target, BmcCredentials(username=emu.username, password=emu.password))
        try:
            await op(driver)
        finally:
            await driver.close()
        cpu[kind].append((time.process_time() - t0) * 1000)
        sent[kind].append(Counter(_SENT))

    def deadline() -> float:
        return time.time() + 60

    insert = MediaInsert(url=image_url, device="cd")
    for _ in range(args.rounds + 1):  # the first round warms up (imports, the first connection)
        await command("power on", lambda d: d.set_power(SetPower(action="on"), deadline=deadline()))
        await command(
            "setBootDevice pxe",
            lambda d: d.set_boot_device(SetBootDevice(device="pxe", persistent=False), deadline=deadline()),
        )
        await command("media insert", lambda d: d.media_insert(insert, deadline=deadline()))
        await command("media eject", lambda d: d.media_eject(MediaEject(device="cd"), deadline=deadline()))
        await command("power cycle", lambda d: d.set_power(SetPower(action="cycle"), deadline=deadline()))
        await command("power off", lambda d: d.set_power(SetPower(action="off"), deadline=deadline()))
        await command("inventory", lambda d: d.inventory(deadline=deadline()))
    print(f"{'command':<20} {'CPU ms (median)':>16} {'min':>6} {'max':>6}  requests (median by method)")
    total_cpu = 0.0
    total_req = 0.0
    for kind, values in cpu.items():
        values = values[1:]
        methods = sorted({m for c in sent[kind][1:] for m in c})
        med = {m: statistics.median(c[m] for c in sent[kind][1:]) for m in methods}
        total_cpu += statistics.median(values)
        total_req += sum(med.values())
        shown = ", ".join(f"{m} {v:g}" for m, v in med.items())
        print(
            f"{kind:<20} {statistics.median(values):>16.1f} {min(values):>6.1f} {max(values):>6.1f}  {shown}"
        )
    print(f"{'round':<20} {total_cpu:>16.1f} {'':>6} {'':>6}  {total_req:g} requests")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--no-system-id", action="store_true")
    args = ap.parse_args()
    import bc_site_agent.drivers

    print(f"driver code: {Path(bc_site_agent.drivers.__file__).parent}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as tmp:
        emu = RedfishEmulator(Path(tmp), power_lag=(0, 0)).start()
        server = _serve_image()
        try:
            url = f"http://127.0.0.1:{server.server_port}/bench.iso"
            asyncio.run(run(args, emu, url))
        finally:
            server.shutdown()
            emu.close()
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
