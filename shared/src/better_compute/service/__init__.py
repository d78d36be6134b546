"""The service skeleton shared by every Better Compute service."""

from .base import ApiRequest, Handler, Service
from .client import ApiClient, connect, discover
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
    "run_service",
]
