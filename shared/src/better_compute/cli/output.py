"""Human tables and ``--json`` output for bcx."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from ..core.errors import BcError

__all__ = ["print_error", "print_json", "print_table"]


def print_json(value: Any, *, out: TextIO | None = None) -> None:
    (out or sys.stdout).write(json.dumps(value, indent=2, sort_keys=False, default=str) + "\n")


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
