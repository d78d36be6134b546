"""What every bcx command module shares: a connected API client, argument parsing helpers."""

from __future__ import annotations

import json
import tomllib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from ..config import Settings
from ..core.errors import BcError, ErrorCode
from ..runtime.urls import resolve_nats_url
from ..service.client import ApiClient, connect
from ..wire import Subjects

__all__ = ["api_client", "read_document"]


@asynccontextmanager
async def api_client(settings: Settings) -> AsyncIterator[ApiClient]:
    """An ``ApiClient`` on the deployment's NATS, closed on exit."""
    nc = await connect(resolve_nats_url(settings), name="bcx", allow_reconnect=False)
    try:
        yield ApiClient(nc, Subjects(root=settings.subject_root))
    finally:
        await nc.close()


def read_document(path: str) -> dict[str, Any]:
    """A JSON (``.json``) or TOML (``.toml``) document from a file, ``-`` for JSON on stdin."""
    try:
        if path == "-":
            import sys

            data: Any = json.load(sys.stdin)
        elif path.endswith(".toml"):
            data = tomllib.loads(Path(path).read_text())
        else:
            data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise BcError(
            ErrorCode.INVALID_INPUT, f"cannot read {path}: {exc.strerror}", {"path": "file"}
        ) from exc
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise BcError(ErrorCode.INVALID_INPUT, f"{path} is not valid: {exc}", {"path": "file"}) from exc
    if not isinstance(data, dict):
        raise BcError(ErrorCode.INVALID_INPUT, f"{path} must hold one object", {"path": "file"})
    return data
