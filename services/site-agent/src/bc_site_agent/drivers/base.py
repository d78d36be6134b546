"""What every BMC driver shares: retries with backoff, polling, errors, the validate checks.

A driver (``interfaces.Driver``) is built per command from the command's ``NodeBmc`` (which
BMC, how to trust it) and the credentials fetched for that command; it lives for the one call
and is dropped with the credentials. Every operation takes the command's deadline (seconds
since the epoch): a driver retries transient BMC errors with backoff and jitter until then, and
``Driver`` verifies that power and boot changes converged (real BMCs apply them seconds later).

Cancels: every try and every retry of a BMC call first awaits the agent SDK's ``before_call``,
which raises ``CommandCancelled`` once a cancel of the command reached the agent: nothing is
sent to the BMC after that.

Errors: a driver raises only ``BcError`` (and ``CommandCancelled``); a BMC that refuses, answers
nonsense or stays away is ``DRIVER_ERROR`` with ``details.reason`` naming the BMC call.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from better_compute.agent import before_call, call_answered, call_failed
from better_compute.backoff import Backoff
from better_compute.core.errors import BcError, ErrorCode
from better_compute.wire.agent import CallFailure
from better_compute.wire.commands import BmcCheck

__all__ = [
    "BmcCredentials",
    "Checks",
    "NotRepeatedError",
    "Transient",
    "driver_error",
    "failure_reason",
    "malformed_answer",
    "poll_until",
    "retry_in_thread",
    "retry_transient",
]

T = TypeVar("T")
CheckName = Literal["reach", "credentials", "system", "power"]


@dataclass(frozen=True, kw_only=True)
class BmcCredentials:
    """Held in memory only (a driver's for its command, the site agent's for
    ``bmc.credentials_keep_seconds``); never logged (``repr`` hides the password)."""

    username: str
    password: str = field(repr=False)


class Transient(Exception):  # noqa: N818 - a classification carried to the retry loop
    """A BMC error worth trying again (5xx, connection refused, timeout).

    ``maybe_applied``: whether the BMC may have received (and acted on) the request. False only
    when it provably did not: the connection was never made (refused, name not resolved,
    connect timeout), or the BMC answered 503 (it did not take the request). A connection lost
    or a read timing out after the request went out, or any other 5xx, may have applied it.

    ``kind`` and ``reason`` are what the command's progress says of it while it is tried again
    (``BMC unreachable at <address>: <reason>``): ``unreachable`` when nothing answered,
    ``error`` when the BMC answered with an error; the reason is short and holds no secret.
    """

    def __init__(
        self,
        call: str,
        detail: str,
        *,
        maybe_applied: bool = True,
        kind: CallFailure = "unreachable",
        reason: str | None = None,
    ) -> None:
        super().__init__(f"{call}: {detail}")
        self.call = call
        self.detail = detail
        self.maybe_applied = maybe_applied
        self.kind: CallFailure = kind
        self.reason = reason or detail


class NotRepeatedError(BcError):
    """The ``DRIVER_ERROR`` of an action whose answer was lost and that was not sent again (the
    BMC may have applied it): a caller that can read back what the action asked for may catch it
    (``redfish``: a power on or off)."""


def driver_error(call: str, detail: str, **extra: Any) -> BcError:
    """``DRIVER_ERROR`` whose reason names the BMC call."""
    reason = f"{call}: {detail}"
    return BcError(ErrorCode.DRIVER_ERROR, f"BMC call failed: {reason}", {"reason": reason, **extra})


def malformed_answer(call: str, exc: Exception) -> BcError:
    """``DRIVER_ERROR`` for a BMC answer the client library could not make sense of."""
    return driver_error(call, f"malformed answer ({type(exc).__name__})")


async def retry_transient(
    call: Callable[[], Awaitable[T]],
    *,
    deadline: float,
    base: float = 0.2,
    cap: float = 3.0,
    on_retry: Callable[[Transient, float], None] | None = None,
    idempotent: bool = True,
    what: str = "BMC call",
    at: str | None = None,
    requests_checked: bool = False,
) -> T:
    """``call()`` until it stops raising ``Transient``, with a jittered ``Backoff``, until
    ``deadline``; then ``DRIVER_ERROR`` naming the last call that failed.

    A call that is not ``idempotent`` (a POST action: Reset, InsertMedia) is repeated only
    after a ``Transient`` that provably did not reach the BMC (``maybe_applied`` false);
    otherwise it is ``DRIVER_ERROR`` at once (``NotRepeatedError``), saying the BMC may have applied
    it. Sending it twice could reset a machine twice or fail on a medium the first request
    inserted.

    Before every try, ``before_call(what)``: a cancel that reached the agent stops it here
    (``requests_checked``: ``call`` asks before each of its requests, ``before_call_blocking``).
    Each try that fails and is tried again is the command's progress (``call_failed``: the
    failure, the tries in a row and since when, the BMC at ``at``) until a call answers."""
    backoff = Backoff(first=base, cap=cap)
    while True:
        await before_call(what, requests_checked=requests_checked)
        try:
            got = await call()
        except Transient as exc:
            if not idempotent and exc.maybe_applied:
                lost = driver_error(exc.call, f"{exc.detail}; not repeated: the BMC may have applied it")
                raise NotRepeatedError(lost.code, lost.message, lost.details) from None
            if at is not None:
                await call_failed(exc.kind, exc.reason, at=at)
            left = deadline - time.time()
            delay = backoff.next()
            if left <= delay:
                raise driver_error(exc.call, f"{exc.detail} (gave up at the command's deadline)") from None
            if on_retry is not None:
                on_retry(exc, delay)
            await asyncio.sleep(delay)
        else:
            await call_answered()
            return got


async def retry_in_thread(
    run: Callable[[], T],
    *,
    deadline: float,
    log: Any,
    idempotent: bool = True,
    what: str = "BMC call",
    at: str | None = None,
    requests_checked: bool = False,
) -> T:
    """``run`` (one blocking BMC call that raises ``Transient`` when worth trying again and
    ``BcError`` otherwise) in a worker thread, retried as ``retry_transient`` does (a call that
    is not ``idempotent`` only when it never reached the BMC); each retry is logged as
    ``bmc_call_retry``."""

    def on_retry(exc: Transient, delay: float) -> None:
        log.info("bmc_call_retry", call=exc.call, detail=exc.detail, delay_s=round(delay, 2))

    async def attempt() -> T:
        return await asyncio.to_thread(run)

    return await retry_transient(
        attempt, deadline=deadline, on_retry=on_retry, idempotent=idempotent, what=what, at=at,
        requests_checked=requests_checked,
    )  # fmt: skip


async def poll_until(
    read: Callable[[], Awaitable[T]],
    done: Callable[[T], bool],
    *,
    deadline: float,
    what: str,
    interval: float = 0.5,
) -> T:
    """Read until ``done`` (a converged state) or the deadline (``DRIVER_ERROR``)."""
    while True:
        got = await read()
        if done(got):
            return got
        if time.time() + interval >= deadline:
            raise driver_error(what, f"did not converge before the command's deadline (last seen {got!r})")
        await asyncio.sleep(interval)


class Checks:
    """The checks of ``management.validate`` in order: once one fails, the ones after it that
    need it are ``skipped`` (a BMC that does not answer cannot be asked for its power state)."""

    def __init__(self) -> None:
        self.items: list[BmcCheck] = []
        self.failed = False

    def ok(self, check: CheckName, message: str) -> None:
        self.items.append(BmcCheck(check=check, status="ok", message=message))

    def fail(self, check: CheckName, message: str) -> None:
        self.failed = True
        self.items.append(BmcCheck(check=check, status="failed", message=message[:300]))

    def skip(self, *checks: CheckName) -> list[BmcCheck]:
        for check in checks:
            self.items.append(
                BmcCheck(check=check, status="skipped", message="not checked: an earlier check failed")
            )
        return self.items


def failure_reason(err: BcError) -> str:
    """What a failed check says: the driver's reason (which names the BMC call), else the message."""
    return str(err.reason or err.message) if err.code is ErrorCode.DRIVER_ERROR else err.message
