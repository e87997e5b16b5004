#!/usr/bin/env bash
# Small files in a real guest (issues 33 and 34): one TCG guest boots with
# a virtio-fs device per system, and runs bench/guest/smallfiles.c on each
# in turn, round after round, the systems' order rotating each round:
#   create  N files of SIZE bytes
#   stat    each (after dropping the guest's caches)
#   stat-warm  each again 2 s later, caches kept: what a second `git
#           status` or `ls -lR` asks for, once 1 s timeouts have passed
#   read    each, whole (after dropping the caches)
#   unlink  each
# A TCG vCPU is a busy host thread, so this is the load of a running
# guest, not of a halted one. Systems (all over equal RAM-backed images):
#   keelfsd         keelfsd's defaults (poll_mode adaptive), one request queue
#   keelfsd-irq     the same with poll_mode interrupt
#   keelfsd-busy    the same with poll_mode busy (not by default: it spins
#                   through the whole boot, taking CPU from every system)
#   keelfsd-noxattr keelfsd's defaults with --no-xattr (as virtiofsd's
#                   default: no GETXATTR of security.capability per new
#                   file; not by default)
#   keelfsd-base    keelfsd's defaults from another build, the binary
#                   $KEELFSD_BASE: a before/after in one boot (not by
#                   default)
#   virtiofsd       virtiofsd over ext4 on a loop device, --allow-direct-io
#   virtiofsd-pool  the same with --thread-pool-size 16
# Guest times are the guest's monotonic clock; compare systems only as
# ratios within one run. One JSON object per line on stdout and in OUT.json.
#
# Usage: bench/run-guest-smallfiles.sh [--rounds N] [--files N] [--size BYTES]
#          [--systems "keelfsd keelfsd-irq ..."] [--smp N] [OUT.json]
# Needs: root (loop devices), the test guest (qemu-scripts/build-guest.sh),
# cc, and virtiofsd (`cargo install virtiofsd`) for the virtiofsd systems.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=3 files=2000 size=4096 smp=2
systems="keelfsd keelfsd-irq virtiofsd virtiofsd-pool"
while [[ $# -gt 0 ]]; do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --files) files=$2; shift 2 ;;
    --size) size=$2; shift 2 ;;
    --systems) systems=$2; shift 2 ;;
    --smp) smp=$2; shift 2 ;;
    -*) echo "run-guest-smallfiles: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
out=${1:-bench/results/guest-smallfiles-$(date +%F).json}
command -v cc >/dev/null || { echo "run-guest-smallfiles: cc is missing (scripts/setup.sh)" >&2; exit 2; }
virtiofsd=$(command -v virtiofsd || echo "$HOME/.cargo/bin/virtiofsd")
if [[ " $systems " == *" virtiofsd"* && ! -x $virtiofsd ]]; then
  echo "run-guest-smallfiles: virtiofsd is missing (cargo install virtiofsd), or leave it out of --systems" >&2
  exit 2
fi
cargo build --release -q -p keelfsd
keelfsd=$PWD/target/release/keelfsd
work=$(mktemp -d /dev/shm/keelfs-guest-sf.XXXXXX)
pids=() loop=
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  mountpoint -q "$work/ext4" && umount "$work/ext4"
  [[ -z $loop ]] || losetup -d "$loop" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
cc -O2 -Wall -o "$work/smallfiles" bench/guest/smallfiles.c

# start SYSTEM SOCKET: the daemon behind one virtio-fs device.
start() {
  local sys=$1 socket=$2 mode
  case $sys in
    keelfsd*)
      mode=adaptive
      [[ $sys == keelfsd-irq ]] && mode=interrupt
      [[ $sys == keelfsd-busy ]] && mode=busy
      local bin=$keelfsd
      if [[ $sys == keelfsd-base ]]; then
        bin=${KEELFSD_BASE:-}
        [[ -x $bin ]] || { echo "run-guest-smallfiles: keelfsd-base needs KEELFSD_BASE=/path/to/keelfsd" >&2; exit 2; }
      fi
      fallocate -l 2G "$work/$sys.img"
      "$bin" mkfs "$work/$sys.img" --force >/dev/null
      if [[ $sys == keelfsd || $sys == keelfsd-base ]]; then
        # The defaults, poll mode included.
        "$bin" serve --device "$work/$sys.img" --socket "$socket" --rpc "$work/$sys.rpc" 2>"$work/$sys.log" &
      elif [[ $sys == keelfsd-noxattr ]]; then
        "$keelfsd" serve --device "$work/$sys.img" --socket "$socket" --rpc "$work/$sys.rpc" --no-xattr \
          2>"$work/$sys.log" &
      else
        "$keelfsd" serve --config <(printf '[daemon]\npoll_mode="%s"\nrpc_socket="%s"\n[[device]]\nname="d"\npath="%s"\n[[export]]\ntag="d"\ndevice="d"\nsocket="%s"\n' \
          "$mode" "$work/$sys.rpc" "$work/$sys.img" "$socket") 2>"$work/$sys.log" &
      fi
      ;;
    virtiofsd*)
      if [[ -z $loop ]]; then
        fallocate -l 2G "$work/ext4.img"
        mkfs.ext4 -q -F "$work/ext4.img"
        loop=$(losetup -f --show "$work/ext4.img")
        mkdir -p "$work/ext4"
        mount "$loop" "$work/ext4"
      fi
      mkdir -p "$work/ext4/$sys"
      local pool=()
      [[ $sys == virtiofsd-pool ]] && pool=(--thread-pool-size 16)
      "$virtiofsd" --socket-path "$socket" --shared-dir "$work/ext4/$sys" --cache auto --sandbox none \
        --allow-direct-io "${pool[@]}" 2>"$work/$sys.log" &
      ;;
    *) echo "run-guest-smallfiles: unknown system $sys" >&2; exit 2 ;;
  esac
  pids+=($!)
  for _ in $(seq 300); do [[ -S $socket ]] && return 0; sleep 0.1; done
  echo "run-guest-smallfiles: $sys did not create $socket" >&2
  cat "$work/$sys.log" >&2
  exit 1
}

read -r -a system_list <<<"$systems"
guest_args=()
first=1 i=0
for sys in "${system_list[@]}"; do
  socket=$work/$sys.sock
  start "$sys" "$socket"
  if ((first)); then
    guest_args+=(--socket "$socket" --tag "$sys")
    first=0
  else
    guest_args+=(--qemu-arg -chardev --qemu-arg "socket,id=sf$i,path=$socket"
      --qemu-arg -device --qemu-arg "vhost-user-fs-pci,chardev=sf$i,tag=$sys,queue-size=1024")
  fi
  i=$((i + 1))
done

cat >"$work/guest.sh" <<EOF
#!/bin/sh
set -eu
systems="$systems"
for s in \$systems; do mkdir -p /m/\$s; mount -t virtiofs \$s /m/\$s; done
r=1
while [ \$r -le $rounds ]; do
  # Rotate the order: each system goes first in some round.
  order=\$(echo \$systems | awk -v r=\$r '{ for (i = 0; i < NF; i++) printf "%s ", \$(((i + r - 1) % NF) + 1) }')
  for s in \$order; do
    d=/m/\$s/sf.\$r
    mkdir "\$d"
    for phase in create stat stat-warm read unlink; do
      if [ \$phase = stat-warm ]; then
        sleep 2
        res=\$(smallfiles "\$d" $files stat $size | sed 's/^smallfiles stat /smallfiles stat-warm /')
      else
        sync; echo 3 >/proc/sys/vm/drop_caches
        res=\$(smallfiles "\$d" $files \$phase $size)
      fi
      echo "RESULT \$r \$s \$res"
    done
    rmdir "\$d"
  done
  r=\$((r + 1))
done
EOF

log=$work/guest.log
qemu-scripts/run-guest.sh "${guest_args[@]}" --smp "$smp" --script "$work/guest.sh" \
  --add-bin "$work/smallfiles" --timeout 3600 >"$log" 2>&1 || {
  echo "run-guest-smallfiles: the guest failed; its log:" >&2
  tail -n 40 "$log" >&2
  exit 1
}
mkdir -p "$(dirname "$out")"
date=$(date -u +%FT%TZ)
grep '^RESULT ' "$log" | while read -r _ round sys _ phase n ns; do
  printf '{"bench":"guest-smallfiles","date":"%s","round":%s,"system":"%s","phase":"%s","files":%s,"size":%s,"smp":%s,"ns":%s}\n' \
    "$date" "$round" "$sys" "$phase" "$n" "$size" "$smp" "$ns"
done | tee "$out"
# What each keelfsd's idle policy ended in, and how often it switched.
for sys in "${system_list[@]}"; do
  [[ $sys == keelfsd* ]] || continue
  "$keelfsd" stats --rpc "$work/$sys.rpc" | python3 -c '
import json, sys
stats = json.load(sys.stdin)
poll = stats["reactors"][0]["poll"]
print(json.dumps({"bench": "guest-smallfiles-poll", "date": sys.argv[1], "system": sys.argv[2], **poll}))
# What the guest asked for, per opcode, over the whole run (all phases and
# rounds, and the mount): the round trips behind each phase.
ops = {op: v["requests"] for op, v in stats["exports"][0]["ops"].items()}
print(json.dumps({"bench": "guest-smallfiles-ops", "date": sys.argv[1], "system": sys.argv[2], "requests": ops}))' \
    "$date" "$sys" | tee -a "$out"
done
# Ratios against keelfsd-irq and the stronger virtiofsd, per phase (medians).
python3 - "$out" <<'EOF'
import json, statistics, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if r["bench"] == "guest-smallfiles"]
med = {}
for r in rows:
    med.setdefault((r["system"], r["phase"]), []).append(r["ns"])
med = {k: statistics.median(v) for k, v in med.items()}
systems = sorted({s for s, _ in med})
for phase in ["create", "stat", "stat-warm", "read", "unlink"]:
    line = [f"{phase:7}"]
    base = med.get(("keelfsd-irq", phase))
    vfs = [med[(s, phase)] for s in ("virtiofsd", "virtiofsd-pool") if (s, phase) in med]
    for s in systems:
        t = med[(s, phase)]
        extra = f" {t / base:.2f}x irq" if base else ""
        extra += f" {t / min(vfs):.2f}x vfsd" if vfs else ""
        line.append(f"{s} {t / 1e6:.0f} ms{extra}")
    print(" | ".join(line), file=sys.stderr)
EOF
