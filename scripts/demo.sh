#!/usr/bin/env bash
# The demo: a fleet's story on the embedded NATS and PostgreSQL, each service its own process.
# Five simulated machines (and a sixth nobody enrolled) behind a real Redfish endpoint, and one
# real machine: a QEMU VM with a blank disk behind sushy-emulator, booting the ramdisk this
# project builds (bcx ramdisk build) with the real bcd in it. A real site agent; enroll ->
# inspect -> commission -> deploy (the VM: a signed OS image written to its disk, which it then
# boots, its installed bcd joining) -> release, with the live progress of all six. KEEP=1 leaves
# it running (stop it with: BC_STATE_DIR=.state/demo uv run bcx dev down). NO_VM=1 leaves the VM
# out (the simulated fleet alone, about a minute).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
export BC_STATE_DIR="${BC_STATE_DIR:-$PWD/.state/demo}"
# the fleet app (metal, the ubuntu-24.04-autoinstall profile) with the VM lab's ramdisk: the one
# bcx ramdisk build makes, which bcx dev up serves; the simulated machines boot the same entries
VM=$([ "${NO_VM:-0}" = "1" ] && echo 0 || echo 1)
if [ "$VM" = 1 ]; then
  export BC_APP="better_compute.testing.vmlab.app:app"
else
  export BC_APP="better_compute.testing.metal_sim.app:app"
fi
unset BC_NATS_URL BC_DATABASE_URL BC_CONFIG
# agents judged silent and commands redelivered within a second (docs/settings.md)
export BC_CMDQ_HEARTBEAT=200ms BC_CMDQ_SWEEP=100ms BC_CMDQ_REDELIVER_AFTER=1s
SITE=lab1
T0=$(date +%s)
FLEET="site=$SITE,sim=1"   # the five simulated machines and the VM (hw=sim, hw=vm)
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
trap 'exit 130' INT
trap 'exit 143' TERM  # so a stopped demo stops its stack too (the EXIT trap)

# The demo starts from a clean slate (its own state folder only), so it tells the same story
# every time.
bcx dev down >/dev/null 2>&1 || true
rm -rf "$BC_STATE_DIR"
mkdir -p "$BC_STATE_DIR"
T0=$(date +%s)  # the story starts here

# The destructive-batch quorum is on: one approver, whose key stays in this folder. Nothing
# writes a disk without a batch that key signed: the wipes and image writes, and the boot
# commands of every profile that writes disks (the installer's medium, the power cycle into it).
bcx batches keygen --key-file "$BC_STATE_DIR/approver.pem" --approver demo > "$BC_STATE_DIR/keygen.txt"
{ echo "threshold = 1"; sed -n '/^\[\[approvers\]\]/,$p' "$BC_STATE_DIR/keygen.txt"; } > "$BC_STATE_DIR/approvers.toml"
export BC_CMDQ_QUORUM_FILE="$BC_STATE_DIR/approvers.toml"
# The autoinstall ISOs the engine renders: written there, served there by the simulator.
export BC_SIM_MEDIA_DIR="$BC_STATE_DIR/media"
BC_SIM_MEDIA_URL="http://127.0.0.1:$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
export BC_SIM_MEDIA_URL

if [ "$VM" = 1 ]; then
  # The ramdisk and the test OS image from Debian packages and bcd (PyInstaller); their parts are
  # cached in ~/.cache/better-compute/ramdisk, so only the first demo on a machine builds them
  # (a few minutes).
  step "bcx ramdisk build   (kernel, busybox, bcd: the ramdisk every machine network-boots)"
  bcx ramdisk build --out "$BC_STATE_DIR/ramdisk"
  export BC_RAMDISK_DIR="$BC_STATE_DIR/ramdisk"
  step "bcx ramdisk build --os-image   (the OS the VM gets: syslinux, a kernel, bcd in installed mode)"
  bcx ramdisk build --os-image --out "$BC_STATE_DIR/test-os"
  # the image and the bcd the installed OS downloads (its launcher: the image carries bcd) are
  # served where the guest reaches this machine's loopback, 10.0.2.2
  mkdir -p "$BC_SIM_MEDIA_DIR"
  cp "$BC_STATE_DIR/test-os/bc-test-os.raw" "$BC_SIM_MEDIA_DIR/bc-test-os.raw"
  printf '#!/bin/sh\nexec /opt/bcd/bcd "$@"\n' > "$BC_SIM_MEDIA_DIR/bcd"
  GUEST_MEDIA="http://10.0.2.2:${BC_SIM_MEDIA_URL##*:}"
  BC_VMLAB_USERDATA=$(printf '{"bcdUrl": "%s/bcd", "bcdSha256": "%s"}' "$GUEST_MEDIA" \
    "$(sha256sum "$BC_SIM_MEDIA_DIR/bcd" | cut -c1-64)")
  export BC_VMLAB_USERDATA
fi

step "bcx dev up   (state in $BC_STATE_DIR; quorum on: 1 of approver demo)"
bcx dev up
step "bcx sim up --machines 5 --unenrolled 1 --vms $VM --site $SITE --enroll"
bcx sim up --machines 5 --unenrolled 1 --vms "$VM" --site "$SITE" --enroll --power-delay 0.1,0.3 \
  | tee "$BC_STATE_DIR/sim-up.txt"

# every deploy resolves and verifies its image in the catalog first: register the ones deployed below
"${UV[@]}" run --frozen python -m better_compute.testing.images ubuntu@24.04
if [ "$VM" = 1 ]; then
  "${UV[@]}" run --frozen python -m better_compute.testing.images bc-test-os@1 \
    --file "$BC_SIM_MEDIA_DIR/bc-test-os.raw" --url "$GUEST_MEDIA/bc-test-os.raw"
fi

DISCOVERED=$(awk '/on \(discovered\)/ {print $NF}' "$BC_STATE_DIR/sim-up.txt")
if [ -n "$DISCOVERED" ]; then
  step "bcx nodes show $DISCOVERED   (the sixth machine: nobody enrolled it, it booted discovery)"
  bcx nodes show $DISCOVERED
fi

# A verb over the fleet, then the live view until each machine rests. A verb whose workflows
# write disks gets one batch per bulk: the machines wait for it before their first boot command
# reaches them, and the approver signs it once, here, for all of them.
N=$((5 + VM))
BATCHES=()
start_bulk() {  # verb selector [args…]: one bulk verb, its batch noted
  local verb=$1 selector=$2
  shift 2
  step "bcx bulk $verb --selector $selector $*"
  local batch
  batch=$(bcx --json bulk "$verb" --selector "$selector" "$@" | json 'd["batchId"] or ""')
  echo "started; their destructive commands wait for one batch: $batch"
  BATCHES+=("$batch")
}
watch_and_approve() {  # verb: the live view of all N; each noted batch approved once they wait
  local verb=$1 log="$BC_STATE_DIR/watch-$1.log"
  step "bcx nodes watch --selector $FLEET --verb $verb   (and bcx batches approve once they wait)"
  bcx nodes watch --selector "$FLEET" --verb "$verb" --timeout 900 | tee "$log" &
  local watch=$!
  # the watch line says what a machine waits for: "waits for approvals: 0 of 1", or, as
  # `bcx why` words it, "batch … awaiting approvals (have 0 of 1)"
  local waited=0
  for _ in $(seq 1 3000); do
    if grep -qE "waits for approvals|awaiting approvals" "$log" 2>/dev/null; then waited=1; break; fi
    sleep 0.2
  done
  if [ "$waited" != 1 ]; then
    echo "demo: no machine waited for the batch's approval within 600 s (see $log)" >&2
    kill "$watch" 2>/dev/null || true
    exit 1
  fi
  for batch in "${BATCHES[@]}"; do
    echo "        >> bcx batches approve $batch --approver demo: one signature for its machines"
    bcx batches approve "$batch" --approver demo --key-file "$BC_STATE_DIR/approver.pem" --yes > /dev/null
  done
  BATCHES=()
  wait "$watch"
}
rollout() {  # verb [args…] over all N
  start_bulk "$1" "$FLEET" "${@:2}"
  watch_and_approve "$1"
}

step "bcx bulk inspect --selector $FLEET --watch   (the ramdisk boots, bcd reports the inventory)"
bcx bulk inspect --selector "$FLEET" --watch --timeout 900
if [ "$VM" = 1 ]; then
  VM_NODE=$(bcx --json nodes list --selector "site=$SITE,hw=vm" | json 'd["nodes"][0]["id"]')
  step "bcx nodes show $VM_NODE   (the VM: what the real bcd in the real ramdisk read off it)"
  bcx nodes show "$VM_NODE"
fi
rollout commission
# The installer writes the disks with nothing destructive sent: its profile says writesDisk, so
# its medium, boot device and power cycle wait for the batch too. The VM gets the shipped
# metal.deploy: its ramdisk's bcd writes the signed image and a config drive to its disk, the
# VM boots that disk, and the installed OS's bcd joins with the token the deploy left for it.
start_bulk deploy "site=$SITE,hw=sim" --profile ubuntu-24.04-autoinstall --image ubuntu@24.04
if [ "$VM" = 1 ]; then
  start_bulk deploy "site=$SITE,hw=vm" --image bc-test-os@1
fi
watch_and_approve deploy
if [ "$VM" = 1 ]; then
  # deployed = its installed OS's bcd joined; its first heartbeat follows within seconds
  for _ in $(seq 1 30); do
    bcx --json agents list --site "$SITE" --role provisioned --connected | grep -q "$VM_NODE" && break
    sleep 1
  done
  step "bcx agents list --site $SITE --role provisioned   ($VM_NODE: the VM's installed OS, its bcd joined from its disk)"
  bcx agents list --site "$SITE" --role provisioned
fi
rollout release

step "bcx sim status   (what the simulated hardware saw last)"
bcx sim status
echo
echo "the fleet's whole story (stack, simulator, $VM VM, four rollouts) in $(($(date +%s) - T0)) s"
