#!/usr/bin/env bash
# The demo: the whole stack on the embedded NATS and PostgreSQL, each service its own
# process, then what an operator does and sees. KEEP=1 leaves it running
# (stop it with: BC_STATE_DIR=.state/demo uv run bcx dev down).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
export BC_STATE_DIR="${BC_STATE_DIR:-$PWD/.state/demo}"
export BC_APP="demo_app:app"
export PYTHONPATH="$PWD/deploy/demo${PYTHONPATH:+:$PYTHONPATH}"
unset BC_NATS_URL BC_DATABASE_URL
bcx() { "${UV[@]}" run --frozen bcx "$@"; }
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

cleanup() { [ "${KEEP:-0}" = "1" ] || { step "bcx dev down"; bcx dev down; }; }
trap cleanup EXIT

step "bcx dev up   (state in $BC_STATE_DIR)"
bcx dev up
step "bcx status"
bcx status
step "bcx nodes create --site lab1 --label mac=52:54:00:ab:cd:01"
NODE=$(bcx nodes create --site lab1 --label mac=52:54:00:ab:cd:01)
echo "$NODE"
step "bcx profiles create deploy/demo/ubuntu-cloud-init.json"
bcx profiles create deploy/demo/ubuntu-cloud-init.json --replace || true
step "bcx profiles validate --id ubuntu-cloud-init"
bcx profiles validate --id ubuntu-cloud-init
step "bcx profiles render --id ubuntu-cloud-init"
bcx profiles render --id ubuntu-cloud-init
step "bcx workflows start --profile ubuntu-cloud-init --node $NODE --wait"
bcx workflows start --profile ubuntu-cloud-init --node "$NODE" --wait
WF=$(bcx workflows list --node "$NODE" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["workflows"][0]["id"])')
step "bcx workflows get $WF   (results hold references, never the token or the document)"
bcx workflows get "$WF"
step "bcx tokens list   (the single-use token userdata.render minted, bound to the node's MAC)"
bcx tokens list
step "bcx secrets list   (metadata only)"
bcx secrets list
