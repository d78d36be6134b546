"""Per test file seconds from a pytest JUnit XML report, for the suite's scheduling order.

    pytest --junitxml=/tmp/run.xml … && python scripts/file_weights.py /tmp/run.xml > tests/file-weights.json

tests/conftest.py hands the heaviest files out first, so that the two workers do not end with one
of them alone on a VM test while the other is idle (xdist's own order is by the number of tests in
a file, which put the one-test VM files last).
"""

from __future__ import annotations

import collections
import json
import sys
import xml.etree.ElementTree as ET


def main() -> None:
    seconds: collections.Counter[str] = collections.Counter()
    for case in ET.parse(sys.argv[1]).iter("testcase"):
        parts = (case.get("classname") or "").split(".")
        # tests.e2e.test_x or tests.e2e.test_x.TestSomething
        ends = [i for i, part in enumerate(parts) if part.startswith("test_")]
        if parts[0] == "tests" and ends:
            path = "/".join(parts[: ends[0] + 1]) + ".py"
            seconds[path] += float(case.get("time") or 0)
    print(json.dumps({k: round(v, 1) for k, v in sorted(seconds.items())}, indent=1))


if __name__ == "__main__":
    main()
