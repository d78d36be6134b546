"""``bcd --simulate``: bcd on a simulated machine (``better_compute.testing.metal_sim``).

Everything bcd does still runs through its real code paths (join, inventory, wipe, image
write, converger) under ``--root``; simulation only changes what stands for the hardware:

* programs (``sysctl``, ``modprobe``, ``systemctl``…) are recorded, never run on the host
  (``SimRunner``; it appends each argv to ``<root>/var/log/bcd-sim-commands.jsonl``);
* every open of a disk (``<root>/dev/<disk>``) for writing is seen below bcd's code, by a
  Python audit hook, and appended to the machine's ledger (``BCD_SIM_LEDGER``) with the
  command that was running; a disk named in the faults file (``BCD_SIM_FAULTS``,
  ``{"failWrites": ["vdb"]}``, re-read on every open) fails that open with ``EIO``.

The ledger is a JSON line per event, appended with ``O_APPEND`` so the simulator and bcd can
both write it; a test counts destructive operations there, not in bcd's own logs.
"""

from __future__ import annotations

import contextvars
import errno
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from better_compute.agent import Command, CommandHandler

from .system import Machine, RunResult

__all__ = ["SimRunner", "install_disk_hook", "tagged"]

_RUNNING: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "bcd_sim_command", default=None
)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_TRUNC | os.O_CREAT


def append_line(path: str, doc: Mapping[str, Any]) -> None:
    """One JSON line, appended in a single write (several processes share the file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(doc, sort_keys=True) + "\n").encode())
    finally:
        os.close(fd)


class SimRunner:
    """Programs of a simulated machine: none exists unless listed; each run is recorded and
    succeeds."""

    def __init__(self, root: Path, programs: Sequence[str] = ()) -> None:
        self.programs = set(programs)
        self.log = root / "var/log/bcd-sim-commands.jsonl"

    def which(self, program: str) -> str | None:
        return f"/usr/bin/{program}" if program in self.programs else None

    def run(self, argv: Sequence[str], *, input: bytes | None = None, timeout: float = 600.0) -> RunResult:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        append_line(str(self.log), {"argv": list(argv), "t": time.time()})
        return RunResult(returncode=0)


def tagged(handlers: Mapping[str, CommandHandler]) -> dict[str, CommandHandler]:
    """The handlers, each running with its command's kind and id where the disk hook sees them
    (``asyncio.to_thread`` carries context variables into the worker thread)."""

    def wrap(handler: CommandHandler) -> CommandHandler:
        async def run(cmd: Command) -> Any:
            token = _RUNNING.set((cmd.kind, cmd.id))
            try:
                return await handler(cmd)
            finally:
                _RUNNING.reset(token)

        return run

    return {kind: wrap(handler) for kind, handler in handlers.items()}


_DISKS: dict[str, tuple[str | None, str | None]] = {}
"""Each simulated machine's disk folder (``<root>/dev/``) -> its ledger and faults file: the
lean host (``bcd.lean``) serves many machines in one process, and an audit hook, once added,
stays for the process's life, so there is one hook and it finds the machine by the path."""


def install_disk_hook(machine: Machine, *, ledger: str | None, faults: str | None) -> None:
    """Count (and fail, when told) every open of one of the machine's disks for writing."""
    if not _DISKS:
        sys.addaudithook(_disk_hook)
    _DISKS[str(machine.path("/dev")) + os.sep] = (ledger, faults)


def _fail_writes(faults: str | None) -> set[str]:
    if not faults:
        return set()
    try:
        with open(faults, encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, ValueError):
        return set()
    names = doc.get("failWrites") if isinstance(doc, dict) else None
    return {str(n) for n in names} if isinstance(names, list) else set()


def _disk_hook(event: str, args: tuple[Any, ...]) -> None:
    if event != "open" or not isinstance(args[0], str):
        return
    dev, _, disk = args[0].rpartition(os.sep)
    found = _DISKS.get(dev + os.sep)
    if found is None:
        return
    ledger, faults = found
    mode, flags = args[1], args[2]
    writes = (flags & _WRITE_FLAGS) if isinstance(flags, int) else 0
    if isinstance(mode, str):
        writes = writes or any(c in mode for c in "wa+x")
    if not writes:
        return
    running = _RUNNING.get()
    failed = disk in _fail_writes(faults)
    if ledger:
        append_line(
            ledger,
            {
                "t": time.time(),
                "event": "disk.write",
                "disk": disk,
                "kind": running[0] if running else None,
                "commandId": running[1] if running else None,
                "failed": failed,
                "pid": os.getpid(),
            },
        )
    if failed:
        raise OSError(errno.EIO, f"Input/output error (simulated failing disk {disk})", args[0])
