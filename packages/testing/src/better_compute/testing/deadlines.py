"""Time limits that fail one test, never the run (loaded by ``better_compute.testing.pytest_plugin``).

A test function's limit is pytest-timeout's (``timeout`` in the ini file, ``--timeout``, the
``timeout`` marker, with ``timeout_func_only``): its timer runs only while the test function
runs, never while pytest reports, where its exception became an INTERNALERROR that ended a loaded
run. A test's setup and teardown (stacks starting, a ramdisk building, processes stopping) have
a limit of their own, ``BC_TEST_SETUP_TIMEOUT`` seconds (600), armed only while they run.

How a limit fires is this module's (pytest-timeout's ``pytest_timeout_set_timer`` hook): a
SIGALRM in the main thread. In an asyncio test, an exception raised from a signal handler lands in
whatever runs at that moment, often a service's task in the test's event loop, which swallows it
while the test waits on for ever. So when a loop runs, the limit cancels the task the loop runs
to completion (the test's or fixture's coroutine): it stops at its ``await``, its ``finally``
blocks clean up, and the phase fails with a ``Timeout``. Only when that does not end it within
``GRACE`` seconds (a coroutine blocked in synchronous code, or one that ignores cancellation) is
the exception raised where the code runs, as in a synchronous test.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Generator
from typing import Any

import pytest

__all__ = ["GRACE", "SETUP_LIMIT", "PhaseTimeoutError"]

SETUP_LIMIT = float(os.environ.get("BC_TEST_SETUP_TIMEOUT", "600"))
GRACE = 5.0
"""Seconds a cancelled coroutine has to end before the limit is raised where the code runs."""
_RETRY_S = 0.05
_RETRIES = 100  # 5 s of looking for a moment outside a background task's step


class PhaseTimeoutError(Exception):
    """A test's setup or teardown ran past its limit."""


class _Alarm:
    """One armed limit: SIGALRM after ``seconds``; ``fired`` once it went off."""

    def __init__(self, seconds: float, message: str, error: Callable[[str], BaseException]) -> None:
        self.message = message
        self.error = error
        self.fired = False
        self.armed = True
        self._cancelled: asyncio.Task[Any] | None = None
        self._tries = 0
        self._previous = signal.signal(signal.SIGALRM, self._expired)
        signal.setitimer(signal.ITIMER_REAL, seconds)

    def disarm(self) -> None:
        if not self.armed:  # pytest-timeout cancels again when pdb or a report asks
            return
        self.armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self._previous)

    def _expired(self, _signum: int, _frame: Any) -> None:
        __tracebackhide__ = True
        self.fired = True
        loop = _running_loop()
        if loop is not None and self._cancelled is None:
            root = _root_task(loop)
            if root is not None and not root.done():
                self._cancelled = root
                root.cancel(self.message)
                signal.setitimer(signal.ITIMER_REAL, GRACE)
                return
        if loop is not None and _in_background_step(loop, self._cancelled) and self._tries < _RETRIES:
            # an exception raised here would end that task (a service's loop) and nothing else
            self._tries += 1
            signal.setitimer(signal.ITIMER_REAL, _RETRY_S)
            return
        _dump_stacks()
        raise self.error(self.message)

    def translate(self, exc: BaseException) -> BaseException | None:
        """The timeout to report instead of ``exc`` (the cancellation it caused), if it fired."""
        if self.fired and isinstance(exc, asyncio.CancelledError):
            return self.error(self.message)
        return None


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _root_task(loop: asyncio.AbstractEventLoop) -> asyncio.Task[Any] | None:
    """The task ``run_until_complete`` runs: pytest-asyncio's test or fixture coroutine."""
    for task in asyncio.all_tasks(loop):
        for callback, _context in getattr(task, "_callbacks", None) or ():
            if getattr(callback, "__name__", "") == "_run_until_complete_cb":
                return task
    return None


def _in_background_step(loop: asyncio.AbstractEventLoop, root: asyncio.Task[Any] | None) -> bool:
    current = asyncio.current_task(loop)
    return current is not None and current is not root


def _dump_stacks() -> None:
    """What every other thread was doing, on stderr (pytest shows it with the failure)."""
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        if ident != me:
            print(
                f"--- stack of thread {names.get(ident, ident)} ---", *traceback.format_stack(frame), sep=""
            )


def _timeout(message: str) -> BaseException:
    return pytest.fail.Exception(message, pytrace=True)


_ALARM = pytest.StashKey[_Alarm]()


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """Arm the test function's limit (pytest-timeout's settings)."""
    if settings.method != "signal" or not _main_thread():
        return None  # pytest-timeout's own way (a thread that ends the process)
    item.stash[_ALARM] = _Alarm(
        settings.timeout, f"Timeout (>{settings.timeout:g}s) from pytest-timeout.", _timeout
    )
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> bool | None:
    alarm = item.stash.get(_ALARM, None)
    if alarm is None:
        return None
    alarm.disarm()
    return True


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    try:
        return (yield)
    except BaseException as exc:
        alarm = item.stash.get(_ALARM, None)
        instead = alarm.translate(exc) if alarm is not None else None
        if instead is not None:
            raise instead from exc
        raise


def _phase(item: pytest.Item, phase: str) -> Generator[None, object, object]:
    running = item.stash.get(_ALARM, None)
    if not _main_thread() or SETUP_LIMIT <= 0 or (running is not None and running.armed):
        # (pytest-timeout's limit covers the whole test when timeout_func_only is off)
        return (yield)
    message = f"{phase} took more than {SETUP_LIMIT:g}s (BC_TEST_SETUP_TIMEOUT)"
    alarm = _Alarm(SETUP_LIMIT, message, PhaseTimeoutError)
    try:
        return (yield)
    except BaseException as exc:
        instead = alarm.translate(exc)
        if instead is not None:
            raise instead from exc
        raise
    finally:
        alarm.disarm()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _phase(item, "setup"))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    return (yield from _phase(item, "teardown"))
