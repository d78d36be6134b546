"""Paging for bcx list commands: ``--limit``, ``--cursor`` and ``--all``.

A list command shows one page (``--limit`` items, from ``--cursor`` on) and, when more
follow, says on stderr how to get them: ``more: --cursor <next>``. ``--all`` (or
``--all-pages``) follows the cursors itself to the end, on every list (``bcx certs list`` takes
``--include-revoked`` for revoked certificates). Paging is explicit, not automatic: a
plain ``list`` costs one request and prints at most ``--limit`` rows, however long the list
is. With ``--json`` the output is ``{"<items>": [...], "next": <cursor or null>}``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from ..wire.paging import MAX_LIMIT
from .output import print_json, print_table

__all__ = ["add_paging", "collect", "collect_pages", "print_more", "show_page"]

T = TypeVar("T")

Fetch = Callable[[str | None], Awaitable[tuple[list[T], str | None]]]


def _limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"a whole number from 1 to {MAX_LIMIT}, got {text!r}")
    return value


def add_paging(parser: argparse.ArgumentParser, *, default_limit: int) -> None:
    """``--limit N`` (a page), ``--cursor C`` (where a page starts), ``--all``/``--all-pages``
    (every page)."""
    parser.add_argument(
        "--limit", type=_limit, default=default_limit, help=f"items a page (default {default_limit})"
    )
    parser.add_argument("--cursor", help="start at this page (the 'more' of the page before)")
    parser.add_argument(
        "--all", "--all-pages", dest="all_pages", action="store_true", help="every page, to the end"
    )


async def collect(fetch: Fetch[T], args: argparse.Namespace) -> tuple[list[T], str | None]:
    """One page from ``args.cursor``, or with ``args.all_pages`` every page; and the cursor after
    what was fetched (None at the end). ``fetch(cursor)`` asks for one page."""
    cursor: str | None = args.cursor
    items: list[T] = []
    while True:
        page, cursor = await fetch(cursor)
        items += page
        if cursor is None or not args.all_pages:
            return items, cursor


async def collect_pages(
    page: Callable[..., Awaitable[Any]],
    items: str,
    args: argparse.Namespace,
    *,
    cursor_param: str = "cursor",
    **filters: Any,
) -> tuple[list[Any], str | None]:
    """``collect`` over a typed client's page method: ``page(**filters, limit=, cursor=)``
    answers a list with the page in its attribute ``items`` and the cursor after it in ``next``
    (``cursor_param`` names the cursor keyword where it is not ``cursor``)."""

    async def fetch(cursor: str | None) -> tuple[list[Any], str | None]:
        got = await page(**filters, limit=args.limit, **{cursor_param: cursor})
        return list(getattr(got, items)), got.next

    return await collect(fetch, args)


def show_page(
    args: argparse.Namespace,
    next_: str | None,
    *,
    key: str,
    found: Any,
    rows: Sequence[dict[str, Any]],
    columns: Sequence[tuple[str, str]],
    empty: str,
) -> int:
    """A list command's output: with ``--json`` ``{key: found, "next": next_}``, else the table
    of ``rows`` and, when more follow, how to get them; exit status 0."""
    if args.json:
        print_json({key: found, "next": next_})
        return 0
    print_table(rows, columns, empty=empty)
    print_more(next_)
    return 0


def print_more(next_: str | None) -> None:
    """Tell on stderr how to see the next page (stdout keeps only the table)."""
    if next_ is not None:
        sys.stderr.write(f"more: --cursor {next_}  (or --all-pages for every page)\n")
