"""``python -m bcd.lean``: many simulated machines' bcds in one process, for scale.

The metal simulator (``better_compute.testing.metal_sim``) boots a bcd per simulated machine. Its
fork server (``bcd.forkserver``) makes each an OS process of its own, as on a real machine: about
12 MiB and a Python runtime each, so a thousand machines are a thousand processes and the
simulation, not the product, is what a fleet benchmark measures. This host runs each machine's bcd
as one asyncio task of one process instead: the same code (``bcd.__main__.run``, the command
``python -m bcd`` would run), each machine with its own root, identity and key (its state folder
under its root), journal, disk file and ledger, its own NATS connection, so the control plane sees
the same joins, agents, commands, results and signatures as from the processes.

Protocol on stdin/stdout, one JSON document a line, the fork server's:
``{"id": n, "argv": [...], "env": {...}, "log": path}`` -> ``{"id": n, "pid": vpid}`` (a number of
this host's, never an OS pid), ``{"exit": vpid, "code": code}`` when a machine's command ends, and
``{"signal": vpid, "sig": n}`` from the simulator: SIGKILL is a pulled plug (its NATS connection cut
without a goodbye, the task cancelled, exit code -9), any other signal stops it as SIGTERM would.
When stdin closes every machine is stopped and the host exits.

What the machines share, as one process: the environment's ``BC_NATS_URL``, ``BC_NATS_CA``,
``BC_NATS_JOIN_CERT``/``_KEY`` (read where bcd connects; a command asking for other values than
the first one's fails with exit code 2), one log (``--log``, each line bound to its machine's
root), one thread pool for the disk work, and one kill point configuration. No per-machine
``BCD_LOG_LEVEL``: ``--log-level`` (warning by default) is the host's. For simulation only.
"""

from __future__ import annotations

import argparse
import asyncio
import asyncio.sslproto
import contextlib
import json
import os
import signal
import sys
from typing import Any

SHARED_ENV = ("BC_NATS_URL", "BC_NATS_CA", "BC_NATS_JOIN_CERT", "BC_NATS_JOIN_KEY")
FIRST_VPID = 10_000_000
"""Above any pid the kernel hands out (pid_max is at most 4,194,304)."""
JOINS_AT_ONCE = 8
"""Joins in flight in one host: a hundred at once in one event loop starve each other."""
TLS_READ_BUFFER = 32 * 1024
"""Bytes a machine's TLS connection reads from its socket at once (asyncio's: 256 KiB)."""
JOIN_TRIES = 5
"""A join is one try of bc-pki (its NATS connection must answer within seconds); one event loop
holding a hundred machines on a loaded machine answered some too late (``UNAVAILABLE``), and a
ramdisk whose join failed sits unjoined. The host tries a join whose NATS connection never opened
again, with a pause, as a ramdisk's init would; nothing else (the token may have reached bc-pki)."""


class _Machine:
    def __init__(self, vpid: int) -> None:
        self.vpid = vpid
        self.stop = asyncio.Event()
        self.nc: Any = None
        self.task: asyncio.Task[int] | None = None
        self.killed = False


class LeanHost:
    """The host's side: machines by vpid, the protocol's writer."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.machines: dict[int, _Machine] = {}
        self.shared: dict[str, str | None] | None = None
        self.next_vpid = FIRST_VPID
        self.joins = asyncio.Semaphore(JOINS_AT_ONCE)

    def say(self, doc: dict[str, Any]) -> None:
        self.out.write((json.dumps(doc) + "\n").encode())
        self.out.flush()

    def spawn(self, doc: dict[str, Any]) -> None:
        self.next_vpid += 1
        m = _Machine(self.next_vpid)
        self.machines[m.vpid] = m
        m.task = asyncio.get_running_loop().create_task(self._run(m, doc["argv"], doc["env"]))
        m.task.add_done_callback(lambda task: self._ended(m, task))
        self.say({"id": doc["id"], "pid": m.vpid})

    async def _run(self, m: _Machine, argv: list[str], env: dict[str, str]) -> int:
        import structlog

        from bcd.__main__ import run
        from better_compute.core.errors import BcError, ErrorCode

        structlog.contextvars.bind_contextvars(machine=env.get("BCD_ROOT"))  # this task's context
        shared = {key: env.get(key) for key in SHARED_ENV}
        if self.shared is None:
            self.shared = shared
            for key, value in shared.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        elif shared != self.shared:
            differ = sorted(k for k in SHARED_ENV if shared[k] != self.shared[k])
            print(f"bcd.lean: {', '.join(differ)} differ from the host's: not run", file=sys.stderr)
            return 2

        def connected(nc: Any) -> None:
            m.nc = nc

        if "join" not in argv:
            return await run(argv, env, stop=m.stop, signals=False, connected=connected)
        for attempt in range(JOIN_TRIES):
            if attempt:
                await asyncio.sleep(2**attempt)
            try:
                async with self.joins:
                    return await run(argv, env, stop=m.stop, signals=False, raise_errors=True)
            except BcError as err:
                # only a connection that never opened is tried again: its token never reached
                # bc-pki (a second try of a join that did would burn the token)
                unreached = err.code is ErrorCode.UNAVAILABLE and err.message.startswith("cannot reach")
                if not unreached or attempt == JOIN_TRIES - 1:
                    print(f"bcd: error: {err.code.value}: {err.message}", file=sys.stderr)
                    return 1
        return 1

    def _ended(self, m: _Machine, task: asyncio.Task[int]) -> None:
        self.machines.pop(m.vpid, None)
        if m.killed or task.cancelled():
            code = -signal.SIGKILL
        elif task.exception() is not None:
            exc = task.exception()
            print(f"bcd.lean: {m.vpid} failed: {exc!r}", file=sys.stderr)
            code = 1
        else:
            code = task.result()
        if not m.killed:  # a killed machine's exit was said when it was killed
            self.say({"exit": m.vpid, "code": code})

    def signal(self, vpid: int, sig: int) -> None:
        m = self.machines.get(vpid)
        if m is None or m.task is None:
            return
        if sig != signal.SIGKILL:
            m.stop.set()  # as SIGTERM: the agent says goodbye and ends
            return
        m.killed = True
        m.stop.set()
        _cut(m.nc)
        m.task.cancel()
        self.machines.pop(vpid, None)
        self.say({"exit": vpid, "code": -signal.SIGKILL})  # dead now, as a SIGKILLed process is

    async def close(self) -> None:
        tasks = [m.task for m in self.machines.values() if m.task is not None]
        for m in list(self.machines.values()):
            m.killed = True
            m.stop.set()
            _cut(m.nc)
        for task in tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(10):  # not wait_for: it can drop a cancel (3.11)
                await asyncio.gather(*tasks, *_CLOSING, return_exceptions=True)


def _cut(nc: Any) -> set[asyncio.Task[Any]]:
    """Drop a NATS connection as a pulled plug does: no reconnect, nothing more sent; then let
    the client end its own tasks (the closing task, to be awaited at the host's end)."""
    if nc is None:
        return set()
    with contextlib.suppress(Exception):
        nc.options["allow_reconnect"] = False
        nc._transport._io_writer.transport.abort()
    closing = asyncio.get_running_loop().create_task(_close_quietly(nc))
    _CLOSING.add(closing)
    closing.add_done_callback(_CLOSING.discard)
    return _CLOSING


_CLOSING: set[asyncio.Task[Any]] = set()


async def _close_quietly(nc: Any) -> None:
    with contextlib.suppress(Exception):
        async with asyncio.timeout(5):
            await nc.close()


async def _serve(log_level: str) -> None:
    from better_compute.logging import configure_logging
    from better_compute.service import killpoints

    # the protocol has stdout; what bcd prints (a join's summary, errors) goes to the log
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    configure_logging(level=log_level, stream=sys.stderr, json=True)
    killpoints.configure(os.environ.get("BC_KILL_AT"), os.environ.get("BC_KILL_MARKER_DIR"))
    import bcd.__main__  # noqa: F401  (imported once, before the first machine)

    # asyncio gives each TLS connection a 256 KiB read buffer, zeroed when it is made: a
    # thousand machines behind a TLS leaf would hold 250 MiB of it (what is read is the same)
    asyncio.sslproto.SSLProtocol.max_size = TLS_READ_BUFFER

    loop = asyncio.get_running_loop()
    # the machines' inventories, wipes and image writes: Python under one GIL, so a few threads
    # (more only take the event loop's turns, and its NATS connections time out)
    from concurrent.futures import ThreadPoolExecutor

    loop.set_default_executor(ThreadPoolExecutor(max_workers=4, thread_name_prefix="bcd-lean"))
    host = LeanHost(out)
    _memory_reports(loop, host, os.environ.get(MEMORY_REPORT_ENV))
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        doc = json.loads(line)
        if "signal" in doc:
            host.signal(int(doc["signal"]), int(doc["sig"]))
        else:
            host.spawn(doc)
    await host.close()


MEMORY_REPORT_ENV = "BC_SIM_LEAN_MEMORY"
"""A folder: the host traces its Python allocations (``tracemalloc``) and, on each SIGUSR1,
writes ``lean-<pid>-<n>.txt`` there (its machines, tasks, threads, RSS and the top allocations
by file and line), for ``bench_fleet.py --lean --memory-report``. Tracing costs CPU and memory
itself: for measuring only."""


def _memory_reports(loop: asyncio.AbstractEventLoop, host: LeanHost, folder: str | None) -> None:
    if not folder:
        return
    import tracemalloc
    from pathlib import Path

    tracemalloc.start(1)
    written = 0

    def report() -> None:
        nonlocal written
        import gc
        import threading

        gc.collect()
        snapshot = tracemalloc.take_snapshot()
        stats = snapshot.statistics("lineno")
        traced = sum(s.size for s in stats)
        rss = next(
            (int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
             if line.startswith("VmRSS:")),
            0,
        )  # fmt: skip
        n = max(1, len(host.machines))
        lines = [
            f"machines {len(host.machines)} tasks {len(asyncio.all_tasks(loop))}"
            f" threads {threading.active_count()} rss_kib {rss} traced_kib {traced // 1024}"
            f" rss_kib_per_machine {rss / n:.1f} traced_kib_per_machine {traced / 1024 / n:.1f}",
            *(f"{s.size / 1024:10.1f} KiB {s.count:8d} {s.traceback}" for s in stats[:60]),
        ]
        written += 1
        target = Path(folder) / f"lean-{os.getpid()}-{written}.txt"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("\n".join(lines) + "\n")

    loop.add_signal_handler(signal.SIGUSR1, report)


def main() -> None:
    parser = argparse.ArgumentParser(prog="bcd.lean", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args()
    asyncio.run(_serve(args.log_level))


if __name__ == "__main__":
    main()
