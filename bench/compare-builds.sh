#!/usr/bin/env bash
# Two keelfsd builds side by side through vhost-user-fs: the same image
# kind (a preallocated RAM-backed file in /dev/shm, io_uring), the same
# load generator (keelfs-bench vhost), rounds interleaved so that both see
# the same machine noise. For a change that touches the request path: is
# the new build within noise of the old? One JSON line per run, then the
# median ratios new/old of IOPS and of daemon CPU per operation.
# --backend pmem serves the same file through the pmem backend instead:
# no io-wq workers, so the daemon's own cost per request shows best.
# --metadata runs the metadata phases instead (create, stat, open-read-
# close, unlink over a wide tree of 20,000 files, with the daemons'
# default cache mode): each build runs all four in turn in a round.
#
# --driver busy drives with threads that spin on the used ring (a running
# vCPU, which takes its core from the daemon) instead of sleeping on the
# call eventfd (a halted one, the default).
#
# Build both binaries the same way, as `cargo build --release -p keelfsd`
# (the shipped binary). Built together with keelfs-bench, keelfsd gets
# keelfs-bench's test-utils features (Cargo unifies them), and that alone
# moved stat's serving instructions by 4% (bench/RESULTS.md, "Issue 35,
# part 7").
#
# Usage: bench/compare-builds.sh OLD_KEELFSD NEW_KEELFSD [--rounds N] [--seconds N]
#                                [--backend uring|pmem] [--driver sleep|busy] [--metadata] [OUT.json]
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $# -ge 2 ]] || { sed -n '18,19p' "$0" >&2; exit 2; }
old=$1 new=$2
shift 2
rounds=3 seconds=5 backend=uring metadata=0 driver=sleep
while [[ $# -gt 0 ]]; do
  case $1 in
    --metadata) metadata=1; shift ;;
    --rounds) rounds=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --backend) backend=$2; shift 2 ;;
    --driver) driver=$2; shift 2 ;;
    *) break ;;
  esac
done
out=${1:-/dev/null}
case $backend in
  uring | pmem) ;;
  *) echo "compare-builds: --backend uring or pmem, not '$backend'" >&2; exit 2 ;;
esac
for b in "$old" "$new"; do [[ -x $b ]] || { echo "compare-builds: $b is not an executable" >&2; exit 2; }; done
cargo build --release -q -p keelfs-bench
bench=$PWD/target/release/keelfs-bench
work=$(mktemp -d /dev/shm/keelfs-compare.XXXXXX)
daemon_pid=
cleanup() {
  if [[ -n $daemon_pid ]] && kill -TERM "$daemon_pid" 2>/dev/null; then
    wait "$daemon_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT
fallocate -l 2G "$work/img"
dd if=/dev/zero of="$work/img" bs=1M count=2048 conv=notrunc status=none
"$new" mkfs "$work/img" --force >/dev/null 2>&1

workloads=(
  "dio-overwrite|--threads 1 --iodepth 32 --file-size 256M|none"
  "buffered-randrw|--threads 1 --iodepth 4 --file-size 256M|auto"
)
if ((metadata)); then
  tree="--tree wide --files 20000 --threads 1 --iodepth 4"
  workloads=("create|$tree|auto" "stat|$tree|auto" "open-read-close|$tree|auto" "unlink|$tree|auto")
fi
results=$work/results.jsonl
: >"$results"
for round in $(seq "$rounds"); do
  # Alternate which build goes first, so that order effects (the image's
  # state, a warm cache) fall on both.
  order="old new"; ((round % 2 == 0)) && order="new old"
  for label in $order; do
    bin=$old; [[ $label == new ]] && bin=$new
    for line in "${workloads[@]}"; do
      IFS='|' read -r workload flags cache <<<"$line"
      rm -f "$work/sock"
      if [[ $backend == pmem ]]; then
        "$bin" serve --config <(printf '[[device]]\nname="p"\nbackend="pmem"\npath="%s"\n[[export]]\ntag="p"\ndevice="p"\nsocket="%s"\nrequest_queues=1\ncache="%s"\n' "$work/img" "$work/sock" "$cache") 2>"$work/$label.log" &
      else
        "$bin" serve --device "$work/img" --socket "$work/sock" --queues 1 --cache "$cache" 2>"$work/$label.log" &
      fi
      daemon_pid=$!
      for _ in $(seq 200); do [[ -S $work/sock ]] && break; sleep 0.05; done
      # shellcheck disable=SC2086  # $flags is a list of options: split on purpose
      "$bench" vhost --socket "$work/sock" --workload "$workload" $flags --seconds "$seconds" --driver "$driver" \
        --daemon-pid "$daemon_pid" --label "$label" --json | sed "s/^{/{\"round\":$round,/" | tee -a "$results"
      kill -TERM "$daemon_pid"
      wait "$daemon_pid" || true
      daemon_pid=
    done
  done
done
cp "$results" "$out" 2>/dev/null || true
python3 - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for w in sorted({r["workload"] for r in rows}):
    def med(label, key):
        v = [r[key] for r in rows if r["workload"] == w and r["label"] == label and r.get(key)]
        return statistics.median(v) if v else float("nan")
    iops = med("new", "iops") / med("old", "iops")
    cpu = med("new", "daemon_cpu_us_per_op") / med("old", "daemon_cpu_us_per_op")
    print(f"compare-builds: {w}: new/old IOPS {iops:.2f}, daemon CPU per op {cpu:.2f} (medians of {len({r['round'] for r in rows})} rounds)")
PY
