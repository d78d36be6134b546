"""Waiting in tests: on a condition, never for a fixed time; and refusals as values.

Part of the SDK, because plugin authors test with them too::

    view = await until(lambda: cq.get(id=command_id), timeout=10)     # truthy: done
    err = await refused(cq.enqueue(bad))                               # a BcError, or it fails
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "kind")
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ..core.errors import BcError

__all__ = ["refused", "until"]

T = TypeVar("T")


async def until(
    check: Callable[[], T | Awaitable[T]],
    *,
    timeout: float | None = None,
    interval: float = 0.05,
    ignore: tuple[type[BaseException], ...] = (),
    what: str = "",
) -> T:
    """Call ``check`` (plain or async) until it gives something truthy, and return that.

    Args:
        timeout: seconds before giving up with an ``AssertionError``; ``None`` leaves the bound
            to the test's own timeout.
        interval: pause between two checks.
        ignore: exceptions that count as "not yet" (a cluster still settling), not as a failure.
        what: what is awaited, for the message when it times out.
    """
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    last: BaseException | None = None
    while True:
        try:
            got = check()
            if inspect.isawaitable(got):
                got = await got
        except ignore as exc:
            last = exc
        else:
            if got:
                return got
        if deadline is not None and loop.time() >= deadline:
            detail = f" (last error: {last!r})" if last is not None else ""
            raise AssertionError(f"{what or 'condition'}: not met within {timeout}s{detail}")
        await asyncio.sleep(interval)


async def refused(call: Awaitable[Any]) -> BcError:
    """The ``BcError`` that ``call`` raises; an ``AssertionError`` when it succeeds instead."""
    try:
        got = await call
    except BcError as exc:
        return exc
    raise AssertionError(f"expected a refusal (BcError), got {got!r}")
