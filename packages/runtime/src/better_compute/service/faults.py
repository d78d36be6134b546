"""Transient faults (PostgreSQL or NATS away for a while) and the backoff that rides them out.

A service never exits on a transient fault: it logs, waits a jittered, capped, growing delay
and tries again. Anything else is a bug, which retrying cannot fix.
"""

from __future__ import annotations

import errno
import socket

import asyncpg
import nats.errors
import nats.js.errors

from ..backoff import Backoff
from ..core.errors import BcError, ErrorCode

__all__ = ["Backoff", "describe", "is_transient"]

_TRANSIENT: tuple[type[BaseException], ...] = (
    ConnectionError,  # refused, reset, aborted, broken pipe
    TimeoutError,  # asyncio's and nats-py's too
    socket.gaierror,  # the server's name does not resolve (DNS away)
    asyncpg.PostgresConnectionError,  # the connection broke or was never made
    asyncpg.InterfaceError,  # the connection was closed under us, the pool is closing
    asyncpg.exceptions.OperatorInterventionError,  # the server is shutting down or starting up
    asyncpg.exceptions.TooManyConnectionsError,
    # a pooled connection the server shut down in the middle of an operation, handed out again
    # before asyncpg noticed it closed ("cannot switch to state …; another operation is in progress")
    asyncpg.exceptions.InternalClientError,
    # PostgreSQL rolled the transaction back for a conflict with another one, not for what it
    # asked: run again, it succeeds (40P01, 40001). At 10,000 machines the command queue's
    # presence write and a batch of claims took the same journal rows in other orders, and each
    # instance's presence loop took the deadlock for a bug and stopped its service. Not 40003
    # (statement completion unknown): whether it ran is not known, so it is not repeated blindly.
    asyncpg.exceptions.DeadlockDetectedError,
    asyncpg.exceptions.SerializationError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.ConnectionDrainingError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.FlushTimeoutError,
    nats.errors.NoServersError,
    nats.errors.NoRespondersError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,
)
_TRANSIENT_CODES = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT})
# A connect() that fails on the network raises a plain OSError with one of these (or, for
# several addresses at once, with none); a missing or unreadable file is not transient.
_NETWORK_ERRNOS = frozenset(
    {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN, errno.EHOSTDOWN, errno.EADDRNOTAVAIL, None}
)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says a server is away for now, not that we are wrong."""
    seen = 0
    cur: BaseException | None = exc
    while cur is not None and seen < 8:
        if isinstance(cur, BcError):
            if cur.code in _TRANSIENT_CODES:
                return True
        elif isinstance(cur, _TRANSIENT) or (type(cur) is OSError and cur.errno in _NETWORK_ERRNOS):
            return True
        cur = cur.__cause__ or cur.__context__
        seen += 1
    return False


def describe(exc: BaseException) -> str:
    """A short, secret-free description for a log line: the type and, for our errors, the code."""
    if isinstance(exc, BcError):
        return f"{exc.code.value}: {exc.message}"
    return type(exc).__name__
