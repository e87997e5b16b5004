#!/usr/bin/env bash
# What holding a guest's locks costs its small files (issue 36): with
# keelfs holding them (--locks export) every close sends FLUSH, which
# FOPEN_NOFLUSH spares otherwise. Two keelfsd of one build, each on a
# RAM image of its own, one with --locks export and one with --locks
# client; keelfs-bench vhost (whose driver offers POSIX and flock locks,
# as Linux's virtio-fs does) makes a tree on each, then runs
# open-read-close on one and then the other, the order alternating by
# round, with each kind of driver (sleep: a halted vCPU; busy: a running
# one). One JSON object per line, tagged "locks", "driver" and "round".
#
# Usage: bench/locks-flush.sh BIN_DIR [--rounds N] [--files N] [--seconds N] [OUT.jsonl]
#   BIN_DIR holds a release keelfsd and keelfs-bench.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $# -ge 1 ]] || { sed -n '11,12p' "$0" >&2; exit 2; }
bin=$1
shift
rounds=3 files=2000 seconds=5
while [[ $# -gt 0 ]]; do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --files) files=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    *) break ;;
  esac
done
out=${1:-/dev/null}
for b in keelfsd keelfs-bench; do
  [[ -x $bin/$b ]] || { echo "locks-flush: $bin/$b is not an executable" >&2; exit 2; }
done
work=$(mktemp -d /dev/shm/keelfs-locks-flush.XXXXXX)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

declare -A pid_of
for mode in export client; do
  "$bin/keelfsd" mkfs "$work/$mode.img" --size 1G --force >/dev/null 2>&1
  "$bin/keelfsd" serve --device "$work/$mode.img" --socket "$work/$mode.sock" --locks "$mode" \
    >"$work/$mode.log" 2>&1 &
  pids+=($!)
  pid_of[$mode]=$!
  for _ in $(seq 1 100); do [[ -S $work/$mode.sock ]] && break; sleep 0.1; done
  [[ -S $work/$mode.sock ]] || { echo "locks-flush: keelfsd --locks $mode did not start" >&2; exit 1; }
  "$bin/keelfs-bench" vhost --socket "$work/$mode.sock" --workload create --files "$files" --json >/dev/null
done

# tagged MODE DRIVER ROUND: prefix each JSON line on stdin with the tags.
tagged() { sed "s/^{/{\"locks\":\"$1\",\"driver\":\"$2\",\"round\":$3,/"; }

: >"$out"
for round in $(seq 1 "$rounds"); do
  order=(export client)
  ((round % 2 == 0)) && order=(client export)
  for driver in sleep busy; do
    for mode in "${order[@]}"; do
      "$bin/keelfs-bench" vhost --socket "$work/$mode.sock" --workload open-read-close --files "$files" \
        --seconds "$seconds" --driver "$driver" --daemon-pid "${pid_of[$mode]}" --label "locks-$mode" --json |
        tagged "$mode" "$driver" "$round" | tee -a "$out"
    done
  done
done
