"""Process settings: ``bc.toml``, then ``BC_*`` environment variables, then flags."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from .core.errors import BcError, ErrorCode
from .wire.codec import validation_path

__all__ = ["DEFAULT_APP", "Settings", "load_settings"]

DEFAULT_APP = "better_compute.metal.app:app"

_ENV = {
    "nats_url": "BC_NATS_URL",
    "database_url": "BC_DATABASE_URL",
    "subject_root": "BC_SUBJECT_ROOT",
    "app": "BC_APP",
    "state_dir": "BC_STATE_DIR",
    "log_level": "BC_LOG_LEVEL",
    "health_port": "BC_HEALTH_PORT",
    "instance": "BC_INSTANCE",
}


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where a process finds the bus, the store and the app.

    ``nats_url`` / ``database_url`` unset means: the embedded servers recorded in
    ``state_dir`` (``bcx dev up`` writes them there).
    """

    nats_url: str | None = None
    database_url: str | None = None
    subject_root: str = "bc"
    app: str = DEFAULT_APP
    state_dir: str = ".state/dev"
    log_level: str = "info"
    health_port: int = 0
    instance: str | None = None


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Settings from ``config_file`` (or ``$BC_CONFIG``, or ``./bc.toml`` when present),
    the environment, and ``overrides`` (``None`` values are ignored)."""
    data: dict[str, Any] = {}
    path = config_file or os.environ.get("BC_CONFIG")
    if path is None and Path("bc.toml").is_file():
        path = "bc.toml"
    if path is not None:
        try:
            with open(path, "rb") as fh:
                data.update(tomllib.load(fh))
        except OSError as exc:
            raise BcError(
                ErrorCode.INVALID_CONFIG, f"cannot read config file: {exc}", {"path": str(path)}
            ) from exc
        except tomllib.TOMLDecodeError as exc:
            raise BcError(
                ErrorCode.INVALID_CONFIG, f"config file is not TOML: {exc}", {"path": str(path)}
            ) from exc
    for key, env in _ENV.items():
        if env in os.environ and os.environ[env] != "":
            data[key] = os.environ[env]
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return msgspec.convert(data, Settings, strict=False)
    except msgspec.ValidationError as exc:
        raise BcError(
            ErrorCode.INVALID_CONFIG, f"bad setting: {exc}", {"path": validation_path(exc)}
        ) from exc
