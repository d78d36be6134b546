"""The machine as bcd sees it: a root folder for every file, and a runner for every command.

Tests point ``Machine.root`` at a prepared tree and give a runner that records commands
instead of running them, so nothing reaches the real machine (``sysctl -p``, ``modprobe``).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from better_compute.core.errors import BcError, ErrorCode

__all__ = ["CommandRunner", "Machine", "RunResult", "SystemRunner"]


@dataclass(frozen=True)
class RunResult:
    """What a command did: its exit status and what it printed."""

    returncode: int
    stdout: str = ""
    stderr: str = ""


class CommandRunner(Protocol):
    """Runs a program of the machine; tests inject one that records instead."""

    def which(self, program: str) -> str | None:
        """The program's path when the machine has it."""
        ...

    def run(self, argv: Sequence[str], *, input: bytes | None = None, timeout: float = 600.0) -> RunResult:
        """Run ``argv`` and wait; never raises for a non-zero exit."""
        ...


class SystemRunner:
    """The real machine's programs (``subprocess``)."""

    def which(self, program: str) -> str | None:
        return shutil.which(program)

    def run(self, argv: Sequence[str], *, input: bytes | None = None, timeout: float = 600.0) -> RunResult:
        try:
            done = subprocess.run(list(argv), input=input, capture_output=True, timeout=timeout, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return RunResult(returncode=127, stderr=f"{type(exc).__name__}: {exc}")
        return RunResult(
            returncode=done.returncode,
            stdout=done.stdout.decode("utf-8", "replace"),
            stderr=done.stderr.decode("utf-8", "replace"),
        )


@dataclass(frozen=True)
class Machine:
    """Where bcd reads and writes (``root``), and how it runs programs (``runner``)."""

    root: Path = Path("/")
    runner: CommandRunner = field(default_factory=SystemRunner)

    def path(self, machine_path: str | Path) -> Path:
        """``machine_path`` (absolute on the machine, ``/etc/sysctl.d/…``) under the root."""
        text = str(machine_path)
        if not text.startswith("/"):
            raise BcError(ErrorCode.INVALID_INPUT, f"expected an absolute path, got {text!r}", {"path": text})
        return self.root / text.lstrip("/")

    def read(self, machine_path: str | Path, default: str | None = None) -> str | None:
        """A small text file's content, stripped; ``default`` when it is absent or unreadable."""
        try:
            return self.path(machine_path).read_text(errors="replace").strip()
        except OSError:
            return default

    def run(self, *argv: str, input: bytes | None = None, timeout: float = 600.0) -> RunResult:
        return self.runner.run(argv, input=input, timeout=timeout)

    def has(self, program: str) -> bool:
        return self.runner.which(program) is not None
