#!/usr/bin/env bash
# How much of its IOPS an export keeps beside a hostile neighbour on the
# same reactor (issue 16): one keelfsd reactor serving two exports on
# RAM-backed images; keelfs-bench vhost (dio-randrw, --iodepth CALM) on
# the calm one, alone and then beside keelfs-bench hostile (--depth
# HOSTILE: absurd ranges, huge reads, unknown opcodes, long names) on the
# other, rounds alternating so that both see the same machine. Prints one
# JSON line per round and a summary line with the ratio of the sums; with
# OUT, appends them to OUT too. bench/tests/hostile_neighbour.rs checks
# the same set-up for liveness only (every hostile request answered, the
# calm export served); the ratio is a measurement, kept here.
# KEELFSD=PATH runs another build of keelfsd (an A/B of two builds: run
# the script once with each, alternating).
# --burner BUSY_US:IDLE_US is the control: instead of the hostile client,
# a process that sends keelfs nothing and only takes CPU, spinning
# BUSY_US then sleeping IDLE_US, over and over (120:900 takes about what
# `keelfs-bench hostile --depth 32` takes of a core here, 14%). What the
# calm export loses beside it is the host's doing, not the reactor's.
# Each round's line also gives the attacker's CPU (attacker_cpu_share, of
# a core, user and system) and the reactor's busy share while the calm
# client ran alone and beside (keelfsd's stats), so that a burner can be
# matched to what the hostile client's traffic costs in all.
#
# usage: bench/run-hostile.sh [OUT.json] [--rounds N] [--calm-depth N] [--hostile-depth N]
#                             [--driver sleep|busy] [--burner BUSY_US:IDLE_US]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=""
rounds=3
calm_depth=8
hostile_depth=8
driver="sleep"
burner=""
while (($#)); do
  case $1 in
    --burner) burner=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --calm-depth) calm_depth=$2; shift 2 ;;
    --hostile-depth) hostile_depth=$2; shift 2 ;;
    --driver) driver=$2; shift 2 ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) out=$1; shift ;;
  esac
done
[[ -z $burner || $burner =~ ^[0-9]+:[0-9]+$ ]] || { echo "run-hostile.sh: --burner BUSY_US:IDLE_US" >&2; exit 2; }
keelfsd=${KEELFSD:-$repo/target/release/keelfsd}
bench=$repo/target/release/keelfs-bench
for bin in "$keelfsd" "$bench"; do
  [[ -x $bin ]] || { echo "run-hostile.sh: $bin is missing (cargo build --release)" >&2; exit 2; }
done
work=$(mktemp -d /dev/shm/keelfs-hostile.XXXXXX)
daemon=""
cleanup() {
  if [[ -n $daemon ]]; then kill "$daemon" 2>/dev/null || true; wait "$daemon" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

emit() {
  echo "$1"
  if [[ -n $out ]]; then echo "$1" >>"$out"; fi
}

config=$work/keelfsd.toml
printf '[daemon]\nreactors = 1\nrpc_socket = "%s"\n' "$work/rpc.sock" >"$config"
. "$repo/bench/two_exports.sh"
append_two_exports "$keelfsd" "$work" "$config"
"$keelfsd" serve --config "$config" 2>"$work/keelfsd.log" &
daemon=$!
for sock in calm hostile rpc; do
  for _ in $(seq 300); do [[ -S $work/$sock.sock ]] && break; sleep 0.05; done
  [[ -S $work/$sock.sock ]] || { echo "run-hostile.sh: keelfsd never bound $sock.sock" >&2; exit 1; }
done

# The control's CPU burner: spin argv[1] µs, sleep argv[2] µs, for
# argv[3] s.
burn='
import sys, time
busy, idle, end = float(sys.argv[1]) / 1e6, float(sys.argv[2]) / 1e6, time.time() + float(sys.argv[3])
while time.time() < end:
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    time.sleep(idle)
'

# Run a command and write the CPU seconds it took (user and system, its
# children's included) to argv[1]: what the attacker costs the machine.
timed='
import resource, subprocess, sys
subprocess.run(sys.argv[2:], check=True)
used = resource.getrusage(resource.RUSAGE_CHILDREN)
open(sys.argv[1], "w").write(str(used.ru_utime + used.ru_stime))
'

# The reactor's busy nanoseconds so far.
reactor_busy_ns() {
  "$keelfsd" stats --rpc "$work/rpc.sock" | python3 -c 'import json,sys; print(json.load(sys.stdin)["reactors"][0]["busy_ns"])'
}

# The calm client's IOPS over 3 s, and the reactor's busy share meanwhile
# (in CALM_BUSY).
calm() {
  local before
  before=$(reactor_busy_ns)
  calm_iops
  CALM_BUSY=$(python3 -c "print(round(($(reactor_busy_ns) - $before) / 3e9, 3))")
}

calm_iops() {
  "$bench" vhost --socket "$work/calm.sock" --workload dio-randrw --iodepth "$calm_depth" --file-size 32M \
    --driver "$driver" --seconds 3 --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["iops"])'
}

alone_sum=0 beside_sum=0
for round in $(seq "$rounds"); do
  calm >"$work/iops"
  alone=$(cat "$work/iops") busy_alone=$CALM_BUSY
  if [[ -n $burner ]]; then
    python3 -c "$timed" "$work/attacker.cpu" python3 -c "$burn" "${burner%%:*}" "${burner##*:}" 5 &
  else
    python3 -c "$timed" "$work/attacker.cpu" "$bench" hostile --socket "$work/hostile.sock" --seconds 5 \
      --depth "$hostile_depth" --json >"$work/hostile.json" &
  fi
  attacker=$!
  sleep 0.5
  calm >"$work/iops"
  beside=$(cat "$work/iops") busy_beside=$CALM_BUSY
  wait "$attacker"
  hostile_rate=0
  [[ -n $burner ]] ||
    hostile_rate=$(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(r["requests_per_s"])' "$work/hostile.json")
  # Of a core, over the attacker's 5 s.
  attacker_cpu=$(python3 -c 'import sys; print(round(float(open(sys.argv[1]).read()) / 5, 3))' "$work/attacker.cpu")
  emit "{\"bench\":\"hostile-neighbour\",\"keelfsd\":\"$keelfsd\",\"driver\":\"$driver\",\"round\":$round,\"calm_depth\":$calm_depth,\"hostile_depth\":$hostile_depth,\"burner\":\"$burner\",\"calm_iops_alone\":$alone,\"calm_iops_beside\":$beside,\"hostile_requests_per_s\":$hostile_rate,\"attacker_cpu_share\":$attacker_cpu,\"reactor_busy_alone\":$busy_alone,\"reactor_busy_beside\":$busy_beside}"
  alone_sum=$(python3 -c "print($alone_sum + $alone)")
  beside_sum=$(python3 -c "print($beside_sum + $beside)")
done
ratio=$(python3 -c "print(round($beside_sum / $alone_sum, 2))")
emit "{\"bench\":\"hostile-neighbour\",\"keelfsd\":\"$keelfsd\",\"driver\":\"$driver\",\"burner\":\"$burner\",\"summary\":true,\"rounds\":$rounds,\"calm_depth\":$calm_depth,\"hostile_depth\":$hostile_depth,\"ratio\":$ratio}"
