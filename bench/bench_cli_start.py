"""What starting ``bcx`` costs: CPU (user + system) of the ``bcx`` console script, N fresh runs.

    uv run python bench/bench_cli_start.py [--runs 15] [--bcx PATH] [--against PATH]

Runs the installed ``bcx`` script (the one beside this interpreter unless ``--bcx``) as a user
does: ``bcx --help``, a mistyped command, a command's ``--help``, ``bcx completion bash`` (the
whole parser, every command module), each ``--runs`` times in a fresh process. Prints the minimum,
median and maximum CPU milliseconds of the child (interpreter start included; ``python -c pass``
is the floor) and the median wall clock. ``--against`` runs a second ``bcx`` (another checkout's
``.venv/bin/bcx``) in alternation with the first, so both see the same load.

CPU, not wall clock, is the figure to compare on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES: list[tuple[str, list[str]]] = [
    ("bcx --help", ["--help"]),
    ("bcx bogus (an error)", ["bogus"]),
    ("bcx status --help", ["status", "--help"]),
    ("bcx nodes list --help", ["nodes", "list", "--help"]),
    ("bcx completion bash", ["completion", "bash"]),
]


def run_once(argv: list[str]) -> tuple[float, float]:
    """CPU seconds (user + system) and wall seconds of one run of ``argv``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def line(label: str, runs: list[tuple[float, float]]) -> str:
    cpu = sorted(r[0] * 1000 for r in runs)
    wall = statistics.median(r[1] for r in runs) * 1000
    return f"{label:36} {cpu[0]:7.0f} {statistics.median(cpu):7.0f} {cpu[-1]:7.0f} {wall:8.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--runs", type=int, default=15, help="fresh processes per case")
    parser.add_argument("--bcx", default=str(Path(sys.executable).with_name("bcx")), help="the bcx script")
    parser.add_argument("--against", help="a second bcx script, run alternately with the first")
    args = parser.parse_args()
    scripts = {"": args.bcx} if not args.against else {"this ": args.bcx, "other ": args.against}
    python = {name: Path(path).with_name("python") for name, path in scripts.items()}
    print(f"load average {os.getloadavg()[0]:.1f}, {args.runs} runs each")
    print(f"{'case':36} {'cpu ms':>7} {'median':>7} {'max':>7} {'wall ms':>8}")
    print(f"{'':36} {'min':>7}")
    floors: dict[str, list[tuple[float, float]]] = {name: [] for name in scripts}
    for _ in range(args.runs):
        for name in scripts:
            floors[name].append(run_once([str(python[name]), "-c", "pass"]))
    for name in scripts:
        print(line(f"{name}python -c pass (the floor)", floors[name]))
    for label, words in CASES:
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in scripts}
        for _ in range(args.runs):
            for name, script in scripts.items():
                results[name].append(run_once([script, *words]))
        for name in scripts:
            print(line(f"{name}{label}", results[name]))


if __name__ == "__main__":
    main()
