#!/usr/bin/env bash
# The whole test suite: lint, format check, mypy --strict, import contracts, then pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh -m unit).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
source scripts/system-packages.sh
echo "== ruff check" && "${UV[@]}" run --frozen ruff check .
echo "== ruff format --check" && "${UV[@]}" run --frozen ruff format --check .
echo "== mypy --strict" && "${UV[@]}" run --frozen mypy
echo "== import contracts (layers, services independent)" && "${UV[@]}" run --frozen lint-imports
echo "== pytest"
set +e
# Two workers (pytest-xdist), a test file per worker at a time (module fixtures stay whole):
# most tests wait on service processes, so two cores run two files side by side. The heaviest
# files go first (tests/conftest.py, tests/file-weights.json), not xdist's order by test count. Each worker
# brings its own embedded nats-server and PostgreSQL. BC_TEST_WORKERS=0 runs in one process.
# The reaper (better_compute.testing.reaper) is the subreaper of everything the run starts: when
# pytest ends, however it ends, every process it left (services, embedded servers, VMs) is stopped.
"${UV[@]}" run --frozen python -m better_compute.testing.reaper -- \
  pytest -n "${BC_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=30 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$rc"
