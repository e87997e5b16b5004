#!/usr/bin/env bash
# Metadata at scale (issue 18): for each file count, in separate processes
# so that each memory figure is its own:
#   1. keelfs-bench core --workload metadata-fill: N empty files in
#      directories of 1,000 (names of 35 bytes), a checkpoint, an unmount;
#   2. keelfs-bench core --workload metadata-mount: mount time and RSS;
#   3. keelfsd fsck: wall time and peak RSS (/usr/bin/time);
#   4. keelfsd serve --fuse-mount: time until it answers through the mount, the
#      daemon's RSS then, and `find | wc -l` through it (up to --walk-max
#      files: the host kernel keeps an inode and a dentry for each file
#      walked, about 1 KiB, which at 10M files would not fit beside the
#      rest on this machine).
# The image is a sparse file in /dev/shm (uring backend). One JSON object
# per line on stdout and in OUT.json.
#
# Usage: bench/run-metadata.sh [--files "1000000 10000000"] [--walk-max N] [OUT.json]
# Needs: root (the host mount), /usr/bin/time.
set -euo pipefail
cd "$(dirname "$0")/.."
files_list="1000000 10000000" walk_max=2000000
while [[ $# -gt 0 ]]; do
  case $1 in
    --files) files_list=$2; shift 2 ;;
    --walk-max) walk_max=$2; shift 2 ;;
    *) break ;;
  esac
done
out=${1:-bench/results/metadata-$(date +%F).json}
[[ -x /usr/bin/time ]] || { echo "run-metadata: /usr/bin/time is missing (apt-get install time)" >&2; exit 2; }
cargo build --release -q -p keelfsd -p keelfs-bench
keelfsd=$PWD/target/release/keelfsd
bench=$PWD/target/release/keelfs-bench
work=$(mktemp -d /dev/shm/keelfs-metadata.XXXXXX)
daemon_pid=
cleanup() {
  if [[ -n $daemon_pid ]]; then kill -TERM "$daemon_pid" 2>/dev/null; wait "$daemon_pid" 2>/dev/null || true; fi
  mountpoint -q "$work/mnt" && umount -l "$work/mnt"
  rm -rf "$work"
}
trap cleanup EXIT

# rss_kib PID: VmRSS of a process and its children (the sandbox's server).
rss_kib() {
  local total=0 pid kib
  for pid in $1 $(pgrep -P "$1" || true); do
    kib=$(awk '/^VmRSS:/ { print $2 }' "/proc/$pid/status" 2>/dev/null || echo 0)
    total=$((total + ${kib:-0}))
  done
  echo "$total"
}

: >"$out"
for files in $files_list; do
  img=$work/meta.img
  rm -f "$img"
  "$bench" core --workload metadata-fill --backend uring --path "$img" --entries "$files" --json | tee -a "$out"
  "$bench" core --workload metadata-mount --backend uring --path "$img" --entries "$files" --json | tee -a "$out"
  /usr/bin/time -f '%e %M' -o "$work/fsck.time" "$keelfsd" fsck "$img" >"$work/fsck.log" 2>&1 ||
    { echo "run-metadata: fsck found damage:" >&2; cat "$work/fsck.log" >&2; exit 1; }
  read -r fsck_s fsck_kib <"$work/fsck.time"
  printf '{"bench":"metadata","workload":"fsck","files":%d,"fsck_s":%s,"fsck_rss_mib":%d}\n' \
    "$files" "$fsck_s" $((fsck_kib / 1024)) | tee -a "$out"

  mkdir -p "$work/mnt"
  t0=$(date +%s%N)
  "$keelfsd" serve --device "$img" --fuse-mount "$work/mnt" --sandbox none --cache auto 2>"$work/serve.log" &
  daemon_pid=$!
  until mountpoint -q "$work/mnt"; do
    kill -0 "$daemon_pid" 2>/dev/null || { echo "run-metadata: keelfsd exited:" >&2; cat "$work/serve.log" >&2; exit 1; }
    sleep 0.01
  done
  # The mount appears before the filesystem is loaded: the first answer
  # (the root's attributes) comes once it is.
  stat "$work/mnt/dir-000000" >/dev/null
  t1=$(date +%s%N)
  rss=$(rss_kib "$daemon_pid")
  t2=$t1
  if ((files <= walk_max)); then
    seen=$(find "$work/mnt" -type f | wc -l)
    t2=$(date +%s%N)
    [[ $seen -eq $files ]] || { echo "run-metadata: $seen files through the mount, expected $files" >&2; exit 1; }
  fi
  kill -TERM "$daemon_pid"; wait "$daemon_pid"; daemon_pid=
  awk -v f="$files" -v a="$t0" -v b="$t1" -v c="$t2" -v rss="$rss" 'BEGIN {
    printf "{\"bench\":\"metadata\",\"workload\":\"serve\",\"files\":%d,\"serve_to_mounted_s\":%.3f,", f, (b - a) / 1e9
    printf "\"daemon_rss_mib\":%d,\"daemon_rss_bytes_per_file\":%d,", rss / 1024, rss * 1024 / f
    if (c > b) printf "\"find_s\":%.3f}\n", (c - b) / 1e9; else printf "\"find_s\":null}\n"
  }' | tee -a "$out"
  rm -f "$img"
done
echo "run-metadata: results in $out" >&2
