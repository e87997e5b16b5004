#!/usr/bin/env bash
# The calm export's side of bench/run-hostile.sh, seen from the daemon:
# one keelfsd (KEELFSD, default target/release/keelfsd) with one reactor
# and two exports on RAM-backed images, keelfs-bench vhost (dio-randrw,
# --iodepth 8) on the calm one, alone or beside keelfs-bench hostile
# (--depth 32) on the other; then the daemon's own latency percentiles
# for the calm export's READs and WRITEs (`keelfsd rpc stats`) and the
# reactor's fair-share counters, as one JSON line. A fresh daemon per
# call, so the percentiles are this phase's alone. NICE="nice -n 19"
# runs the hostile client at the lowest priority, so that it does not
# take CPU from the calm client on a machine short of cores.
#
# usage: bench/hostile-latency.sh alone|beside [sleep|busy]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
keelfsd=${KEELFSD:-$repo/target/release/keelfsd}
bench=$repo/target/release/keelfs-bench
mode=${1:?alone or beside}
driver=${2:-sleep}
[[ $mode == alone || $mode == beside ]] || { echo "hostile-latency.sh: alone or beside, not '$mode'" >&2; exit 2; }
for bin in "$keelfsd" "$bench"; do
  [[ -x $bin ]] || { echo "hostile-latency.sh: $bin is missing (cargo build --release)" >&2; exit 2; }
done
work=$(mktemp -d /dev/shm/keelfs-hostile-latency.XXXXXX)
daemon=""
cleanup() {
  if [[ -n $daemon ]]; then kill "$daemon" 2>/dev/null || true; wait "$daemon" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
printf '[daemon]\nreactors = 1\nrpc_socket = "%s/rpc.sock"\n' "$work" >"$work/keelfsd.toml"
. "$repo/bench/two_exports.sh"
append_two_exports "$keelfsd" "$work" "$work/keelfsd.toml"
"$keelfsd" serve --config "$work/keelfsd.toml" 2>"$work/keelfsd.log" &
daemon=$!
for _ in $(seq 300); do [[ -S $work/calm.sock && -S $work/hostile.sock ]] && break; sleep 0.05; done
[[ -S $work/calm.sock && -S $work/hostile.sock ]] || { echo "hostile-latency.sh: keelfsd never bound its sockets" >&2; exit 1; }
attacker=""
if [[ $mode == beside ]]; then
  # shellcheck disable=SC2086 # NICE is a command prefix, split on purpose
  ${NICE:-} "$bench" hostile --socket "$work/hostile.sock" --seconds 5 --depth 32 --json >"$work/hostile.json" &
  attacker=$!
  sleep 0.5
fi
"$bench" vhost --socket "$work/calm.sock" --workload dio-randrw --iodepth 8 --file-size 32M --driver "$driver" \
  --seconds 3 --json >"$work/calm.json"
if [[ -n $attacker ]]; then wait "$attacker"; fi
"$keelfsd" rpc stats --rpc "$work/rpc.sock" >"$work/stats.json"
python3 - "$keelfsd" "$mode" "$driver" "$work/calm.json" "$work/stats.json" <<'PY'
import json, sys
keelfsd, mode, driver, calm, stats = sys.argv[1:]
run = json.load(open(calm))
snapshot = json.load(open(stats))
export = next(e for e in snapshot["exports"] if e["tag"] == "calm")
reactor = snapshot["reactors"][0]
ops = export["ops"]
print(json.dumps({
    "bench": "hostile-latency", "keelfsd": keelfsd, "mode": mode, "driver": driver, "calm_iops": run["iops"],
    "read_p50_us": ops.get("read", {}).get("p50_us"), "read_p99_us": ops.get("read", {}).get("p99_us"),
    "write_p50_us": ops.get("write", {}).get("p50_us"), "write_p99_us": ops.get("write", {}).get("p99_us"),
    "shares": reactor.get("shares"), "reactor_busy_share": reactor["busy_share"],
}))
PY
