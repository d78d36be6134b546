"""Cursors and byte-budgeted pages (``better_compute.wire.paging``)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from better_compute.core.errors import BcError, ErrorCode
from better_compute.wire.paging import decode_cursor, encode_cursor, take_page


def test_a_cursor_gives_back_its_key_and_refuses_anything_else() -> None:
    at = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    cursor = encode_cursor(at, "tok_1")
    assert decode_cursor(cursor, datetime, str) == (at, "tok_1")
    assert decode_cursor(None, str) is None
    for bad, shape in (
        ("not base64!", (str,)),
        (encode_cursor("a", "b"), (str,)),  # another list's cursor
        (encode_cursor("a"), (int,)),
        (encode_cursor(True), (int,)),
        (encode_cursor("yesterday"), (datetime,)),
    ):
        with pytest.raises(BcError) as e:
            decode_cursor(bad, *shape, path="stepsCursor")
        assert (e.value.code, e.value.path) == (ErrorCode.INVALID_INPUT, "stepsCursor")


def test_a_page_ends_at_the_limit_or_the_budget_but_never_empty() -> None:
    rows = [{"id": i, "blob": "x" * 100} for i in range(10)]  # 119 bytes each as JSON
    page, next_ = take_page(rows[:5], limit=5, key=lambda r: (r["id"],))
    assert (len(page), next_) == (5, None)  # exactly limit rows: the last page
    page, next_ = take_page(rows[:6], limit=5, key=lambda r: (r["id"],))
    assert len(page) == 5
    assert decode_cursor(next_, int) == (4,)
    page, next_ = take_page(rows, limit=10, key=lambda r: (r["id"],), budget=400)
    assert [r["id"] for r in page] == [0, 1, 2]
    assert decode_cursor(next_, int) == (2,)
    page, next_ = take_page(rows[:2], limit=10, key=lambda r: (r["id"],), budget=1)
    assert [r["id"] for r in page] == [0]  # one row over the budget still goes out alone
    assert next_ is not None
    assert take_page([], limit=10, key=lambda r: (r,)) == ([], None)
