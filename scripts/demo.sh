#!/usr/bin/env bash
# The demo: a fleet's story on the embedded NATS and PostgreSQL, each service its own process.
# Five simulated machines (and a sixth nobody enrolled) behind a real Redfish endpoint, a real
# site agent, bcd processes booting on them; enroll -> inspect -> commission -> deploy ->
# release with the live progress of all five. KEEP=1 leaves it running (stop it with:
# BC_STATE_DIR=.state/demo uv run bcx sim down && BC_STATE_DIR=.state/demo uv run bcx dev down).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
export BC_STATE_DIR="${BC_STATE_DIR:-$PWD/.state/demo}"
# the fleet app: metal with a (simulated) bcd ramdisk and the ubuntu-24.04-autoinstall profile
export BC_APP="better_compute.testing.metal_sim.app:app"
unset BC_NATS_URL BC_DATABASE_URL BC_CONFIG
# agents judged silent and commands redelivered within a second (docs/settings.md)
export BC_CMDQ_HEARTBEAT=200ms BC_CMDQ_SWEEP=100ms BC_CMDQ_REDELIVER_AFTER=1s
SITE=lab1
T0=$(date +%s)
FLEET="site=$SITE,sim=1"
bcx() { "${UV[@]}" run --frozen bcx "$@"; }
step() { printf '\n\033[1m== [%3ss] %s\033[0m\n' "$(($(date +%s) - T0))" "$*"; }
json() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }

cleanup() {
  if [ "${KEEP:-0}" != "1" ]; then
    step "bcx dev down   (the simulator and its site agent too)"
    bcx dev down || true
  else
    step "KEEP=1: the stack goes on running. In this folder:"
    echo "  export BC_STATE_DIR=$BC_STATE_DIR   # bcx finds the kept stack through it"
    echo "  uv run bcx status; uv run bcx nodes list --site $SITE; uv run bcx sim status"
    echo "  uv run bcx dev down                   # stops all of it (the simulator and its site agent too)"
  fi
}
trap cleanup EXIT

# The demo starts from a clean slate (its own state folder only), so it tells the same story
# every time.
bcx dev down >/dev/null 2>&1 || true
rm -rf "$BC_STATE_DIR"
mkdir -p "$BC_STATE_DIR"
T0=$(date +%s)  # the story starts here

# The destructive-batch quorum is on: one approver, whose key stays in this folder. Wipes (and
# every other destructive command) run only inside a batch that key signed.
bcx batches keygen --key-file "$BC_STATE_DIR/approver.pem" --approver demo > "$BC_STATE_DIR/keygen.txt"
{ echo "threshold = 1"; sed -n '/^\[\[approvers\]\]/,$p' "$BC_STATE_DIR/keygen.txt"; } > "$BC_STATE_DIR/approvers.toml"
export BC_CMDQ_QUORUM_FILE="$BC_STATE_DIR/approvers.toml"
# The autoinstall ISOs the engine renders: written there, served there by the simulator.
export BC_SIM_MEDIA_DIR="$BC_STATE_DIR/media"
BC_SIM_MEDIA_URL="http://127.0.0.1:$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
export BC_SIM_MEDIA_URL

step "bcx dev up   (state in $BC_STATE_DIR; quorum on: 1 of approver demo)"
bcx dev up
step "bcx sim up --machines 5 --unenrolled 1 --site $SITE --enroll"
bcx sim up --machines 5 --unenrolled 1 --site "$SITE" --enroll --power-delay 0.1,0.3 | tee "$BC_STATE_DIR/sim-up.txt"

DISCOVERED=$(awk '/on \(discovered\)/ {print $NF}' "$BC_STATE_DIR/sim-up.txt")
if [ -n "$DISCOVERED" ]; then
  step "bcx nodes show $DISCOVERED   (the sixth machine: nobody enrolled it, it booted discovery)"
  bcx nodes show $DISCOVERED
fi

# One verb over the five, then the live view until each rests. A verb whose workflows send a
# destructive command gets one batch for all five: when the machines reach their wipe they wait
# for it, and the approver signs it once, here, for all five.
rollout() {
  local verb=$1
  shift
  local batch log="$BC_STATE_DIR/watch-$verb.log"
  step "bcx bulk $verb --selector $FLEET $*"
  batch=$(bcx --json bulk "$verb" --selector "$FLEET" "$@" | json 'd["batchId"] or ""')
  echo "5 started; their destructive commands wait for one batch: $batch"
  step "bcx nodes watch --selector $FLEET --verb $verb   (and bcx batches approve $batch once they wait)"
  bcx nodes watch --selector "$FLEET" --verb "$verb" --timeout 180 | tee "$log" &
  local watch=$!
  for _ in $(seq 1 600); do
    grep -q "waits for approvals" "$log" 2>/dev/null && break
    sleep 0.2
  done
  echo "        >> bcx batches approve $batch --approver demo: one signature, five machines"
  bcx batches approve "$batch" --approver demo --key-file "$BC_STATE_DIR/approver.pem" > /dev/null
  wait "$watch"
}

step "bcx bulk inspect --selector $FLEET --watch   (the ramdisk boots, bcd reports the inventory)"
bcx bulk inspect --selector "$FLEET" --watch --timeout 180
rollout commission
step "bcx bulk deploy --selector $FLEET --profile ubuntu-24.04-autoinstall --image ubuntu@24.04 --watch"
bcx bulk deploy --selector "$FLEET" --profile ubuntu-24.04-autoinstall --image ubuntu@24.04 --watch --timeout 180
rollout release

step "bcx sim status   (what the simulated hardware saw last)"
bcx sim status
echo
echo "the fleet's whole story (stack, simulator, four rollouts) in $(($(date +%s) - T0)) s"
