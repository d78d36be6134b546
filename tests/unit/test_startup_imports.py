"""Process start-up: a service or a bcx call does not pay for optional extras it never uses."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

PROBE = """
import sys
import better_compute.cli.main, bc_engine.service, bc_command_queue.service
print(sorted(m for m in ("aiohttp", "rich") if m in sys.modules))
import nats.aio.transport, aiohttp
print(nats.aio.transport.aiohttp.ClientSession is aiohttp.ClientSession)
import rich.console
print("rich", rich.console.Console is not None)
"""


def test_services_and_bcx_start_without_aiohttp_or_rich_and_both_still_work_when_asked() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=60
    ).stdout.splitlines()
    assert out[0] == "[]"  # neither was imported by start-up
    assert out[1] == "True"  # nats-py's WebSocket transport still finds aiohttp on first use
    assert out[2] == "rich True"  # a CLI view may still import rich itself
