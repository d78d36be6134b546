"""Test helpers for Better Compute and plugin authors.

The pytest plugin (``-p better_compute.testing.pytest_plugin``) gives each test real
servers, a fresh database and its own subject root. ``until()`` waits on a condition,
``refused()`` turns an expected ``BcError`` into a value to assert on and ``bcx()`` runs the
CLI as its own process.

The test kit imports nats-py at the top of its modules, and its helpers run as processes
(``python -m better_compute.testing…``): it imports nats-py first here, without the optional
extras it would load along (aiohttp, rich: ``better_compute._imports``).
"""

from .._imports import defer_optional_imports

defer_optional_imports()

# ruff: noqa: E402  (the imports below come after that call on purpose)
from .bcx import BcxForks, BcxRun, bcx, bcx_env, run_bcx
from .databases import DatabaseFactory
from .processes import ServiceProcess, ServiceProcesses
from .servers import TestServers, test_servers
from .waiting import refused, until

__all__ = [
    "BcxForks",
    "BcxRun",
    "DatabaseFactory",
    "ServiceProcess",
    "ServiceProcesses",
    "TestServers",
    "bcx",
    "bcx_env",
    "refused",
    "run_bcx",
    "test_servers",
    "until",
]
