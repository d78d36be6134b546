"""What one statement costs over TCP on 127.0.0.1 against PostgreSQL's Unix socket.

    uv run python bench/bench_db_socket.py [--statements 20000] [--concurrency 8]

Starts an embedded PostgreSQL (fsync on, as the services run it) in a temporary folder and runs
the same statements through asyncpg pools, once connected to ``127.0.0.1:<port>`` and once to
the socket in the server's socket folder: a one-row read by primary key and a one-row update, as
the engine and the command queue send them by the hundred per machine. Prints, per statement,
the CPU of this client process and of the PostgreSQL processes (user + system, from /proc) and
the wall time. On the fleet benchmark the services spend a third or more of their samples in
socket writes (py-spy): on a VM a TCP send on the loopback runs the whole TCP path for both ends.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

import asyncpg

from better_compute.runtime.embedded import EmbeddedPostgres

TICK = os.sysconf("SC_CLK_TCK")


def _cpu_of(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / TICK
    return total


def _postgres_pids() -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == "postgres":
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


async def _run(dsn: str, statements: int, concurrency: int) -> tuple[float, float, float]:
    pool = await asyncpg.create_pool(dsn, min_size=concurrency, max_size=concurrency)
    assert pool is not None
    async with pool.acquire() as conn:
        await conn.execute("DROP TABLE IF EXISTS bench_sock")
        await conn.execute("CREATE TABLE bench_sock (id int PRIMARY KEY, n bigint NOT NULL)")
        await conn.execute("INSERT INTO bench_sock SELECT g, 0 FROM generate_series(0, 999) g")

    async def worker(w: int) -> None:
        for i in range(w, statements, concurrency):
            if i % 2:
                await pool.fetchrow("SELECT id, n FROM bench_sock WHERE id = $1", i % 1000)
            else:
                await pool.execute("UPDATE bench_sock SET n = n + 1 WHERE id = $1", i % 1000)

    pg = _postgres_pids()
    own0, pg0, wall0 = time.process_time(), _cpu_of(pg), time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    own, server, wall = time.process_time() - own0, _cpu_of(pg) - pg0, time.perf_counter() - wall0
    await pool.close()
    return own, server, wall


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--statements", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="each transport this many times, alternating")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bc-bench-sock-") as tmp:
        pg = EmbeddedPostgres(Path(tmp))
        tcp = pg.start()
        try:
            sock = pg.socket_url()
            if sock is None:
                raise SystemExit("the socket path is too long for this folder")
            results: dict[str, list[tuple[float, float, float]]] = {"tcp 127.0.0.1": [], "unix socket": []}
            for _ in range(args.rounds):
                for name, dsn in (("tcp 127.0.0.1", tcp), ("unix socket", sock)):
                    results[name].append(await _run(dsn, args.statements, args.concurrency))
        finally:
            pg.stop()
    n = args.statements
    print(f"{n} statements a run (half reads by key, half updates), {args.concurrency} connections")
    print(f"{'transport':<15} {'client µs':>10} {'postgres µs':>12} {'both µs':>9} {'wall µs':>9}")
    for name, runs in results.items():
        own = min(r[0] for r in runs) / n * 1e6
        server = min(r[1] for r in runs) / n * 1e6
        wall = min(r[2] for r in runs) / n * 1e6
        print(f"{name:<15} {own:>10.1f} {server:>12.1f} {own + server:>9.1f} {wall:>9.1f}")


if __name__ == "__main__":
    asyncio.run(main())
