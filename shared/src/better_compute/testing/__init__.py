"""Test helpers for Better Compute and plugin authors.

The pytest plugin (``-p better_compute.testing.pytest_plugin``) gives each test real
servers, a fresh database and its own subject root.
"""

from .databases import DatabaseFactory
from .processes import ServiceProcess, ServiceProcesses
from .servers import TestServers, test_servers

__all__ = ["DatabaseFactory", "ServiceProcess", "ServiceProcesses", "TestServers", "test_servers"]
