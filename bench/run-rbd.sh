#!/usr/bin/env bash
# keelfs's RBD backend against QEMU's own rbd block driver (issue 22), in
# one invocation, rounds interleaved: `keelfs-bench bdev --backend rbd` on
# one image and, right after it with the same parameters, `qemu-img bench`
# on a second image of the same size in the same pool (`--vs-qemu-img`).
# QEMU's driver is what a virtio-blk guest's requests go through, so its
# figures are the block-device ceiling such a guest would see; guests here
# run under TCG, so both are driven from the host.
#
# qemu-img bench can only step through the image (each offset is the
# previous one plus --step-size, wrapping at the image's end), so both
# sides do exactly that: the 4k workloads step 4099 blocks (16 MiB +
# 12 KiB), so consecutive requests land in different 4 MiB RBD objects
# and, 4099 being odd, every block of the image is visited before any
# twice; the 1 MiB workload is plain sequential. keelfs-bench also runs
# true random 4k reads and writes, alone, to show what the step changes.
#
# Both clients run with rbd_cache off (qemu-img -t none) and sleep while
# their requests are in flight (keelfs-bench --wait eventfd; qemu-img's
# event loop). The "-spin" workloads poll instead, as keelfsd's reactor
# does while it has work.
#
# Which client goes first alternates over rounds: writes leave the OSD
# background work that the next run pays for. qemu-img bench runs a count
# of requests, not a time: second, it does as many as keelfs-bench just
# did; first, as many as a short probe's rate gives in --seconds.
#
# CPU per request: each client's own process (utime + stime, librbd's
# threads included; qemu-img's start-up, measured on a 1-request run, is
# subtracted), and the OSD's over the same run (charged to neither).
#
# The images are written in full first: a read of a never-written RBD
# object never reaches the OSD.
#
# What the run writes is bounded (--count on each write workload: 256 MiB
# per side for 4k, 512 MiB for 1 MiB), and it stops when the host has less
# than --min-avail MiB of memory available: the dev cluster's OSD keeps
# BlueStore on a loop device over a sparse file in /dev/shm, larger than
# RAM, so the live data in the cluster takes RAM until BlueStore frees and
# discards it. Unbounded 1 MiB write rounds drove this host out of memory
# once, before the OSD discarded (then, nothing written was given back).
#
# Usage: bench/run-rbd.sh [--rounds N] [--seconds N] [--pool POOL]
#                         [--size SIZE] [--min-avail MiB] [OUT.json]
# Needs: a Ceph cluster with one OSD on this host (scripts/ceph-dev.sh up),
# /etc/ceph's conf and admin keyring, qemu-img with its rbd driver
# (qemu-utils, qemu-block-extra).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=3 seconds=5 pool=keelfs size=512M min_avail=4096
while [[ $# -gt 0 ]]; do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --pool) pool=$2; shift 2 ;;
    --size) size=$2; shift 2 ;;
    --min-avail) min_avail=$2; shift 2 ;;
    -h|--help) sed -n '2,47p' "bench/${0##*/}"; exit 0 ;;
    -*) echo "run-rbd: unknown option '$1' (--help)" >&2; exit 2 ;;
    *) break ;;
  esac
done
# Stop (cleanly, removing the images) when memory runs low.
# shellcheck source=bench/memory.sh
. bench/memory.sh
check_memory() { stop_below_min_avail run-rbd "$min_avail"; }
check_memory
out=${1:-bench/results/rbd-$(date +%F).json}
mapfile -t osds < <(pgrep -x ceph-osd)
if [[ ${#osds[@]} -ne 1 ]]; then
  echo "run-rbd: wants exactly one ceph-osd on this host (scripts/ceph-dev.sh up), found ${#osds[@]}" >&2
  exit 2
fi
osd=${osds[0]}
cargo build --release -q -p keelfs-bench
bench=${CARGO_TARGET_DIR:-$PWD/target}/release/keelfs-bench
ours=bench-rbd-keelfs-$$ peer=bench-rbd-qemu-$$
cleanup() {
  rbd rm --no-progress "$pool/$ours" 2>/dev/null || true
  rbd rm --no-progress "$pool/$peer" 2>/dev/null || true
}
trap cleanup EXIT
bytes=$(numfmt --from=iec "$size")
for img in "$ours" "$peer"; do
  rbd create --size "$((bytes >> 20))M" "$pool/$img"
  qemu-img bench -q -f raw -t none -w --pattern=90 -s 4M -d 8 -c "$((bytes >> 22))" "rbd:$pool/$img"
done

stride=$((4099 * 4096))
w4k=--count=65536 w1m=--count=512
# label | keelfs-bench flags | with the qemu-img peer
workloads=(
  "read-4k-qd16|--rw read --step $stride --bs 4k --iodepth 16 --wait eventfd|peer"
  "write-4k-qd16|--rw write --step $stride --bs 4k --iodepth 16 --wait eventfd $w4k|peer"
  "write-4k-qd1|--rw write --step $stride --bs 4k --iodepth 1 --wait eventfd $w4k|peer"
  "write-1m-qd4|--rw write --bs 1M --iodepth 4 --wait eventfd $w1m|peer"
  "read-1m-qd4|--rw read --bs 1M --iodepth 4 --wait eventfd|peer"
  "read-4k-qd16-spin|--rw read --step $stride --bs 4k --iodepth 16 --wait spin|peer"
  "write-4k-qd1-spin|--rw write --step $stride --bs 4k --iodepth 1 --wait spin $w4k|peer"
  "randread-4k-qd16|--rw randread --bs 4k --iodepth 16 --wait eventfd|"
  "randwrite-4k-qd16|--rw randwrite --bs 4k --iodepth 16 --wait eventfd $w4k|"
)
: >"$out"
for round in $(seq "$rounds"); do
  for line in "${workloads[@]}"; do
    IFS='|' read -r label flags with_peer <<<"$line"
    check_memory
    peer_flags=()
    if [[ -n $with_peer ]]; then
      peer_flags=(--vs-qemu-img "rbd:$pool/$peer")
      ((round % 2)) || peer_flags+=(--peer-first)
    fi
    # shellcheck disable=SC2086  # $flags is a list of options: split on purpose
    "$bench" bdev --backend rbd --path "rbd:$pool/$ours" --size "$size" $flags --seconds "$seconds" \
      --osd-pid "$osd" "${peer_flags[@]}" --json |
      sed "s/^{/{\"round\":$round,\"label\":\"$label\",/" | tee -a "$out"
  done
done
echo "run-rbd: results in $out" >&2
python3 bench/headline.py "$out" >&2
