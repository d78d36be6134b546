"""What one simulated machine's bcd holds in a lean host, part by part (issue 25 item 3).

    uv run --group bench python bench/bench_lean_memory.py --machines 300

One process, as ``bcd.lean`` is one: N agent journals (``better_compute.agent.Journal``, two
SQLite connections and a writer), then N NATS connections as bcd makes them (its own name and
inbox prefix, one request each, a subscription as the agent's pull consumer has), against an
embedded nats-server (plain, as bench_fleet's: no TLS is asked for). ``--thread-per-journal``
and ``--eager-tls`` put back what each machine held before issue 25 item 3 (a writer thread per
journal, a TLS context per connection made at once). After each part it prints this process's
RSS and PSS, its threads, and nats-server's RSS, as the difference per machine;
``--tracemalloc`` adds the top Python allocations (file:line) of the whole. The full picture,
with the product, is ``bench_fleet.py --lean`` (its memory per kind of process).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import tempfile
import threading
import tracemalloc
from pathlib import Path
from typing import Any


def _status(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def _pss(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return 0.0


def enrollment(i: int) -> Any:
    """An agent's enrollment with a self-signed certificate (the server never reads it)."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.x509.oid import NameOID

    from better_compute.agent import Enrollment
    from better_compute.crypto import new_agent_key

    key = new_agent_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"node-{i}")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now)
        .not_valid_after(now + dt.timedelta(days=1)).sign(key, None)
    )  # fmt: skip
    return Enrollment(
        agent_id=f"node-{i}", cert_id=f"cert-{i}", site_id="s", tenant_id="root", role="node",
        certificate_pem=cert.public_bytes(serialization.Encoding.PEM).decode(), private_key=key,
    )  # fmt: skip


class Meter:
    def __init__(self, n: int, server_pid: int | None) -> None:
        self.n = n
        self.server_pid = server_pid
        self.last = self.now()

    def now(self) -> tuple[float, float, float]:
        gc.collect()
        me = os.getpid()
        server = _status(self.server_pid, "VmRSS") if self.server_pid else 0.0
        return _status(me, "VmRSS"), _pss(me), server

    def step(self, what: str) -> None:
        now = self.now()
        rss, pss, server = (b - a for a, b in zip(self.last, now, strict=True))
        self.last = now
        print(
            f"{what:<44} RSS {now[0]:7.1f} MiB (+{rss * 1024 / self.n:6.1f} KiB/machine)"
            f"  PSS +{pss * 1024 / self.n:6.1f} KiB/machine  threads {threading.active_count():4d}"
            f"  nats-server RSS {now[2]:6.1f} MiB (+{server * 1024 / self.n:5.1f} KiB/connection)",
            flush=True,
        )


async def main(args: argparse.Namespace) -> None:
    from better_compute.agent import journal as journal_module
    from better_compute.agent.bus import agent_options
    from better_compute.agent.journal import Journal
    from better_compute.runtime.embedded import EmbeddedNats
    from better_compute.service.client import connect

    folder = Path(tempfile.mkdtemp(prefix="bc-lean-mem-"))
    nats = EmbeddedNats(folder / "servers")
    url = nats.start()
    try:
        if args.tracemalloc:
            tracemalloc.start(1)
        meter = Meter(args.machines, nats.running_pid())
        meter.step("start")
        if args.thread_per_journal:  # as before the journals shared their writers
            journal_module.WRITER_THREADS = args.machines + 1  # type: ignore[misc]
        journals = [Journal(folder / f"m{i:05d}" / "journal.db") for i in range(args.machines)]
        meter.step("journals opened")
        for j in journals:  # what a command does to it: started, finished, reported
            await j.started(f"c-{j.id}", kind="node.inventory", not_after=4e9)
            await j.finished(f"c-{j.id}", status="succeeded", reason=None, result=b"{}", signature=b"s")
            await j.reported(f"c-{j.id}")
            j.get(f"c-{j.id}")
        meter.step("journals written and read")
        conns = []
        for i in range(args.machines):
            # as bcd's: its TLS context (its certificate, the system's CAs: no BC_NATS_CA here)
            options = agent_options(enrollment(i), ca=None)
            if args.eager_tls:  # as before the context was made when a server asks for TLS
                options["tls"].context()
            nc = await connect(url, name=f"bcd:node-{i}", **options)
            conns.append(nc)
        meter.step("NATS connections open (agent options)")

        async def echo(msg: Any) -> None:
            await msg.respond(b"ok")

        for i, nc in enumerate(conns):
            await nc.subscribe(f"bench.sub.{i}")
            await nc.subscribe(f"bench.echo.{i}", cb=echo)
        for i, nc in enumerate(conns):
            await nc.request(f"bench.echo.{i}", b"hello", timeout=10)
        meter.step("each a subscription and a request")
        if args.tracemalloc:
            for stat in tracemalloc.take_snapshot().statistics("lineno")[: args.top]:
                print(f"  {stat.size / 1024:9.1f} KiB {stat.count:7d} blocks  {stat.traceback}")
        for nc in conns:
            await nc.close()
        for j in journals:
            j.close()
        meter.step("closed")
    finally:
        nats.stop()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--machines", type=int, default=300)
    p.add_argument("--tracemalloc", action="store_true")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--thread-per-journal", action="store_true", help="as before: a writer thread each")
    p.add_argument("--eager-tls", action="store_true", help="as before: each TLS context made at once")
    asyncio.run(main(p.parse_args()))
