"""Running ``bcx`` as an operator would: its own process, against the test's deployment.

``bcx(settings, "nodes", "list", "--json")`` runs ``python -m better_compute.cli`` with the
deployment of ``settings`` (its NATS URL and subject root) in the environment, in a thread so
the test's event loop keeps serving; ``run_bcx`` is the same, blocking. The result unpacks as
``code, out, err`` and has ``returncode``, ``stdout`` and ``stderr``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Mapping
from typing import NamedTuple

from ..config import Settings

__all__ = ["BcxRun", "bcx", "bcx_env", "run_bcx"]

_DEPLOYMENT_VARS = ("BC_NATS_URL", "BC_DATABASE_URL")


class BcxRun(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def bcx_env(
    settings: Settings | None = None, *, env: Mapping[str, str] | None = None, isolated: bool = False
) -> dict[str, str]:
    """This process's environment for a bcx run: with the deployment of ``settings``, without
    any ``BC_NATS_URL``/``BC_DATABASE_URL`` of ours when ``isolated``, then ``env`` on top.
    The bcx contexts file is empty (``BCX_CONFIG``) unless ``env`` names one: a test never
    talks to the deployment of the current context of whoever runs it."""
    out = {k: v for k, v in os.environ.items() if not (isolated and k in _DEPLOYMENT_VARS)}
    out["BCX_CONFIG"] = os.devnull
    if settings is not None:
        out["BC_NATS_URL"] = settings.nats_url or ""
        out["BC_SUBJECT_ROOT"] = settings.subject_root
    out.update(env or {})
    return out


def run_bcx(
    settings: Settings | None,
    *args: str,
    env: Mapping[str, str] | None = None,
    isolated: bool = False,
    timeout: float = 60.0,
    input: str | None = None,
) -> BcxRun:
    """Run ``bcx *args`` and wait for it (``subprocess.TimeoutExpired`` after ``timeout``)."""
    proc = subprocess.run(
        [sys.executable, "-m", "better_compute.cli", *args],
        capture_output=True,
        text=True,
        env=bcx_env(settings, env=env, isolated=isolated),
        timeout=timeout,
        input=input,
        stdin=subprocess.DEVNULL if input is None else None,
    )
    return BcxRun(proc.returncode, proc.stdout, proc.stderr)


async def bcx(
    settings: Settings | None,
    *args: str,
    env: Mapping[str, str] | None = None,
    isolated: bool = False,
    timeout: float = 60.0,
    input: str | None = None,
) -> BcxRun:
    """``run_bcx`` in a thread: the test's services in this process keep answering meanwhile."""
    return await asyncio.to_thread(
        run_bcx, settings, *args, env=env, isolated=isolated, timeout=timeout, input=input
    )
