#!/usr/bin/env bash
# The pause a snapshot of a large export costs its guest (issue 37's goal:
# <= 1 s for 1M files). keelfs-bench's host-side vhost-user driver makes
# --files files (each CREATE, a 1-4 KiB WRITE, RELEASE), then runs 4 KiB
# direct overwrites at QD32 for --seconds twice per round and driver:
# once alone, once with `keelfsd rpc snapshot_create` sent a second in.
# The pause is what the snapshot adds to the slowest request: lat_us_max
# with the snapshot against without. Both drivers (sleep: a halted vCPU;
# busy: a running one). The daemon runs with the defaults a user gets, on
# an image in /dev/shm. One JSON line per run, then a summary.
#
# usage: bench/run-snapshot-pause.sh [OUT.jsonl] [--files N] [--rounds N] [--seconds N]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out="" files=1000000 rounds=2 seconds=6
while (($#)); do
  case $1 in
    --files) files=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) out=$1; shift ;;
  esac
done
keelfsd=${KEELFSD:-$repo/target/release/keelfsd}
bench=${KEELFS_BENCH:-$repo/target/release/keelfs-bench}
for tool in "$keelfsd" "$bench"; do
  [[ -x $tool ]] || { echo "run-snapshot-pause.sh: $tool is missing (cargo build --release)" >&2; exit 2; }
done
command -v python3 >/dev/null || { echo "run-snapshot-pause.sh: python3 is missing" >&2; exit 2; }
work=$(mktemp -d /dev/shm/keelfs-pause.XXXXXX)
daemon=""
cleanup() {
  if [[ -n $daemon ]]; then kill "$daemon" 2>/dev/null || true; wait "$daemon" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

emit() {
  echo "$1"
  echo "$1" >>"$work/rows.jsonl"
  if [[ -n $out ]]; then echo "$1" >>"$out"; fi
}

# 16 KiB of device per inode is the default inode limit: room for --files.
size_gib=$(((files * 16 / 1024 / 1024) + 8))
"$keelfsd" mkfs "$work/keelfs.img" --size "${size_gib}G" --force >/dev/null
"$keelfsd" serve --device "$work/keelfs.img" --socket "$work/keelfs.sock" --rpc "$work/rpc.sock" \
  2>"$work/keelfsd.log" &
daemon=$!
for _ in $(seq 300); do [[ -S $work/rpc.sock ]] && break; sleep 0.05; done
[[ -S $work/rpc.sock ]] || { echo "run-snapshot-pause.sh: keelfsd never listened" >&2; cat "$work/keelfsd.log" >&2; exit 1; }
filled=$("$bench" vhost --socket "$work/keelfs.sock" --workload create --files "$files" --iodepth 32 --json)
emit "$(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); print(json.dumps({"bench":"snapshot-pause","phase":"fill","files":d.get("files"),"ops_per_s":d.get("iops")}))' "$filled")"

overwrite() {
  "$bench" vhost --socket "$work/keelfs.sock" --workload dio-overwrite --file-size 256M --seconds "$seconds" \
    --iodepth 32 --driver "$1" --daemon-pid "$daemon" --label "$2" --json
}

n=0
for round in $(seq "$rounds"); do
  for driver in sleep busy; do
    line=$(overwrite "$driver" alone)
    emit "$(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d.update(round=int(sys.argv[2]), snapshot=None); print(json.dumps(d))' "$line" "$round")"
    n=$((n + 1))
    overwrite "$driver" with-snapshot >"$work/run.json" &
    runner=$!
    # After the fill of its file: the overwrites are under way.
    sleep 4
    made=$("$keelfsd" rpc snapshot_create "{\"export\": \"keelfs\", \"name\": \"s$n\"}" --rpc "$work/rpc.sock")
    wait "$runner"
    emit "$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); m=json.loads(sys.argv[2]); d.update(round=int(sys.argv[3]), snapshot=m["name"], snapshot_took_ns=m["took_ns"]); print(json.dumps(d))' "$work/run.json" "$made" "$round")"
    "$keelfsd" rpc snapshot_delete "{\"export\": \"keelfs\", \"name\": \"s$n\"}" --rpc "$work/rpc.sock" >/dev/null
  done
done
summary=$(python3 - "$work/rows.jsonl" <<'KEELFS_SCRIPT_END'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"vhost"' in l]
out = {"bench": "snapshot-pause", "summary": True}
for driver in ("sleep", "busy"):
    alone = [r for r in rows if r["driver"] == driver and r["snapshot"] is None]
    snap = [r for r in rows if r["driver"] == driver and r["snapshot"] is not None]
    out[driver] = {
        "max_latency_ms_alone": [round(r["lat_us_max"] / 1000, 1) for r in alone],
        "max_latency_ms_with_snapshot": [round(r["lat_us_max"] / 1000, 1) for r in snap],
        "snapshot_took_ms": [round(r["snapshot_took_ns"] / 1e6) for r in snap],
        "iops_with_over_alone": [round(s["iops"] / a["iops"], 2) for a, s in zip(alone, snap)],
    }
print(json.dumps(out))
KEELFS_SCRIPT_END
)
echo "$summary"
if [[ -n $out ]]; then echo "$summary" >>"$out"; fi
