#!/usr/bin/env bash
# What moving a guest's session adds to a live migration's downtime, for
# keelfsd and virtiofsd side by side in one run: keelfs-bench migrate
# looks up --inodes files and opens --handles on a source daemon, then
# saves its state and loads it into a destination daemon as QEMU does at
# switch-over (see bench/src/migrate.rs). keelfsd: two daemons on one
# image in /dev/shm (the destination --incoming). virtiofsd: two on one
# tmpfs directory. Prints one JSON line per system; with OUT, appends
# them to OUT too.
#
# usage: bench/run-migrate.sh [OUT.json] [--inodes N] [--handles N]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=""
inodes=100000
handles=1000
while (($#)); do
  case $1 in
    --inodes) inodes=$2; shift 2 ;;
    --handles) handles=$2; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) out=$1; shift ;;
  esac
done
keelfsd=$repo/target/release/keelfsd
bench=$repo/target/release/keelfs-bench
virtiofsd=$(command -v virtiofsd || echo "$HOME/.cargo/bin/virtiofsd")
for bin in "$keelfsd" "$bench" "$virtiofsd"; do
  [[ -x $bin ]] || { echo "run-migrate.sh: $bin is missing (cargo build --release; cargo install virtiofsd)" >&2; exit 2; }
done
work=$(mktemp -d /dev/shm/keelfs-migrate.XXXXXX)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

wait_socket() {
  for _ in $(seq 200); do [[ -S $1 ]] && return 0; sleep 0.05; done
  echo "run-migrate.sh: $1 never appeared" >&2
  exit 1
}

run() {
  local label=$1 src=$2 dst=$3 line
  line=$("$bench" migrate --source "$src" --dest "$dst" --inodes "$inodes" --handles "$handles" \
    --label "$label" --json)
  echo "$line"
  if [[ -n $out ]]; then echo "$line" >>"$out"; fi
}

# A 4 GiB image holds 262144 inodes (one per 16 KiB).
"$keelfsd" mkfs "$work/image" --size 4G >/dev/null 2>&1
"$keelfsd" serve --device "$work/image" --socket "$work/k1.sock" --tag bench --sandbox none \
  2>"$work/k1.log" &
pids+=($!)
"$keelfsd" serve --device "$work/image" --socket "$work/k2.sock" --tag bench --sandbox none --incoming \
  2>"$work/k2.log" &
pids+=($!)
wait_socket "$work/k1.sock"
wait_socket "$work/k2.sock"
run keelfsd "$work/k1.sock" "$work/k2.sock"
kill "${pids[@]}"
wait 2>/dev/null || true
pids=()
"$keelfsd" fsck "$work/image" >/dev/null 2>"$work/fsck.log" || { cat "$work/fsck.log" >&2; exit 1; }

mkdir "$work/shared"
for n in 1 2; do
  "$virtiofsd" --socket-path "$work/v$n.sock" --shared-dir "$work/shared" --allow-direct-io \
    2>"$work/v$n.log" &
  pids+=($!)
done
wait_socket "$work/v1.sock"
wait_socket "$work/v2.sock"
run virtiofsd "$work/v1.sock" "$work/v2.sock"
