"""Human tables and structured output for bcx: ``--output json`` (``--json``) or ``yaml``.

Commands print their documents with :func:`print_json` and streams with :func:`json_line`; both
write the format ``main`` chose with :func:`use_format` (JSON unless ``--output yaml``): YAML is
the same document, and a stream is a stream of YAML documents (``---`` before each).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:  # main imports FORMATS from here to build its parser: no msgspec for `bcx --help`
    from ..core.errors import BcError

__all__ = [
    "FORMATS",
    "iso",
    "json_line",
    "named",
    "print_error",
    "print_json",
    "print_table",
    "use_format",
    "with_iso_times",
]

FORMATS = ("table", "json", "yaml")
# The structured format of this process (one bcx command per process): set once by main.
_structured = "json"


def named(name: object) -> str:
    """A node's name in a table cell: ``-`` when it has none (None, or absent from a reply)."""
    return name if isinstance(name, str) else "-"


def use_format(output: str) -> None:
    """Print structured output (``print_json``, ``json_line``) as ``json`` or ``yaml`` from now on."""
    global _structured
    if output not in FORMATS:
        raise ValueError(output)
    _structured = "yaml" if output == "yaml" else "json"


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
    import msgspec

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


def _yaml(value: Any) -> str:
    # through JSON first: YAML shows exactly what --json shows (types, ISO times, str fallbacks)
    import yaml  # loaded for --output yaml only

    plain = json.loads(json.dumps(with_iso_times(value), default=str))
    return yaml.safe_dump(plain, sort_keys=False, allow_unicode=True, default_flow_style=False)


def print_json(value: Any, *, out: TextIO | None = None) -> None:
    """``value`` as indented JSON (YAML with ``--output yaml``), its moments in ISO 8601."""
    if _structured == "yaml":
        text = _yaml(value)
    else:
        text = json.dumps(with_iso_times(value), indent=2, sort_keys=False, default=str) + "\n"
    (out or sys.stdout).write(text)


def json_line(value: Any) -> str:
    """``value`` as one line of JSON (a stream of events), its moments in ISO 8601; with
    ``--output yaml``, one YAML document of the stream (``---`` first), without the last newline."""
    if _structured == "yaml":
        return "---\n" + _yaml(value).rstrip("\n")
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


def print_error(err: BcError, *, as_json: bool, hint: str | None = None) -> None:
    """``error: CODE: message (at path) (hint: …)`` on stderr; structured, on stdout, an
    ``error`` document with ``code``, ``message``, ``details`` and ``hint`` (null without one)."""
    if as_json:
        print_json(
            {"error": {"code": err.code.value, "message": err.message, "details": err.details, "hint": hint}}
        )
    else:
        sys.stderr.write(f"error: {err}" + (f" (hint: {hint})" if hint else "") + "\n")
        for p in _further_problems(err):
            where = f" (at {p['path']})" if p.get("path") else ""
            sys.stderr.write(f"  also: {p.get('code')}: {p.get('message')}{where}\n")


def _further_problems(err: BcError) -> list[dict[str, Any]]:
    """The problems of ``details.problems`` after the one the error line names (every problem
    of a document is found in one pass, so all of them are shown at once)."""
    problems = err.details.get("problems")
    if not isinstance(problems, list):
        return []
    rest = [p for p in problems if isinstance(p, dict)]
    if rest and rest[0].get("path") == err.path and rest[0].get("message") == err.message:
        rest = rest[1:]
    return rest
