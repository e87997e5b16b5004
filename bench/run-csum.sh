#!/usr/bin/env bash
# Data checksums against none (issue 38's goals), through the host-side
# vhost-user driver: two daemons with the defaults a user gets, one
# serving an image made with `mkfs --data-checksums` and one without,
# both in /dev/shm (written whole first). Each round formats both images
# afresh and runs every workload on both, alternating which goes first
# every round and which image each has every other round (so rounds in
# multiples of 4 balance both), for both drivers (a halted
# vCPU's sleep and a running one's spin): 4 KiB direct overwrites and
# reads at QD32 on a 2 GiB file, and the 8 KiB buffered mix. keelfs-bench
# reports each daemon's CPU (--daemon-pid): the daemon's CPU is charged
# to it, the driver's to keelfs-bench. One JSON line per run, then a
# summary: median ratios checksums/plain of IOPS, of daemon CPU per
# operation and of the machine's, per workload and driver.
#
# --workloads "A B" runs only those.
# --device loop (the default) serves each image through a loop device,
# the fair device of issue 18 and of issue 38's goals: the copy into the
# guest's buffer is then the loop worker's, as a device's DMA would be.
# --device file serves the image files themselves, as the issue 38
# sections of bench/RESULTS.md before 2026-12-06 (evening) did: io_uring
# punts reads of a tmpfs file to its own workers, which are charged to
# the daemon.
# Needs: root, for the loop devices (--device loop).
# The defaults, 4 rounds of 20 s runs (about 25 minutes for all three),
# are what bench/RESULTS.md reports: each run starts by refilling its
# file, whose aftermath weighs on short runs, and single rounds swing.
#
# usage: bench/run-csum.sh [OUT.jsonl] [--rounds N] [--seconds N] [--workloads LIST]
#                          [--device loop|file]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out="" rounds=4 seconds=20 workloads="dio-overwrite dio-read buffered-randrw" device=loop
while (($#)); do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --workloads) workloads=$2; shift 2 ;;
    --device) device=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) out=$1; shift ;;
  esac
done
keelfsd=${KEELFSD:-$repo/target/release/keelfsd}
bench=${KEELFS_BENCH:-$repo/target/release/keelfs-bench}
for tool in "$keelfsd" "$bench"; do
  [[ -x $tool ]] || { echo "run-csum.sh: $tool is missing (cargo build --release)" >&2; exit 2; }
done
command -v python3 >/dev/null || { echo "run-csum.sh: python3 is missing" >&2; exit 2; }
case $device in
  loop) command -v losetup >/dev/null || { echo "run-csum.sh: losetup is missing" >&2; exit 2; } ;;
  file) ;;
  *) echo "run-csum.sh: --device is loop or file, not $device" >&2; exit 2 ;;
esac
work=$(mktemp -d /dev/shm/keelfs-csum.XXXXXX)
pids=() loops=()
stop_daemons() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
  pids=()
}
cleanup() {
  stop_daemons
  for l in "${loops[@]}"; do losetup -d "$l" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

# Two images, a and b, whose roles swap every other round (fresh
# filesystems each time): an image file and its loop device can carry a
# bias of their own through a whole invocation (one image was the slower
# for whichever daemon served it, in runs of 6 and 8 rounds on 2026-12-06),
# which alternating only the order would leave in the ratio. The order
# alternates every round, the images every other, so that each mode has
# each image and each place in the order equally often over 4 rounds.
declare -A pid_of dev_of image_of
for image in a b; do
  dd if=/dev/zero of="$work/$image.img" bs=1M count=6144 status=none
  dev_of[$image]=$work/$image.img
  if [[ $device == loop ]]; then
    dev_of[$image]=$(losetup -f --show "$work/$image.img")
    loops+=("${dev_of[$image]}")
  fi
done

# Format the images for round $1 and serve each with its own daemon.
start_daemons() {
  image_of[plain]=a image_of[csum]=b
  (((($1 - 1) / 2) % 2 == 1)) && image_of[plain]=b image_of[csum]=a
  for mode in plain csum; do
    local dev=${dev_of[${image_of[$mode]}]} flags=()
    [[ $mode == csum ]] && flags=(--data-checksums)
    "$keelfsd" mkfs "$dev" --force "${flags[@]}" >/dev/null
    rm -f "$work/$mode.sock"
    "$keelfsd" serve --device "$dev" --socket "$work/$mode.sock" --tag "$mode" 2>"$work/$mode.log" &
    pid_of[$mode]=$!
    pids+=("$!")
    for _ in $(seq 300); do [[ -S $work/$mode.sock ]] && break; sleep 0.05; done
    [[ -S $work/$mode.sock ]] || { echo "run-csum.sh: keelfsd ($mode) never listened" >&2; cat "$work/$mode.log" >&2; exit 1; }
  done
}

for round in $(seq "$rounds"); do
  stop_daemons
  start_daemons "$round"
  order=(plain csum)
  ((round % 2 == 0)) && order=(csum plain)
  for workload in $workloads; do
    for driver in sleep busy; do
      for mode in "${order[@]}"; do
        depth=32
        [[ $workload == buffered-randrw ]] && depth=4
        line=$("$bench" vhost --socket "$work/$mode.sock" --workload "$workload" --file-size 2G \
          --seconds "$seconds" --iodepth "$depth" --driver "$driver" --daemon-pid "${pid_of[$mode]}" \
          --label "keelfs-$mode" --json)
        line=$(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d["round"]=int(sys.argv[2]); d["mode"]=sys.argv[3]; d["device"]=sys.argv[4]; d["image"]=sys.argv[5]; print(json.dumps(d))' \
          "$line" "$round" "$mode" "$device" "${image_of[$mode]}")
        echo "$line"
        echo "$line" >>"$work/rows.jsonl"
        if [[ -n $out ]]; then echo "$line" >>"$out"; fi
      done
    done
  done
done
summary=$(python3 - "$work/rows.jsonl" <<'KEELFS_SCRIPT_END'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
out = {"bench": "data-checksums", "summary": True}
def cpu_per_op(r):
    return r.get("daemon_cpu_us_per_op")
for workload in sorted({r["workload"] for r in rows}):
    for driver in ("sleep", "busy"):
        pick = lambda mode: [r for r in rows if r["workload"] == workload and r["driver"] == driver and r["mode"] == mode]
        plain, csum = pick("plain"), pick("csum")
        if not plain or not csum:
            continue
        iops = [c["iops"] / p["iops"] for p, c in zip(plain, csum)]
        entry = {"iops_ratio_median": round(statistics.median(iops), 3), "iops_ratio_per_round": [round(x, 3) for x in iops]}
        cpu = [cpu_per_op(c) / cpu_per_op(p) for p, c in zip(plain, csum) if cpu_per_op(p) and cpu_per_op(c)]
        if cpu:
            entry["daemon_cpu_per_op_ratio_median"] = round(statistics.median(cpu), 3)
        # The whole machine's: with --device loop the copies are the loop
        # workers', charged to no process of the run.
        machine = [c["machine_cpu_us_per_op"] / p["machine_cpu_us_per_op"] for p, c in zip(plain, csum)
                   if p.get("machine_cpu_us_per_op") and c.get("machine_cpu_us_per_op")]
        if machine:
            entry["machine_cpu_per_op_ratio_median"] = round(statistics.median(machine), 3)
        out[f"{workload}/{driver}"] = entry
print(json.dumps(out))
KEELFS_SCRIPT_END
)
echo "$summary"
if [[ -n $out ]]; then echo "$summary" >>"$out"; fi
