"""The simulated machines: identities, fault knobs and the ledger their hardware keeps.

The ledger is a JSON-lines file per machine. The simulator appends what the BMC saw happen
(power requested and applied, boot device, media inserted and ejected, what booted); the
machine's bcd, in simulation mode, appends every write-open of a disk with the command that
did it (counted below bcd's code, see ``bcd.simulation``). A test counts "ran twice" there.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..bmcs import FaultyProxy
from .gate import TcpGate
from .zygote import ZygoteProc

__all__ = ["FaultFractions", "Faults", "Ledger", "SimMachine", "identity"]


@dataclass(frozen=True)
class Faults:
    """What is wrong with one machine.

    * ``never_boots``: powers on (the BMC says On) but nothing ever runs on it.
    * ``bmc_proxy``: its BMC is reached through a ``FaultyProxy`` the test drives
      (``machine.proxy.set(mode="error-count", left=3)``: 500s then recovery; ``mode="hang"``:
      timeouts).
    * ``power_delay``: ``(lo, hi)`` seconds before a power change lands (slow transitions).
    * ``fail_writes``: disks (``"vda"``) whose every write fails with EIO.
    * ``flaky_link``: its bcd reaches NATS through a ``TcpGate`` (``machine.gate.cut(s)``).
    * ``netboot_asks``: how many times its iPXE asks for its script at each network boot (a NIC
      ROM that retried, a reset in the POST), always from the same address.
    """

    never_boots: bool = False
    bmc_proxy: bool = False
    power_delay: tuple[float, float] | None = None
    fail_writes: tuple[str, ...] = ()
    flaky_link: bool = False
    netboot_asks: int = 1


@dataclass(frozen=True)
class FaultFractions:
    """Fractions of the fleet given each fault, chosen with the simulator's seed."""

    never_boots: float = 0.0
    bmc_proxy: float = 0.0
    slow_power: float = 0.0
    fail_writes: float = 0.0
    flaky_link: float = 0.0
    slow_power_delay: tuple[float, float] = (5.0, 15.0)

    def draw(self, rng: random.Random, disk: str) -> Faults:
        return Faults(
            never_boots=rng.random() < self.never_boots,
            bmc_proxy=rng.random() < self.bmc_proxy,
            power_delay=self.slow_power_delay if rng.random() < self.slow_power else None,
            fail_writes=(disk,) if rng.random() < self.fail_writes else (),
            flaky_link=rng.random() < self.flaky_link,
        )


def identity(rng: random.Random, seed: int, index: int, nics: int = 2) -> tuple[str, str, tuple[str, ...]]:
    """A machine's product UUID, serial and MACs: unique per (seed, index), stable per seed."""
    product_uuid = str(uuid.UUID(int=rng.getrandbits(128), version=4))
    serial = f"SIM{seed % 1000:03d}{index:06d}"
    macs = tuple(
        f"52:54:{seed % 256:02x}:{(index >> 8) & 0xFF:02x}:{index & 0xFF:02x}:{nic:02x}"
        for nic in range(nics)
    )
    return product_uuid, serial, macs


@dataclass
class Ledger:
    path: Path

    def append(self, event: str, **fields: Any) -> None:
        line = json.dumps({"t": time.time(), "event": event, **fields}, sort_keys=True) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def events(self, event: str | None = None, **match: Any) -> list[dict[str, Any]]:
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return []
        found = []
        for line in lines:
            try:
                doc = json.loads(line)
            except ValueError:
                continue  # a line being written right now
            if event is not None and doc.get("event") != event:
                continue
            if all(doc.get(k) == v for k, v in match.items()):
                found.append(doc)
        return found

    def count(self, event: str, **match: Any) -> int:
        return len(self.events(event, **match))

    def counts(self, *, since: float | None = None) -> dict[str, int]:
        """A summary: ``power:On``, ``power.requested:Off``, ``media.insert:Cd``,
        ``disk.write:vda:node.wipe``, ``boot.network``… and how often each happened (``since``:
        only what happened from that ``time.time()`` on)."""
        summary: dict[str, int] = {}
        for doc in self.events():
            if since is not None and doc.get("t", 0) < since:
                continue
            parts = [str(doc.get("event"))]
            parts += [str(doc[k]) for k in ("to", "device", "disk", "kind") if doc.get(k) is not None]
            key = ":".join(parts)
            summary[key] = summary.get(key, 0) + 1
        return summary

    def repeated_writes(self) -> dict[str, int]:
        """Commands that opened a disk for writing more than once (by command id): what "ran
        twice" means for a wipe or an image write."""
        seen: dict[str, int] = {}
        for doc in self.events("disk.write"):
            if doc.get("commandId"):
                seen[doc["commandId"]] = seen.get(doc["commandId"], 0) + 1
        return {cid: n for cid, n in seen.items() if n > 1}


@dataclass
class SimMachine:
    """One simulated machine: its identity, hardware tree, BMC address, knobs and ledger."""

    index: int
    name: str
    uuid: str
    serial: str
    macs: tuple[str, ...]
    folder: Path
    disks: tuple[str, ...]
    faults: Faults
    bmc_url: str = ""
    proxy: FaultyProxy | None = None
    gate: TcpGate | None = None
    power: str = "Off"
    boot_device: str = "Hdd"
    media: Mapping[str, Any] = field(default_factory=dict)
    pending_apply: float | None = None
    state_seq: int = 0
    """The number of the newest BMC state applied (the emulator's ``sim_seq``): an older one
    that arrives after it is dropped."""
    generation: int = 0
    boots: int = 0
    bcd: subprocess.Popen[bytes] | ZygoteProc | None = None
    """Its running bcd: a process of its own (forked by the simulator's fork server, or
    ``python -m bcd``); ``bcd.pid`` is a real pid a test may signal."""
    joining: subprocess.Popen[bytes] | ZygoteProc | None = None
    """Its ``bcd join`` while one runs (a power-off kills it, as it does the bcd)."""

    @property
    def tree(self) -> Path:
        """The root bcd runs under (``/sys``, ``/proc``, ``/dev``…)."""
        return self.folder / "tree"

    @property
    def ledger(self) -> Ledger:
        return Ledger(self.folder / "ledger.jsonl")

    @property
    def faults_file(self) -> Path:
        return self.folder / "faults.json"

    def disk(self, name: str | None = None) -> Path:
        """The file that is the disk (``/dev/<name>`` of the tree)."""
        return self.tree / "dev" / (name or self.disks[0])

    def bmc(self, credentials_ref: str | None = None) -> dict[str, Any]:
        """The ``bmc`` field of a site-agent command for this machine."""
        doc: dict[str, Any] = {"driver": "redfish", "address": self.bmc_url, "systemId": self.uuid}
        if credentials_ref is not None:
            doc["credentialsRef"] = credentials_ref
        return doc

    def fail_writes(self, *disks: str) -> None:
        """From now on writes to ``disks`` fail (none: they work again); bcd re-reads this."""
        tmp = self.faults_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"failWrites": list(disks)}))
        tmp.replace(self.faults_file)

    @property
    def running(self) -> bool:
        return self.bcd is not None and self.bcd.poll() is None

    def bcd_output(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.folder.glob("bcd-*.log")))
