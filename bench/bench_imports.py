"""What importing the SDK and starting ``bcx`` costs a fresh process.

    uv run python bench/bench_imports.py [--runs 7] [--heavy]

Each case runs in a fresh ``python`` process, ``--runs`` times; prints the median CPU time (user +
system of the child, interpreter start included), the median wall clock, the number of modules in
``sys.modules`` at the end (for ``bcx`` at exit), and whether nats, structlog, aiohttp or asyncpg got
loaded. The first line is a bare ``python -c pass``: the interpreter's own floor. ``--heavy`` adds
the 12 heaviest packages by import time (``python -X importtime``, self
times summed by package) (``python -X importtime``) of each case.

CPU, not wall clock, is the figure to compare on a shared machine; the floor tells how much of it is
the interpreter itself.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import time

WATCHED = ("nats", "structlog", "aiohttp", "asyncpg", "rich", "yaml", "cryptography")

_REPORT = (
    "import sys, atexit\n"
    "def _bc_report():\n"
    "    names = set(sys.modules)\n"
    "    seen = ','.join(n for n in {watched!r} if n in names)\n"
    "    sys.stderr.write(f'\\n@@modules {{len(names)}} {{seen}}\\n')\n"
    "atexit.register(_bc_report)\n"
)

CASES: list[tuple[str, str]] = [
    ("python -c pass", "pass"),
    ("import better_compute.core", "import better_compute.core"),
    ("import better_compute.wire", "import better_compute.wire"),
    ("import better_compute.provision", "import better_compute.provision"),
    ("import better_compute.metal", "import better_compute.metal"),
    ("import better_compute.app", "import better_compute.app"),
    (
        "bcx --help",
        "import sys; sys.argv = ['bcx', '--help']\n"
        "from better_compute.cli.main import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass",
    ),
    (
        "bcx nodes list --help",
        "import sys; sys.argv = ['bcx', 'nodes', 'list', '--help']\n"
        "from better_compute.cli.main import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass",
    ),
]


def run_once(code: str) -> tuple[float, float, int, str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _REPORT.format(watched=WATCHED) + code],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    match = re.search(r"@@modules (\d+) ?(\S*)", proc.stderr)
    if match is None:
        raise SystemExit(f"case failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return cpu, wall, int(match.group(1)), match.group(2)


def heaviest(code: str, top: int = 12) -> list[tuple[int, str]]:
    """Import time by package (self time of every module summed by its top package; ours by
    subpackage, e.g. ``better_compute.cli``)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        capture_output=True,
        text=True,
        check=False,
    )
    by_package: dict[str, int] = {}
    for line in proc.stderr.splitlines():
        parts = line.split("|")
        if len(parts) != 3 or not parts[0].split(":")[-1].strip().isdigit():
            continue
        name = parts[2].strip().split(".")
        package = ".".join(name[:2]) if name[0] == "better_compute" else name[0]
        by_package[package] = by_package.get(package, 0) + int(parts[0].split(":")[-1])
    return sorted(((us, name) for name, us in by_package.items()), reverse=True)[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--runs", type=int, default=7, help="fresh processes per case (median)")
    parser.add_argument("--heavy", action="store_true", help="list the heaviest imports of each case")
    args = parser.parse_args()
    print(f"{'case':34} {'cpu ms':>8} {'wall ms':>8} {'modules':>8}  loaded")
    for label, code in CASES:
        runs = [run_once(code) for _ in range(args.runs)]
        cpu = statistics.median(r[0] for r in runs) * 1000
        wall = statistics.median(r[1] for r in runs) * 1000
        print(f"{label:34} {cpu:8.0f} {wall:8.0f} {runs[-1][2]:8d}  {runs[-1][3] or '-'}")
        if args.heavy and label != "python -c pass":
            for us, name in heaviest(code):
                print(f"    {us / 1000:8.1f} ms  {name}")


if __name__ == "__main__":
    main()
