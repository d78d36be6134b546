"""Every ``bcx …`` example of README.md and docs/*.md, checked against bcx itself, so the docs
cannot drift from what bcx does (issue 26).

* Every example is parsed by bcx's own parser (``parse_line``, no services: milliseconds each).
  A synopsis line (``bcx inspect|commission node_… [--profile P]``) is counted, not parsed.
* Every example not marked ``<!-- doctest: skip (reason) -->`` on the line before its code block
  runs, as a subprocess, against one stack started for this module's one test (bc-pki,
  bc-command-queue and bc-engine as processes; no bc-secrets, as the examples that show it
  missing expect; three enrolled nodes at site eu1). A ``$ bcx …`` line of a console block
  followed by output must print that output's first line: an error's ``error: CODE: message``
  (the hint, which names the reader's context, aside), a table's header, or the sentence shown;
  any other example must exit 0.

The test prints how many examples ran, were parsed only and were skipped, with each reason. It
adds about 30 s to the suite on the loaded two-core machine (load 17: the stack's start 7 s, the
ten runs, four at a time, 15 s, the parsing 2-3 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
import shlex
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import msgspec

from better_compute.cli.main import parse_line
from better_compute.config import Settings
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, bcx

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*```")
SKIP = re.compile(r"^\s*<!--\s*doctest:\s*skip\s*\((?P<reason>.*)\)\s*-->\s*$")
# a bcx command line: `bcx …`, `$ bcx …`, after variables and `uv run [--frozen]`
COMMAND = re.compile(r"^\s*(?:\$\s+)?(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:uv run (?:--frozen )?)?bcx(?:\s|$)")
# a synopsis word: [optional], a[:part], one|other (a value in quotes or with = is taken as is)
SYNOPSIS = re.compile(r"^\[|\]$|\w\[|^[\w.-]+(\|[\w.-]+)+$")


@dataclass(frozen=True)
class Example:
    where: str  # file:line
    argv: tuple[str, ...]  # after "bcx"
    shown: str | None  # the first line of output shown under it (console blocks), else None
    skip: str | None  # why it does not run here (the marker's reason)

    @property
    def synopsis(self) -> bool:
        return any(SYNOPSIS.search(word) for word in self.argv)


def _argv(line: str) -> tuple[str, ...]:
    words = shlex.split(line.strip().removeprefix("$ "), comments=True)
    words = words[words.index("bcx") + 1 :]
    for stop in ("|", ">", ">>", "&&", ";"):  # the shell's part of the line
        if stop in words:
            words = words[: words.index(stop)]
    return tuple(words)


def _block(lines: list[str], start: int, name: str, skip: str | None) -> list[Example]:
    """The examples of the code block whose first line (after the fence) is ``lines[start]``."""
    end = next(i for i in range(start, len(lines)) if FENCE.match(lines[i]))
    body = lines[start:end]
    console = any(line.lstrip().startswith("$ ") for line in body)
    out: list[Example] = []
    i = 0
    while i < len(body):
        line = body[i]
        i += 1
        if console and not line.lstrip().startswith("$ "):
            continue
        if not COMMAND.match(line):
            continue
        where = f"{name}:{start + i}"
        while line.rstrip().endswith("\\") and i < len(body):  # a continued line
            line = line.rstrip()[:-1] + " " + body[i].strip()
            i += 1
        shown = None
        if console and i < len(body) and not body[i].lstrip().startswith("$ "):
            shown = body[i].rstrip() or None
        out.append(Example(where, _argv(line), shown, skip))
    return out


def examples() -> list[Example]:
    found: list[Example] = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        name = str(path.relative_to(ROOT))
        i = 0
        while i < len(lines):
            if FENCE.match(lines[i]):
                before = lines[i - 1] if i else ""
                marker = SKIP.match(before)
                found += _block(lines, i + 1, name, marker["reason"] if marker else None)
                i = next(j for j in range(i + 1, len(lines)) if FENCE.match(lines[j])) + 1
            else:
                i += 1
    return found


def _parse_error(argv: tuple[str, ...]) -> str | None:
    """What bcx's parser says against ``argv``, or None when it takes it."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            _parser, _args, unknown = parse_line(list(argv))
    except SystemExit as exit_:
        if exit_.code == 0:  # --help
            return None
        return (err.getvalue().strip().splitlines() or [f"exit {exit_.code}"])[-1]
    return f"unrecognized arguments: {' '.join(unknown)}" if unknown else None


def test_the_docs_have_bcx_examples_and_every_skip_says_why() -> None:
    found = examples()
    assert len(found) > 50, "the extraction found too few examples: the pattern broke"
    assert all(e.skip.strip() for e in found if e.skip is not None)


def test_every_example_is_a_command_line_bcx_takes() -> None:
    """Command and flag names as the docs show them exist, with the values they take."""
    bad = [f"{e.where}: bcx {shlex.join(e.argv)}: {err}" for e in examples()
           if not e.synopsis and (err := _parse_error(e.argv)) is not None]  # fmt: skip
    assert bad == []


async def test_every_runnable_example_does_what_its_doc_shows(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses
) -> None:
    for name in ("bc-pki", "bc-command-queue", "bc-engine"):
        bc_processes.start(name)
    await bc_processes.wait_ready()
    for i in range(3):  # what the lists' examples page through
        await bc_api.call("engine", "metal.enroll", {"siteId": "eu1", "labels": {"rack": f"r{i}"}})
    found = examples()
    runnable = [e for e in found if e.skip is None]
    gate = asyncio.Semaphore(4)  # the examples only read: a few at once, on two cores

    async def check(e: Example) -> str | None:
        async with gate:
            run = await bcx(bc_settings, *e.argv, timeout=60)
        failure = _differs(e, run.returncode, run.stdout, run.stderr)
        return None if failure is None else f"{e.where}: bcx {shlex.join(e.argv)}: {failure}"

    failures = [f for f in await asyncio.gather(*(check(e) for e in runnable)) if f is not None]
    reasons = Counter(e.skip for e in found if e.skip is not None)
    print(
        f"\ndoc examples: {len(found)}; ran {len(runnable)}, parsed only {len(found) - len(runnable)}"
        f" ({sum(e.synopsis for e in found)} synopsis lines not parsed); skipped by reason:"
    )
    for reason, n in reasons.most_common():
        print(f"  {n:3}  {reason}")
    assert failures == []


def _differs(e: Example, code: int, stdout: str, stderr: str) -> str | None:
    """How the run differs from what the doc shows, or None."""
    if e.shown is not None and e.shown.startswith("error: "):
        want = e.shown.split(" (hint: ")[0]
        got = (stderr.splitlines() or [""])[0].split(" (hint: ")[0]
        return None if (code, got) == (1, want) else f"exit {code}, {got!r}; the doc shows {want!r}"
    if e.shown is not None and e.shown.split()[0].isupper():  # a table's header
        got_header = (stdout.splitlines() or [""])[0].split()
        if got_header == e.shown.split():
            return None
        return f"header {got_header}; the doc shows {e.shown.split()} (exit {code}: {stderr.strip()[-200:]})"
    if code != 0:
        return f"exit {code}: {(stderr or stdout).strip()[-300:]}"
    first = (stdout.splitlines() or [""])[0].rstrip()
    if e.shown is not None and not e.shown.startswith("{") and first != e.shown:  # a sentence
        return f"prints {first!r}; the doc shows {e.shown!r}"
    if "--json" in e.argv:
        msgspec.json.decode(stdout)  # JSON as promised
    return None
