#!/usr/bin/env bash
# Record the FUSE requests of a real small-file workload on a host mount of
# keelfs (keelfsd serve --trace-requests), for `keelfs-bench vhost
# --workload trace` to replay against any vhost-user-fs daemon. The
# workload leaves the tree as it found it, so a replay can repeat it:
#   untar TARBALL (a source tarball: a .crate from ~/.cargo/registry is one),
#   stat every entry (find -ls), read every file, remove the tree,
# then stop the daemon, which unmounts.
# The trace keeps names and sizes, not file data.
#
# Usage: bench/record-trace.sh TARBALL OUT.trace
# Needs: root (the host mount).
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $# -eq 2 ]] || { sed -n '12p' "$0" >&2; exit 2; }
tarball=$(realpath "$1") out=$(realpath -m "$2")
[[ -f $tarball ]] || { echo "record-trace: $tarball is not a file" >&2; exit 2; }
cargo build --release -q -p keelfsd
keelfsd=$PWD/target/release/keelfsd
work=$(mktemp -d /dev/shm/keelfs-record.XXXXXX)
daemon_pid=
cleanup() {
  if [[ -n $daemon_pid ]]; then kill -TERM "$daemon_pid" 2>/dev/null; wait "$daemon_pid" 2>/dev/null || true; fi
  mountpoint -q "$work/mnt" && umount -l "$work/mnt"
  rm -rf "$work"
}
trap cleanup EXIT

"$keelfsd" mkfs "$work/img" --size 1G >/dev/null
mkdir "$work/mnt"
"$keelfsd" serve --device "$work/img" --fuse-mount "$work/mnt" --sandbox none --trace-requests "$out" \
  2>"$work/serve.log" &
daemon_pid=$!
until mountpoint -q "$work/mnt"; do
  kill -0 "$daemon_pid" 2>/dev/null || { echo "record-trace: keelfsd exited:" >&2; cat "$work/serve.log" >&2; exit 1; }
  sleep 0.01
done
tar xf "$tarball" -C "$work/mnt"
find "$work/mnt" -ls >/dev/null
find "$work/mnt" -type f -exec cat {} + >/dev/null
find "$work/mnt" -mindepth 1 -delete
kill -TERM "$daemon_pid"
wait "$daemon_pid"
daemon_pid=
echo "record-trace: $(stat -c %s "$out") bytes in $out" >&2
