"""Test helpers for Better Compute and plugin authors.

The pytest plugin (``-p better_compute.testing.pytest_plugin``) gives each test real
servers, a fresh database and its own subject root. ``until()`` waits on a condition,
``refused()`` turns an expected ``BcError`` into a value to assert on and ``bcx()`` runs the
CLI as its own process.
"""

from .bcx import BcxRun, bcx, bcx_env, run_bcx
from .databases import DatabaseFactory
from .processes import ServiceProcess, ServiceProcesses
from .servers import TestServers, test_servers
from .waiting import refused, until

__all__ = [
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
