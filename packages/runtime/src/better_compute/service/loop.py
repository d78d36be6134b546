"""The event loop the services and the site agent run on: uvloop where it is installed (the
runtime depends on it off Windows), asyncio's own with ``BC_EVENT_LOOP=asyncio`` or without it.

Issue 25: every service spends most of its CPU in the loop's plumbing (a NATS message in, a
PostgreSQL round trip, a reply out); uvloop does that plumbing in C. asyncpg is written for it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["run_loop", "uses_uvloop"]

T = TypeVar("T")


def uses_uvloop() -> bool:
    """Whether ``run_loop`` runs on uvloop here."""
    if os.environ.get("BC_EVENT_LOOP", "uvloop").strip().lower() == "asyncio":
        return False
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on uvloop (``uses_uvloop``), else on asyncio's own loop."""
    if uses_uvloop():
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
