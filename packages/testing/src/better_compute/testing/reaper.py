"""``python -m better_compute.testing.reaper CMD …``: run a test command so that every process it
starts dies with it.

Tests start service processes, embedded nats-server and PostgreSQL (detached: their own
session, or daemonised by ``pg_ctl``), simulated machines and QEMU VMs. When the test run ends
badly (a worker killed by a timeout, pytest SIGKILLed, an INTERNALERROR) those would outlive it.
The reaper makes itself the *child subreaper* of the command (``PR_SET_CHILD_SUBREAPER``): every
process the command starts, however detached, is re-parented to the reaper when its own parent
dies, not to init. The reaper reaps them as they end during the run, and when the command ends
it stops what is left (SIGTERM, then SIGKILL after ``--grace`` seconds), names each one on
stderr, and exits with the command's own code. SIGINT and SIGTERM sent to the reaper go to the
command first.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import sys
import time
from pathlib import Path

__all__ = ["children", "main"]

PR_SET_CHILD_SUBREAPER = 36


def _set_subreaper() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)


def children(parent: int) -> dict[int, str]:
    """The live processes whose parent is ``parent``, with their command names."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid …: comm may hold spaces and parentheses, so split after the last ')'
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == parent and fields[0] != "Z":
            found[int(entry.name)] = comm
    return found


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _stop_leftovers(grace: float) -> int:
    """SIGTERM every process left (each generation as it is re-parented to us), SIGKILL after
    ``grace`` seconds; returns how many there were."""
    me = os.getpid()
    seen: set[int] = set()
    # A moment for what ends by itself when pytest ends: the test kit's guard (testing.guard)
    # reads the end of its pipe and exits, and is no leftover.
    settle = time.monotonic() + 1.0
    while children(me) and time.monotonic() < settle:
        _reap()
        time.sleep(0.05)
    deadline = time.monotonic() + grace
    while True:
        _reap()
        left = children(me)
        if not left:
            return len(seen)
        hard = time.monotonic() > deadline
        for pid, comm in left.items():
            if pid not in seen:
                seen.add(pid)
                print(f"reaper: {comm} (pid {pid}) outlived the test run; stopping it", file=sys.stderr)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL if hard else signal.SIGTERM)
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m better_compute.testing.reaper")
    parser.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    if not _set_subreaper():
        print("reaper: PR_SET_CHILD_SUBREAPER refused; detached processes may outlive it", file=sys.stderr)
    child = os.fork()
    if child == 0:  # pragma: no cover - replaced by exec
        try:
            os.execvp(command[0], command)
        finally:
            os._exit(127)

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    code: int | None = None
    while code is None:
        try:
            pid, status = os.wait()
        except InterruptedError:
            continue
        except ChildProcessError:
            code = 1
            break
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
    stopped = _stop_leftovers(args.grace)
    if stopped:
        print(f"reaper: stopped {stopped} process(es) the test run left behind", file=sys.stderr)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
