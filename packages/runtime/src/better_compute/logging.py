"""structlog set-up: JSON in services, key-value on a terminal, secrets redacted.

Redaction is done by a processor, not by care: values under sensitive keys are
replaced, and any value registered with ``register_secret`` is cut out of every
string of every event, wherever it appears.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Mapping, MutableMapping
from typing import Any, TextIO

from ._imports import import_quietly

__all__ = ["REDACTED", "configure_logging", "get_logger", "redact", "register_secret", "safe_url"]

REDACTED = "[redacted]"

SENSITIVE_KEYS = frozenset(
    {
        "password", "passwd", "secret", "secret_value", "token", "join_token", "joinToken",
        "private_key", "privateKey", "user_data", "userData", "authorization", "credential",
        "credentials", "api_key", "apiKey", "key_material", "plaintext",
    }
)  # fmt: skip

_secrets_lock = threading.Lock()
# The most recent values, oldest first. Bounded: a service that mints a token per workflow for
# months must not scan millions of strings per log line. Values older than this stay protected by
# the sensitive-key rule and by never being logged on purpose.
MAX_REGISTERED_SECRETS = 4096
_secrets: dict[str, None] = {}
_snapshot: tuple[str, ...] = ()  # what log lines scan: replaced whole on register, never mutated
_MIN_SECRET_LEN = 6  # shorter strings would redact ordinary words


def register_secret(value: str | bytes) -> None:
    """Cut ``value`` out of every log line from now on (values under 6 characters are ignored)."""
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    if len(text) >= _MIN_SECRET_LEN:
        with _secrets_lock:
            _secrets.pop(text, None)
            _secrets[text] = None
            while len(_secrets) > MAX_REGISTERED_SECRETS:
                del _secrets[next(iter(_secrets))]
            global _snapshot
            _snapshot = tuple(_secrets)


def _scrub(value: Any, depth: int = 0) -> Any:
    if depth > 8:
        return value
    if isinstance(value, str):
        if _snapshot and len(value) >= _MIN_SECRET_LEN:
            for s in _snapshot:
                if s in value:
                    value = value.replace(s, REDACTED)
        return value
    if isinstance(value, bytes):
        return _scrub(value.decode("utf-8", "replace"), depth + 1)
    if isinstance(value, Mapping):
        return {k: (REDACTED if k in SENSITIVE_KEYS else _scrub(v, depth + 1)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_scrub(v, depth + 1) for v in value]
    if isinstance(value, BaseException):
        return _scrub(str(value), depth + 1)
    return value


def redact(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: replaces sensitive keys and registered secret values."""
    for key in list(event_dict):
        if key in SENSITIVE_KEYS:
            event_dict[key] = REDACTED
        else:
            event_dict[key] = _scrub(event_dict[key])
    return event_dict


def safe_url(url: str) -> str:
    """``url`` without its user and password, for messages and logs."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def configure_logging(*, level: str = "info", json: bool | None = None, stream: TextIO | None = None) -> None:
    """Configure structlog for this process.

    Args:
        level: minimum level name.
        json: JSON lines; by default when the stream is not a terminal.
        stream: where lines go (standard error by default).
    """
    import_quietly("structlog")  # loaded when first used: the SDK's import does not pay for it
    import structlog

    out = stream or sys.stderr
    as_json = (not out.isatty()) if json is None else json
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        redact,
    ]
    processors.append(
        structlog.processors.JSONRenderer()
        if as_json
        else structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)
    )
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )


def get_logger(**bound: Any) -> Any:
    """A logger with ``bound`` context (``workflow_id``, ``step``, ``command_id``, …)."""
    import_quietly("structlog")
    import structlog

    return structlog.get_logger().bind(**bound)
