#!/usr/bin/env bash
# The keelfs-fs data-path benchmarks of bench/RESULTS.md (issue 4), on the
# io_uring backend over a RAM-backed image in /dev/shm.
# Usage: bench/run-core.sh [OUT.json]   (default bench/results/core-DATE.json)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results/core-$(date +%F).json}
img=/dev/shm/keelfs-bench-core.img
cargo build --release -q -p keelfs-bench
b="target/release/keelfs-bench core --path $img --json"
: > "$out"
run() { rm -f $img; $b "$@" | tee -a "$out"; }
uring() { run --backend uring "$@"; }
uring --workload dio-overwrite --size 2G --file-size 256M --threads 4 --seconds 5
uring --workload aio-append --size 4G --file-size 3G --iodepth 32 --seconds 5
# Seed 004 ran with the file in the page cache: a 1 GiB cache holds the
# 512 MiB file. The default 256 MiB cache holds half of it, and the layout
# with readers beside the writers on one reactor, for comparison.
uring --workload buffered-randrw --size 2G --file-size 512M --seconds 3 --rounds 5 --cache-size 1G
uring --workload buffered-randrw --size 2G --file-size 512M --seconds 3 --rounds 5
uring --workload buffered-randrw --size 2G --file-size 512M --seconds 3 --rounds 5 --cache-size 1G --readers-on-owner
uring --workload byte-writes --size 1G
uring --workload seq-extents --file-size 1G
uring --workload fsync-storm --size 1G --threads 32 --seconds 5
uring --workload fsync-storm --size 1G --threads 4 --seconds 5
run --workload lookup --backend mem --size 2G
rm -f $img
