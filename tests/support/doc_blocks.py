"""The lines of a doc's code block that a test runs itself, read from the doc (README.md or
docs/*.md): the block marked ``<!-- doctest: by tests/…/test_x.py (why) -->``, so the doc and what
the test runs cannot drift apart (test_doc_examples checks the test runs that block)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def doc_block(doc: str, test: str) -> list[str]:
    """The non-empty lines of the code block of ``doc`` (``docs/metal.md``) marked ``by test``
    (``tests/e2e/test_x.py``), a console block's ``$ `` taken off, its output lines kept."""
    lines = (ROOT / doc).read_text().splitlines()
    marker = f"<!-- doctest: by {test} ("
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(marker)) + 2
    end = next(i for i in range(start, len(lines)) if lines[i].lstrip().startswith("```"))
    return [line.strip().removeprefix("$ ") for line in lines[start:end] if line.strip()]
