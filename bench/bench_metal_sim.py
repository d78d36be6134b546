"""The simulator's BMC side alone: can one sushy-emulator hold a fleet?

    uv run python bench/bench_metal_sim.py --machines 1000 --concurrency 16

Starts ``MetalSim`` with N machines (no site agent, so a power-on boots nothing: the ledger says
``boot.network`` none), then powers every machine on through Redfish (``ComputerSystem.Reset``
from ``--concurrency`` threads, as many site agents would) with BMCs that answer at once
(``--delay 0``) or late (``--delay 1,11``: sushy's own), and waits until the ledger shows every
power-on landed (seen through the emulator's notifier). Prints the start time, the time from the
first request to the last landing, requests per second, and the emulator's CPU seconds.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from better_compute.config import Settings
from better_compute.testing.metal_sim import MetalSim, SimMachine

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def power_on(sim: MetalSim, m: SimMachine) -> None:
    req = urllib.request.Request(
        f"{sim.emulator.url}/redfish/v1/Systems/{m.uuid}/Actions/ComputerSystem.Reset",
        data=json.dumps({"ResetType": "On"}).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    auth = base64.b64encode(f"{sim.emulator.username}:{sim.emulator.password}".encode()).decode()
    req.add_header("Authorization", f"Basic {auth}")
    with urllib.request.urlopen(req, timeout=60) as resp:
        resp.read()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--machines", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--delay", default="0", help="seconds before a power change lands: S or LO,HI")
    args = ap.parse_args()
    lo, _, hi = args.delay.partition(",")
    delay = (float(lo), float(hi or lo))
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        sim = MetalSim(
            Path(tmp), settings=Settings(nats_url="nats://127.0.0.1:9", subject_root="bench"),
            machines=args.machines, power_delay=delay,
        )  # fmt: skip
        t1 = time.monotonic()
        sim.start()
        t2 = time.monotonic()
        assert sim.emulator.proc is not None
        cpu0 = cpu_seconds(sim.emulator.proc.pid)
        try:
            with ThreadPoolExecutor(args.concurrency) as pool:
                list(pool.map(lambda m: power_on(sim, m), sim.machines))
            t3 = time.monotonic()
            while sum(m.power == "On" for m in sim.machines) < args.machines:  # what the notifier saw
                time.sleep(0.1)
            assert sum(m.ledger.count("power", to="On") for m in sim.machines) == args.machines
            t4 = time.monotonic()
            cpu = cpu_seconds(sim.emulator.proc.pid) - cpu0
        except BaseException:
            print("--- emulator ---", sim.emulator.output()[-4000:], sep="\n")
            raise
        finally:
            sim.close()
    print(f"machines {args.machines}, BMC delay {delay[0]}-{delay[1]} s, {args.concurrency} in flight")
    print(f"trees prepared in {t1 - t0:.2f} s, emulator up in {t2 - t1:.2f} s")
    print(f"power-on requests: {t3 - t2:.2f} s ({args.machines / (t3 - t2):.0f}/s)")
    print(f"first request to last power-on landed: {t4 - t2:.2f} s")
    print(f"emulator CPU: {cpu:.2f} s")


if __name__ == "__main__":
    main()
