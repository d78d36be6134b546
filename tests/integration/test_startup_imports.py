"""Process start-up: a service or a bcx call does not pay for optional extras it never uses."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

PROBE = """
import sys
import better_compute.cli.main, bc_engine.service, bc_command_queue.service
import bcd.daemon, better_compute.agent.sim, better_compute.testing.reaper
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


SDK_PROBE = """
import sys
before = {k: v for k, v in sys.modules.items()}
import better_compute.core, better_compute.wire, better_compute.provision, better_compute.metal
import better_compute.app
heavy = ("nats", "structlog", "asyncpg", "aiohttp", "rich", "yaml")
print(sorted(m for m in heavy if m in sys.modules))
print(sorted(k for k, v in sys.modules.items() if v is None))
"""


def test_the_sdk_a_plugin_author_imports_loads_no_bus_logging_or_database_library() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SDK_PROBE], capture_output=True, text=True, check=True, timeout=60
    ).stdout.splitlines()
    assert out[0] == "[]"  # defining steps, profiles and plugins needs none of them
    assert out[1] == "[]"  # and nothing marked as missing in sys.modules


BCX_PROBE = """
import sys
from better_compute.cli.main import main
sys.argv = ["bcx", *sys.argv[1:]]
try:
    main()
except SystemExit:
    pass
heavy = ("nats", "structlog", "asyncpg", "aiohttp", "rich", "yaml", "cryptography", "msgspec", "asyncio")
sys.stderr.write(repr(sorted(m for m in heavy if m in sys.modules)) + "\\n")
"""


@pytest.mark.parametrize("argv", [["--help"], ["bogus"], ["nodes", "list", "--help"], ["status", "--help"]])
def test_bcx_help_loads_no_nats_structlog_or_database_library(argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", BCX_PROBE, *argv], capture_output=True, text=True, check=True, timeout=60
    )
    assert "usage: bcx" in done.stdout + done.stderr
    loaded = ast.literal_eval(done.stderr.strip().splitlines()[-1])
    assert {"nats", "structlog", "asyncpg", "aiohttp", "rich", "yaml"} & set(loaded) == set()
    if argv in (["--help"], ["bogus"]):
        # not even msgspec (the SDK) nor asyncio: argparse and bcx's parser alone
        assert loaded == []
