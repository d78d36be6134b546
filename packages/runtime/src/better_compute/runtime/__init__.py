"""Embedded servers and the local process supervisor behind ``bcx dev``."""

from .embedded import EmbeddedNats, EmbeddedPostgres
from .urls import resolve_database_url, resolve_nats_url

__all__ = ["EmbeddedNats", "EmbeddedPostgres", "resolve_database_url", "resolve_nats_url"]
