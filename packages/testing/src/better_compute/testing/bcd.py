"""bcd as an OS process on a prepared machine tree (``python -m bcd --root <tree> …``), for tests.

The tree comes from ``better_compute.testing.machines.prepare_machine``; bcd reads and writes
only under it. The package ``bcd`` must be installed (it is in the workspace).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..config import Settings
from .guard import watch
from .processes import spawn_forked
from .zygote import ZygoteProc

__all__ = ["BcdProcess", "bcd_env", "run_bcd"]


def bcd_env(settings: Settings, root: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a bcd of this test: its NATS, subject root and machine root."""
    return {
        **os.environ,
        "BC_NATS_URL": settings.nats_url or "",
        "BC_SUBJECT_ROOT": settings.subject_root,
        "BCD_ROOT": str(root),
        "BCD_LOG_LEVEL": "debug",
        **(extra or {}),
    }


async def run_bcd(
    settings: Settings, root: Path, *args: str, extra_env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run one bcd command (``join``, ``inventory``) to its end."""
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "bcd", *args],
        env=bcd_env(settings, root, extra_env),
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )


@dataclass
class BcdProcess:
    """``bcd run`` in the background; its output goes to ``log``."""

    proc: subprocess.Popen[bytes] | ZygoteProc
    log: Path

    @classmethod
    def start(
        cls,
        settings: Settings,
        root: Path,
        *args: str,
        log: Path,
        extra_env: Mapping[str, str] | None = None,
    ) -> BcdProcess:
        argv = ["bcd", "run", *args]
        env = bcd_env(settings, root, extra_env)
        with open(log, "wb") as out:
            # forked from the test process's service fork server where it can be (processes.py)
            proc = spawn_forked(argv, env=env, log=log) or subprocess.Popen(
                [sys.executable, "-m", *argv],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        watch(proc.pid)  # stopped with the test run, even a SIGKILLed one
        return cls(proc=proc, log=log)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
