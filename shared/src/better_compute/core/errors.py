"""The one error type of Better Compute, with stable string codes."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import msgspec

__all__ = ["BcError", "ErrorCode", "ErrorInfo", "ServiceUnavailableError", "join_path"]


class ErrorCode(StrEnum):
    """Stable error codes; clients match on these, never on messages."""

    INVALID_CONFIG = "INVALID_CONFIG"
    INVALID_INPUT = "INVALID_INPUT"
    INVALID_STATE = "INVALID_STATE"
    NOT_FOUND = "NOT_FOUND"
    CONFLICT = "CONFLICT"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    TIMEOUT = "TIMEOUT"
    DRIVER_ERROR = "DRIVER_ERROR"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"


class ErrorInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Wire form of a ``BcError``."""

    code: str
    message: str
    details: dict[str, Any] = msgspec.field(default_factory=dict)


class BcError(Exception):
    """The root of every error Better Compute raises on purpose.

    Args:
        code: one of ``ErrorCode``.
        message: a sentence for a person; never holds a secret value.
        details: machine-readable context: ``path`` for validation errors
            (``steps[2].with.port``), ``reason`` for state errors (``batch-required``).
    """

    def __init__(self, code: ErrorCode | str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message
        self.details: dict[str, Any] = dict(details or {})

    @property
    def path(self) -> str | None:
        path = self.details.get("path")
        return path if isinstance(path, str) else None

    @property
    def reason(self) -> str | None:
        reason = self.details.get("reason")
        return reason if isinstance(reason, str) else None

    def to_wire(self) -> ErrorInfo:
        return ErrorInfo(code=self.code.value, message=self.message, details=self.details)

    @classmethod
    def from_wire(cls, info: ErrorInfo) -> BcError:
        try:
            code = ErrorCode(info.code)
        except ValueError:
            code = ErrorCode.INTERNAL
        return cls(code, info.message, info.details)

    def with_path_prefix(self, prefix: str) -> BcError:
        """The same error with ``details.path`` nested under ``prefix``, and the path of each
        entry of ``details.problems`` too (one path style for all of them)."""
        details = dict(self.details)
        details["path"] = join_path(prefix, self.path or "")
        problems = details.get("problems")
        if isinstance(problems, list):
            details["problems"] = [
                {**p, "path": join_path(prefix, str(p.get("path") or ""))} if isinstance(p, dict) else p
                for p in problems
            ]
        err = BcError(self.code, self.message, details)
        err.__cause__ = self.__cause__
        return err

    def __repr__(self) -> str:
        return f"BcError({self.code.value!r}, {self.message!r}, {self.details!r})"

    def __str__(self) -> str:
        where = f" (at {self.path})" if self.path else ""
        return f"{self.code.value}: {self.message}{where}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (BcError, (self.code.value, self.message, self.details))


class ServiceUnavailableError(BcError):
    """``UNAVAILABLE`` or ``TIMEOUT`` because one of our own services (``bc-pki``,
    ``bc-secrets``, ``bc-command-queue``) did not answer, or answered that it cannot now.

    Raised by the service clients, never by a step on its own: the engine waits for the
    service (within the step's deadline) instead of failing the step. A step that wants to
    fail on it catches it and raises its own error.
    """

    def __init__(self, error: BcError, *, service: str) -> None:
        super().__init__(error.code, error.message, error.details)
        self.service = service

    def __reduce__(self) -> tuple[Any, ...]:
        return (BcError, (self.code.value, self.message, self.details))


def join_path(prefix: str, path: str) -> str:
    """Join two ``details.path`` fragments: ``steps[2]`` + ``with.port``, ``a`` + ``[0]``."""
    if not prefix:
        return path
    if not path:
        return prefix
    if path.startswith("["):
        return prefix + path
    return f"{prefix}.{path}"
