"""Pages of a list: ``limit`` and an opaque ``cursor`` in, the items and ``next`` out.

Every list route takes ``limit`` (1 to ``MAX_LIMIT``, ``DEFAULT_LIMIT`` when unset) and
``cursor`` (the ``next`` of the page before, or nothing for the first page) and answers
the items with ``next``: the cursor of the following page, or ``null`` after the last one.

A cursor is keyset, not an offset: it holds the sort key of the last item shown, so
walking a list while items are added or removed never shows an item twice and never
skips one that was there all along. A page also ends before ``limit`` once its items
reach the request's byte budget (``ApiRequest.page_budget``), so that no reply outgrows
what the bus carries; it always holds at least one item.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Annotated, Any, Final, TypeVar

import msgspec

from ..core.errors import BcError, ErrorCode

__all__ = [
    "DEFAULT_LIMIT",
    "MAX_CURSOR_LENGTH",
    "MAX_LIMIT",
    "PAGE_BUDGET",
    "Cursor",
    "Limit",
    "decode_cursor",
    "encode_cursor",
    "take_page",
]

T = TypeVar("T")

DEFAULT_LIMIT: Final = 100
MAX_LIMIT: Final = 1000
MAX_CURSOR_LENGTH: Final = 1024
PAGE_BUDGET: Final = 1 << 20
"""Bytes of items in one page at most (less when the bus's max_payload is smaller)."""

Limit = Annotated[int, msgspec.Meta(ge=1, le=MAX_LIMIT)]
Cursor = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CURSOR_LENGTH)]

KeyPart = str | int | datetime
_encoder = msgspec.json.Encoder()


def encode_cursor(*key: KeyPart) -> str:
    """An opaque cursor holding ``key``, the sort key of the last item of a page."""
    parts = [k.isoformat() if isinstance(k, datetime) else k for k in key]
    raw = json.dumps(parts, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def decode_cursor(cursor: str | None, *shape: type[KeyPart], path: str = "cursor") -> tuple[Any, ...] | None:
    """The key inside ``cursor`` as a tuple of ``shape`` (``None`` without a cursor).

    Raises:
        BcError: ``INVALID_INPUT`` at ``path`` for a cursor this list did not make.
    """
    if cursor is None:
        return None
    bad = BcError(
        ErrorCode.INVALID_INPUT, "not a cursor of this list: pass the reply's next as it is", {"path": path}
    )
    try:
        parts = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (ValueError, binascii.Error) as exc:
        raise bad from exc
    if not isinstance(parts, list) or len(parts) != len(shape):
        raise bad
    out: list[Any] = []
    for part, typ in zip(parts, shape, strict=True):
        if typ is datetime:
            try:
                out.append(datetime.fromisoformat(part))
            except (TypeError, ValueError) as exc:
                raise bad from exc
        elif isinstance(part, typ) and not isinstance(part, bool):
            out.append(part)
        else:
            raise bad
    return tuple(out)


def take_page(
    rows: Sequence[T],
    *,
    limit: int,
    key: Callable[[T], tuple[KeyPart, ...]],
    budget: int = PAGE_BUDGET,
    size: Callable[[T], int] | None = None,
) -> tuple[list[T], str | None]:
    """The rows of one page and the cursor of the next (``None`` after the last page).

    ``rows`` are in the list's order and hold up to ``limit + 1`` rows: one more than
    ``limit`` says that more follow. The page ends at ``limit`` rows, or earlier once the
    rows' encoded size reaches ``budget`` (never before its first row).
    """
    measure = size or (lambda row: len(_encoder.encode(row)))
    page: list[T] = []
    used = 0
    for row in rows[:limit]:
        if page:
            used += measure(row)
            if used > budget:
                break
        else:
            used = measure(row)
        page.append(row)
    more = len(page) < len(rows)
    return page, encode_cursor(*key(page[-1])) if more and page else None
