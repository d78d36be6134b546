"""What a converger unit works with: the machine, idempotent file writes, commands it reports.

A unit writes files only when their content (or mode) differs, runs a changing command through
``must`` (listed in its report's ``ran``), and looks at the machine through ``query`` (a
read-only command, not listed). It ends with ``UnitFailed`` or ``UnitSkipped`` when it cannot
or need not apply; the message says why, never a secret.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from better_compute.files import atomic_write

from .system import Machine, RunResult

__all__ = ["STATE", "Apply", "SecretFetcher", "Unit", "UnitFailed", "UnitSkipped", "last_line", "line_safe"]

SecretFetcher = Callable[[str], Awaitable[bytes]]
STATE: Final = "/var/lib/bcd"


class UnitFailed(Exception):  # noqa: N818 - an outcome of one unit, reported, not a program error
    """A unit could not be applied; the message says why (never a secret)."""


class UnitSkipped(Exception):  # noqa: N818 - an outcome of one unit, reported, not a program error
    """A unit has nothing to apply on this machine (a GPU unit without the hardware)."""


def last_line(done: RunResult) -> str:
    """The last line a command printed (its error, usually), at most 200 characters."""
    said = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
    return said[0][:200]


def line_safe(value: str, where: str) -> str:
    if "\n" in value or "\r" in value or "\x00" in value:
        raise UnitFailed(f"{where} holds a line break")
    return value


@dataclass
class Unit:
    """One unit's apply: the machine, what it ran, and a cache of what it looked up."""

    machine: Machine
    fetch_secret: SecretFetcher | None = None
    ran: list[str] = field(default_factory=list)
    cache: dict[str, Any] = field(default_factory=dict)

    def write(self, path: str, content: str, mode: int = 0o644) -> bool:
        """Write ``content`` to ``path`` (a machine path) unless it is there already."""
        target = self.machine.path(path)
        try:
            if target.read_text() == content and (target.stat().st_mode & 0o777) == mode:
                return False
        except OSError:
            pass
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(target, content, mode=mode)
        return True

    def must(self, *argv: str, hide: Sequence[str] = ()) -> str:
        """Run a changing command; ``UnitFailed`` with the end of its output when it fails."""
        done = self.machine.run(*argv)
        shown = " ".join("***" if a in hide else a for a in argv[:6])
        self.ran.append(shown)
        if done.returncode != 0:
            text = last_line(done)
            for secret in hide:
                text = text.replace(secret, "***")
            raise UnitFailed(f"{shown} exited {done.returncode}: {text}")
        return done.stdout

    def query(self, *argv: str) -> RunResult:
        """Run a read-only command (its exit status is the answer; not listed in ``ran``)."""
        return self.machine.run(*argv, timeout=60)

    def need(self, program: str, why: str) -> None:
        if not self.machine.has(program):
            raise UnitFailed(f"{program} is not installed on this machine ({why})")

    def stamp(self, name: str, settings: Mapping[str, Any]) -> bool:
        """Remember ``settings`` as applied (for units whose effect bcd cannot read back)."""
        doc = json.dumps(settings, sort_keys=True)
        return self.write(f"{STATE}/units/{name}.json", doc + "\n", 0o600)

    def stamped(self, name: str, settings: Mapping[str, Any]) -> bool:
        """Whether ``settings`` are what was applied last."""
        return self.machine.read(f"{STATE}/units/{name}.json", "") == json.dumps(settings, sort_keys=True)

    def real(self, path: str) -> str:
        """A machine path as the commands see it (under the root)."""
        return str(self.machine.path(path))


Apply = Callable[[Unit, Mapping[str, Any]], Awaitable[tuple[bool, str | None]]]
