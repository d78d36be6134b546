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

AGENT_PID=""
cleanup() {
  [ -n "$AGENT_PID" ] && kill "$AGENT_PID" 2>/dev/null || true
  [ "${KEEP:-0}" = "1" ] || { step "bcx dev down"; bcx dev down; }
}
trap cleanup EXIT

# The demo starts from a clean slate (its own state folder only), so it tells the same story
# every time; `bcx dev up` on an existing state keeps everything, as an operator expects.
bcx dev down >/dev/null 2>&1 || true
rm -rf "$BC_STATE_DIR"

step "bcx dev up   (state in $BC_STATE_DIR)"
UP=$(bcx dev up)
echo "$UP"
NATS_URL=$(printf '%s\n' "$UP" | sed -n 's/.*export BC_NATS_URL=//p')
step "bcx status"
bcx status

step "a site agent for lab1 joins with a single-use token (the SDK's simulated BMC driver)"
rm -rf "$BC_STATE_DIR/agent-lab1" && mkdir -p "$BC_STATE_DIR/agent-lab1"
bcx tokens issue --role site --site lab1 --ttl 10m --token-file "$BC_STATE_DIR/agent-lab1/token"
"${UV[@]}" run --frozen python -m better_compute.agent.sim --nats-url "$NATS_URL" \
  --state-dir "$BC_STATE_DIR/agent-lab1" --token "$(cat "$BC_STATE_DIR/agent-lab1/token")" \
  --delay driver.invoke=400 > "$BC_STATE_DIR/agent-lab1/agent.log" 2>&1 &
AGENT_PID=$!
for _ in $(seq 1 100); do
  bcx agents list --json | grep -q '"connected": *true' && break
  sleep 0.2
done
bcx agents list
step "bcx nodes enroll --site lab1 --mac 52:54:00:ab:cd:01 --bmc sim://demo-1"
NODE=$(bcx --json nodes enroll --site lab1 --mac 52:54:00:ab:cd:01 --bmc sim://demo-1 --no-prompt \
  | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')
bcx nodes show "$NODE"
step "bcx profiles create deploy/demo/ubuntu-cloud-init.json"
bcx profiles create deploy/demo/ubuntu-cloud-init.json
step "bcx profiles validate --id ubuntu-cloud-init"
bcx profiles validate --id ubuntu-cloud-init
step "bcx profiles render --id ubuntu-cloud-init"
bcx profiles render --id ubuntu-cloud-init
step "bcx workflows start --profile ubuntu-cloud-init --node $NODE --wait"
bcx workflows start --profile ubuntu-cloud-init --node "$NODE" --wait
WF=$(bcx workflows list --node "$NODE" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["workflows"][0]["id"])')
step "bcx workflows get $WF   (results hold references, never the token or the document)"
bcx workflows get "$WF"
step "bcx commands list --workflow $WF   (what the site agent ran for it)"
bcx commands list --workflow "$WF"
step "bcx tokens list   (the agent's spent token, and the one userdata.render minted, bound to the node's MAC)"
bcx tokens list
step "bcx secrets list   (metadata only)"
bcx secrets list
