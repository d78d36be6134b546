"""Human tables and ``--json`` output for bcx."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

import msgspec

from ..core.errors import BcError

__all__ = ["iso", "json_line", "print_error", "print_json", "print_table", "with_iso_times"]

# Keys that hold a moment in what the services answer (camelCase). ``…AtMs`` keys hold epoch
# milliseconds and are shown as ``…At``.
_TIME_KEYS = frozenset({"at", "deadline", "lastSeen", "notAfter", "notBefore", "started"})
# Documents an operator wrote or a step returned: their keys are theirs, never rewritten.
_OPAQUE_KEYS = frozenset({"document", "payload", "result", "with", "labels", "details", "expect", "claims"})
_FRACTION = re.compile(r"(\.\d{6})\d+")


def iso(value: datetime | float | str | None) -> str | None:
    """A moment as ISO 8601 in UTC to the second (``2026-12-01T06:30:00Z``).

    Takes a ``datetime``, epoch seconds or an ISO string (any offset, any fraction); ``None``,
    ``0`` and ``""`` are no moment. A string that is not a moment is returned as it is.
    """
    if value is None or value == "":
        return None
    moment: datetime
    if isinstance(value, datetime):
        moment = value
    elif isinstance(value, int | float):
        if not value:
            return None
        moment = datetime.fromtimestamp(value, UTC)
    else:
        text = str(value)
        try:
            moment = datetime.fromisoformat(_FRACTION.sub(r"\1", text.replace("Z", "+00:00")))
        except ValueError:
            return text
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def with_iso_times(value: Any) -> Any:
    """``value`` with every moment it carries (``createdAt``, ``lastSeen``, ``expiresAtMs``, …)
    as :func:`iso` text; documents inside it (``document``, ``payload``, ``result``) untouched.
    A Struct (a client's reply) is shown as it travels: camelCase JSON."""
    if isinstance(value, msgspec.Struct):
        value = msgspec.to_builtins(value)
    if isinstance(value, list):
        return [with_iso_times(v) for v in value]
    if not isinstance(value, dict):
        return value
    out: dict[str, Any] = {}
    for key, v in value.items():
        if not isinstance(key, str) or key in _OPAQUE_KEYS or isinstance(v, bool):
            out[key] = v
        elif key.endswith("AtMs") and isinstance(v, int | float):
            out[key[:-2]] = iso(v / 1000)
        elif key in _TIME_KEYS or key.endswith("At"):
            out[key] = iso(v) if isinstance(v, str | int | float | datetime) else v
        else:
            out[key] = with_iso_times(v)
    return out


def print_json(value: Any, *, out: TextIO | None = None) -> None:
    """``value`` as indented JSON, its moments in ISO 8601."""
    (out or sys.stdout).write(
        json.dumps(with_iso_times(value), indent=2, sort_keys=False, default=str) + "\n"
    )


def json_line(value: Any) -> str:
    """``value`` as one line of JSON (a stream of events), its moments in ISO 8601."""
    return json.dumps(with_iso_times(value), default=str)


def print_table(
    rows: Sequence[dict[str, Any]],
    columns: Sequence[tuple[str, str]],
    *,
    out: TextIO | None = None,
    empty: str = "(none)",
) -> None:
    """``columns`` are ``(key, HEADER)`` pairs; cells are shown with ``str``."""
    stream = out or sys.stdout
    if not rows:
        stream.write(empty + "\n")
        return
    cells = [[_cell(row.get(key)) for key, _ in columns] for row in rows]
    headers = [h for _, h in columns]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    stream.write("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip() + "\n")
    for c in cells:
        stream.write("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)).rstrip() + "\n")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def print_error(err: BcError, *, as_json: bool) -> None:
    if as_json:
        print_json({"error": {"code": err.code.value, "message": err.message, "details": err.details}})
    else:
        sys.stderr.write(f"error: {err}\n")
