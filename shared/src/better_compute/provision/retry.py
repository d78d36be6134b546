"""Retry policies: when a failed step attempt runs again on its own.

A profile step may say ``retry: {attempts, backoff, maxBackoff, on}``, and a step definition may
carry a default (``define_step(retry=…)``). A failed attempt whose error code is in ``on`` is
retried after ``backoff``, doubling per failure up to ``maxBackoff``, as long as fewer than
``attempts`` attempts ran (the first run counts). Every retry is a new attempt with its own
idempotency key, started only once the failed one is superseded (docs/engine.md).

Document form (durations as strings, as elsewhere in a profile)::

    retry: {attempts: 3, backoff: "2s", maxBackoff: "30s", on: ["UNAVAILABLE", "DRIVER_ERROR"]}
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any, Final

import msgspec

from better_compute.core.errors import BcError, ErrorCode, join_path
from better_compute.core.manifest import parse_duration

__all__ = [
    "DEFAULT_MAX_BACKOFF",
    "DEFAULT_RETRY_ON",
    "MAX_ATTEMPTS",
    "RETRY_FIELDS",
    "RetryPolicy",
    "parse_retry",
]

RETRY_FIELDS: Final = ("attempts", "backoff", "maxBackoff", "on")
MAX_ATTEMPTS: Final = 100
DEFAULT_MAX_BACKOFF: Final = "5m"
DEFAULT_RETRY_ON: Final = ("UNAVAILABLE", "TIMEOUT", "DRIVER_ERROR")
_MAX_BACKOFF_MS: Final = 24 * 3600 * 1000
_CODES: Final = tuple(code.value for code in ErrorCode)


class RetryPolicy(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """A step's retry policy, checked and frozen (made by ``parse_retry``; read back from a
    workflow step with ``from_stored``, so the engine runs this very code)."""

    attempts: int
    backoff: str
    backoff_ms: int
    max_backoff: str
    max_backoff_ms: int
    on: tuple[str, ...]

    def delay_ms(self, failures: int) -> int:
        """The wait before the next attempt after ``failures`` (1, 2, …) failed attempts:
        ``backoff`` doubling per failure, never above ``maxBackoff``."""
        return int(min(self.backoff_ms * 2 ** max(0, failures - 1), self.max_backoff_ms))

    def retries(self, code: str, attempts_ran: int) -> bool:
        """Whether an attempt that failed with ``code``, after ``attempts_ran`` attempts under
        this policy, gets another one."""
        return code in self.on and attempts_ran < self.attempts

    def to_document(self) -> dict[str, Any]:
        """The policy as the camelCase document a profile writes."""
        return {
            "attempts": self.attempts,
            "backoff": self.backoff,
            "maxBackoff": self.max_backoff,
            "on": list(self.on),
        }

    def to_stored(self) -> dict[str, Any]:
        """What a workflow step persists: the document plus the durations in ms."""
        return {**self.to_document(), "backoffMs": self.backoff_ms, "maxBackoffMs": self.max_backoff_ms}

    @classmethod
    def from_stored(cls, stored: object) -> RetryPolicy | None:
        """The policy a workflow step stored (``to_stored``); None for none, or for a document
        that is not one (the step then fails as it would without a policy)."""
        if stored is None:
            return None
        try:
            return msgspec.convert(stored, cls)
        except msgspec.ValidationError:
            return None


def parse_retry(value: object, path: str, code: ErrorCode = ErrorCode.INVALID_CONFIG) -> RetryPolicy:
    """Read a ``retry`` document (or return a ``RetryPolicy`` as it is).

    Raises:
        BcError: ``code`` with ``details.path`` under ``path`` (``steps[2].retry.backoff``).
    """
    if isinstance(value, RetryPolicy):
        return value

    def bad(at: str, message: str) -> BcError:
        return BcError(code, message, {"path": join_path(path, at)})

    if not isinstance(value, Mapping):
        raise bad("", f"retry must be an object {{attempts, backoff, maxBackoff?, on?}}, got {value!r}")
    for key in value:
        if key not in RETRY_FIELDS:
            close = difflib.get_close_matches(str(key), RETRY_FIELDS, n=1)
            raise bad(str(key), "unknown field" + (f"; did you mean {close[0]}?" if close else ""))
    attempts = value.get("attempts")
    if isinstance(attempts, bool) or not isinstance(attempts, int) or not 1 <= attempts <= MAX_ATTEMPTS:
        raise bad("attempts", f"attempts is a whole number from 1 to {MAX_ATTEMPTS} (the first run counts)")
    backoff = value.get("backoff")
    if backoff is None:
        raise bad("backoff", "backoff is required: the wait before the first retry, like 2s")
    backoff_ms = parse_duration(backoff, path=join_path(path, "backoff"), code=code)
    if not 0 < backoff_ms <= _MAX_BACKOFF_MS:
        raise bad("backoff", "backoff must be longer than zero and at most 24h")
    max_backoff = value.get("maxBackoff")
    if max_backoff is None:
        max_backoff = backoff if backoff_ms > parse_duration(DEFAULT_MAX_BACKOFF) else DEFAULT_MAX_BACKOFF
    max_backoff_ms = parse_duration(max_backoff, path=join_path(path, "maxBackoff"), code=code)
    if not backoff_ms <= max_backoff_ms <= _MAX_BACKOFF_MS:
        raise bad("maxBackoff", f"maxBackoff must be at least backoff ({backoff}) and at most 24h")
    raw_on = value.get("on", list(DEFAULT_RETRY_ON))
    if not isinstance(raw_on, (list, tuple)) or not raw_on:
        raise bad("on", "on is a non-empty list of error codes, like [UNAVAILABLE, DRIVER_ERROR]")
    on: list[str] = []
    for i, item in enumerate(raw_on):
        if item not in (_CODES if isinstance(item, str) else ()):
            close = difflib.get_close_matches(str(item), _CODES, n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; one of {', '.join(_CODES)}"
            raise bad(f"on[{i}]", f"{item!r} is not an error code{hint}")
        if item in on:
            raise bad(f"on[{i}]", f"{item} is listed twice")
        on.append(item)
    return RetryPolicy(
        attempts=attempts,
        backoff=str(backoff),
        backoff_ms=backoff_ms,
        max_backoff=str(max_backoff),
        max_backoff_ms=max_backoff_ms,
        on=tuple(on),
    )
