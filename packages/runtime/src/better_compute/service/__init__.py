"""The service skeleton shared by every Better Compute service.

The names below load their module on first use (PEP 562): ``bcx`` and the clients import
``better_compute.service.client`` without paying for the service skeleton (asyncpg, the
JetStream machinery) they never run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._imports import lazy_attributes

if TYPE_CHECKING:
    from .base import ApiRequest, Handler, Service
    from .client import ApiClient, connect, discover, nats_client
    from .db import Database, apply_migrations, load_migrations
    from .main import run_service

__all__ = [
    "ApiClient",
    "ApiRequest",
    "Database",
    "Handler",
    "Service",
    "apply_migrations",
    "connect",
    "discover",
    "load_migrations",
    "nats_client",
    "run_service",
]

_HOME = {
    "ApiRequest": "base",
    "Handler": "base",
    "Service": "base",
    "ApiClient": "client",
    "connect": "client",
    "discover": "client",
    "nats_client": "client",
    "Database": "db",
    "apply_migrations": "db",
    "load_migrations": "db",
    "run_service": "main",
}

__getattr__ = lazy_attributes(__name__, _HOME)
