#!/usr/bin/env bash
# The demo: the whole stack on the embedded NATS and PostgreSQL, each service its own
# process, then what an operator sees. KEEP=1 leaves it running (stop: uv run bcx dev down).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
export BC_STATE_DIR="${BC_STATE_DIR:-$PWD/.state/demo}"
bcx() { "${UV[@]}" run --frozen bcx "$@"; }
echo "== bcx dev up (state in $BC_STATE_DIR)"
bcx dev up
echo
echo "== bcx status"
bcx status
echo
echo "== bcx dev ps"
bcx dev ps
if [ "${KEEP:-0}" != "1" ]; then
  echo
  echo "== bcx dev down (KEEP=1 leaves the stack running)"
  bcx dev down
fi
