#!/usr/bin/env bash
# Copy-on-write overwrites against plain ones (issue 37's goal: >= 0.5x),
# through the host-side vhost-user driver: keelfs-bench fills a 2 GiB file
# per run, then for `shared` clones it to a twin (FUSE_COPY_FILE_RANGE),
# and writes 4 KiB direct at QD32 in a fixed permutation of its blocks
# (--once), so that every write of a shared run copies on write. One
# daemon with the defaults a user gets, on an image in /dev/shm (written
# whole first); plain and
# shared alternate within each round, for both drivers (a halted vCPU's
# sleep and a running one's spin). One JSON line per run, then a summary
# with the median ratio shared/plain per driver.
#
# usage: bench/run-cow.sh [OUT.jsonl] [--rounds N] [--seconds N]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out="" rounds=3 seconds=4
while (($#)); do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) out=$1; shift ;;
  esac
done
keelfsd=${KEELFSD:-$repo/target/release/keelfsd}
bench=${KEELFS_BENCH:-$repo/target/release/keelfs-bench}
for tool in "$keelfsd" "$bench"; do
  [[ -x $tool ]] || { echo "run-cow.sh: $tool is missing (cargo build --release)" >&2; exit 2; }
done
command -v python3 >/dev/null || { echo "run-cow.sh: python3 is missing" >&2; exit 2; }
work=$(mktemp -d /dev/shm/keelfs-cow.XXXXXX)
daemon=""
cleanup() {
  if [[ -n $daemon ]]; then kill "$daemon" 2>/dev/null || true; wait "$daemon" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

# Every block written before the runs: a copy on write goes to blocks the
# image never held, and tmpfs charges a page's first write (allocation,
# and zeroing even after fallocate) to the shared runs only, which no
# real device does.
dd if=/dev/zero of="$work/keelfs.img" bs=1M count=8192 status=none
"$keelfsd" mkfs "$work/keelfs.img" --size 8G --force >/dev/null
"$keelfsd" serve --device "$work/keelfs.img" --socket "$work/keelfs.sock" 2>"$work/keelfsd.log" &
daemon=$!
for _ in $(seq 300); do [[ -S $work/keelfs.sock ]] && break; sleep 0.05; done
[[ -S $work/keelfs.sock ]] || { echo "run-cow.sh: keelfsd never listened" >&2; cat "$work/keelfsd.log" >&2; exit 1; }

for round in $(seq "$rounds"); do
  for driver in sleep busy; do
    for mode in plain shared; do
      flags=()
      [[ $mode == shared ]] && flags=(--shared)
      line=$("$bench" vhost --socket "$work/keelfs.sock" --workload dio-overwrite --file-size 2G --once \
        "${flags[@]}" --seconds "$seconds" --iodepth 32 --driver "$driver" --daemon-pid "$daemon" \
        --label "keelfs-$mode" --json)
      line=$(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d["round"]=int(sys.argv[2]); print(json.dumps(d))' \
        "$line" "$round")
      echo "$line"
      echo "$line" >>"$work/rows.jsonl"
      if [[ -n $out ]]; then echo "$line" >>"$out"; fi
    done
  done
done
summary=$(python3 - "$work/rows.jsonl" <<'KEELFS_SCRIPT_END'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
out = {"bench": "cow-overwrite", "summary": True}
for driver in ("sleep", "busy"):
    med = {m: statistics.median(r["iops"] for r in rows if r["driver"] == driver and r["shared"] == (m == "shared"))
           for m in ("plain", "shared")}
    ratios = [s["iops"] / p["iops"] for p, s in zip(
        [r for r in rows if r["driver"] == driver and not r["shared"]],
        [r for r in rows if r["driver"] == driver and r["shared"]])]
    out[driver] = {"median_iops": med, "shared_over_plain": round(med["shared"] / med["plain"], 2),
                   "per_round": [round(x, 2) for x in ratios],
                   "max_writes_per_block": max(r["writes_per_block"] for r in rows if r["driver"] == driver)}
print(json.dumps(out))
KEELFS_SCRIPT_END
)
echo "$summary"
if [[ -n $out ]]; then echo "$summary" >>"$out"; fi
