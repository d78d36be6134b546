"""What the request pre-scan (NUL, depth, int64: ``better_compute.wire.codec``) costs a request.

    uv run python bench/bench_codec.py [--kb 150] [--rounds 200]

Builds a profile document of about ``--kb`` KB (steps with ``with`` maps, templates, labels),
as ``profiles.create`` receives it, and prints the median time of ``codec.decode`` into the
request type, next to a bare ``msgspec.json.decode`` of the same bytes (no checks at all), the
full walk every request paid before the byte gate, and ``codec.decode`` of the same document
carrying one thing the checks must refuse (the walk still runs then, to name its path).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import msgspec

from better_compute.core.errors import BcError
from better_compute.wire.codec import Message, check_json, decode


class CreateProfile(Message, frozen=True, kw_only=True):
    tenant_id: str = "root"
    document: dict[str, Any]
    public: bool = False
    replace: bool = False


def profile(kb: int) -> dict[str, Any]:
    steps: list[dict[str, Any]] = []
    doc: dict[str, Any] = {"id": "big", "version": 1, "target": "node", "steps": steps}
    i = 0
    while len(msgspec.json.encode(doc)) < kb * 1024:
        steps.append(
            {
                "name": f"step-{i}",
                "use": "metal.power" if i % 2 else "provision.writeFile",
                "timeout": "5m",
                "with": {
                    "action": "cycle",
                    "path": f"/etc/bc/unit-{i}.conf",
                    "content": "key = value\n" * 8,
                    "labels": {"rack": f"r{i % 40}", "row": str(i % 7), "zone": "a"},
                    "retries": [1, 2, 4, 8],
                    "nested": {"a": {"b": {"c": [i, i + 1.5, True, None]}}},
                },
            }
        )
        i += 1
    return doc


def median_ms(fn: Callable[[], Any], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        with contextlib.suppress(BcError):
            fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kb", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    doc = profile(args.kb)
    raw = msgspec.json.encode({"tenantId": "root", "document": doc})
    bad = msgspec.json.encode({"tenantId": "root", "document": {**doc, "note": "a\x00b"}})
    print(f"profile: {len(raw) / 1024:.0f} KB, {len(doc['steps'])} steps")
    bare = median_ms(lambda: msgspec.json.decode(raw, type=CreateProfile), args.rounds)

    def walked() -> None:  # what every request paid before the byte gate (codec._suspect)
        check_json(msgspec.json.decode(raw))
        msgspec.json.decode(raw, type=CreateProfile)

    before = median_ms(walked, args.rounds)
    checked = median_ms(lambda: decode(raw, CreateProfile), args.rounds)
    refused = median_ms(lambda: decode(bad, CreateProfile), args.rounds)
    print(f"msgspec.json.decode alone:         {bare:7.2f} ms")
    print(f"walk every request (before):       {before:7.2f} ms")
    print(f"codec.decode, gated (now):         {checked:7.2f} ms")
    print(f"codec.decode, refused (NUL found): {refused:7.2f} ms")


if __name__ == "__main__":
    main()
