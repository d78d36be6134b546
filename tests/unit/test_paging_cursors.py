"""Cursors and byte-budgeted pages (``better_compute.wire.paging``)."""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime

import pytest

from better_compute.cli.paging import collect_pages, show_page
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


async def test_bcx_follows_a_typed_clients_pages_and_prints_json_or_a_table(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pages = {None: (["a", "b"], "c1"), "c1": (["c"], None)}
    asked: list[dict[str, object]] = []

    class Page:
        def __init__(self, items: list[str], next_: str | None) -> None:
            self.things, self.next = items, next_

    async def things_page(**kw: object) -> Page:
        asked.append(kw)
        return Page(*pages[kw["before"]])  # type: ignore[index]

    args = argparse.Namespace(limit=2, cursor=None, all_pages=True, json=False)
    found, next_ = await collect_pages(things_page, "things", args, cursor_param="before", site_id="s1")
    assert (found, next_) == (["a", "b", "c"], None)
    assert asked == [
        {"site_id": "s1", "limit": 2, "before": None},
        {"site_id": "s1", "limit": 2, "before": "c1"},
    ]

    args.all_pages = False
    found, next_ = await collect_pages(things_page, "things", args, cursor_param="before")
    assert show_page(args, next_, key="things", found=found, rows=[{"id": t} for t in found],
                     columns=[("id", "ID")], empty="none") == 0  # fmt: skip
    out, err = capsys.readouterr()
    assert out.split() == ["ID", "a", "b"]
    assert "more: --cursor c1" in err
    args.json = True
    show_page(args, next_, key="things", found=found, rows=[], columns=[], empty="none")
    assert json.loads(capsys.readouterr().out) == {"things": ["a", "b"], "next": "c1"}
