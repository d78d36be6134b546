"""Test helpers for Better Compute and plugin authors.

The pytest plugin (``-p better_compute.testing.pytest_plugin``) gives each test real
servers, a fresh database and its own subject root. ``until()`` waits on a condition and
``refused()`` turns an expected ``BcError`` into a value to assert on.
"""

from .databases import DatabaseFactory
from .processes import ServiceProcess, ServiceProcesses
from .servers import TestServers, test_servers
from .waiting import refused, until

__all__ = [
    "DatabaseFactory",
    "ServiceProcess",
    "ServiceProcesses",
    "TestServers",
    "refused",
    "test_servers",
    "until",
]
