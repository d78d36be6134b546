"""A fork server for the simulated machines' bcd processes.

Each boot of a simulated machine runs ``bcd join`` then ``bcd run``: two Python start-ups that
import the agent SDK, nats, cryptography… (2.3 s of CPU each, and 40 s of wall time each when
four machines boot at once on the loaded 2-core test machine). The fork server imports bcd once
and forks a child per command: every bcd is still its own OS process (its own pid, killable with
SIGKILL, its own environment, log file and exit code) running ``bcd.__main__.main`` with the
given arguments, the very code ``python -m bcd`` runs, without the start-up.

Protocol on the server's stdin/stdout, one JSON document a line:
``{"id": n, "argv": [...], "env": {...}, "log": path}`` → ``{"id": n, "pid": pid}``, and
``{"exit": pid, "code": code}`` when a child ends (a negative code: killed by that signal).
The server is bcd's own (``python -m bcd.forkserver``: the SDK imports no service); it forks
only from its one thread. ``MetalSim(fork_server=False)`` runs ``python -m bcd`` instead.
"""

from __future__ import annotations

import contextlib

from ..zygote import Zygote, ZygoteProc

__all__ = ["BcdZygote", "LeanBcdHost", "ZygoteProc"]


class BcdZygote(Zygote):
    """The simulator's side: starts bcd's fork server, forks bcds through it."""

    COMMAND = ("-m", "bcd.forkserver")
    NAME = "bcd fork server"


class LeanBcdHost(BcdZygote):
    """The lean simulation's host (``python -m bcd.lean``): every bcd it starts is an asyncio task
    of that one process, not a process of its own (same protocol; its pids are the host's
    numbers, and a signal goes through the host: SIGKILL cuts the machine's NATS connection with
    no goodbye). ``MetalSim(lean=True)``; docs/metal-sim.md, "Lean"."""

    COMMAND = ("-m", "bcd.lean")

    def signal(self, pid: int, sig: int) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._send({"signal": pid, "sig": int(sig)})
