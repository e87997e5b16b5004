#!/usr/bin/env bash
# The block-device benchmark of bench/RESULTS.md: keelfs's backends against
# fio's io_uring engine on the same 1 GiB RAM-backed file, rounds interleaved.
# Usage: bench/run-bdev.sh [OUT.json]   (default bench/results/bdev-DATE.json)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results/bdev-$(date +%F).json}
img=/dev/shm/keelfs-bench-bdev.img
cargo build --release -q -p keelfs-bench
bin=target/release/keelfs-bench
: > "$out"
for fixed in "" --fixed-buffers; do
  for rw in randread randwrite; do
    $bin bdev --backend uring --path $img --size 1G --rw $rw --bs 4k --iodepth 32 \
      --seconds 5 --rounds 3 --vs-fio $fixed --json | tee -a "$out"
  done
done
for rw in randread randwrite; do
  $bin bdev --backend pmem --path $img --size 1G --rw $rw --bs 4k --iodepth 32 \
    --seconds 5 --rounds 3 --vs-fio --json | tee -a "$out"
done
rm -f $img
