"""Where a process finds NATS and PostgreSQL: the settings, else the embedded servers."""

from __future__ import annotations

from pathlib import Path

from ..config import Settings
from ..core.errors import BcError, ErrorCode
from .embedded import EmbeddedNats, EmbeddedPostgres

__all__ = ["resolve_database_url", "resolve_nats_url"]


def resolve_nats_url(settings: Settings) -> str:
    if settings.nats_url:
        return settings.nats_url
    nats = EmbeddedNats(Path(settings.state_dir))
    if nats.running_pid() is None:
        raise BcError(
            ErrorCode.UNAVAILABLE,
            "no NATS: set BC_NATS_URL or start the embedded servers with `bcx dev up`",
            {"path": "nats_url"},
        )
    return nats.url


def resolve_database_url(settings: Settings) -> str:
    if settings.database_url:
        return settings.database_url
    pg = EmbeddedPostgres(Path(settings.state_dir))
    if pg.running_pid() is None:
        raise BcError(
            ErrorCode.UNAVAILABLE,
            "no PostgreSQL: set BC_DATABASE_URL or start the embedded servers with `bcx dev up`",
            {"path": "database_url"},
        )
    return pg.url()
