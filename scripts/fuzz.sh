#!/usr/bin/env bash
# The long fuzz run: keelfs's structure-aware fuzzers (hostile but
# well-formed FUSE requests against the dispatcher, generated hostile
# descriptor chains against the virtqueue path, crafted superblocks with
# valid checksums) run seed after seed until the time is up. CI runs each
# once with a fixed seed; this is the run that hunts.
#
# Usage: scripts/fuzz.sh [--minutes N] [--cases N]
#   --minutes N  how long to run (default 30)
#   --cases N    requests (or chain rounds) per seed (default 100000)
# Prints one line per seed and a total; on a failure, the command that
# replays it, and exits 1.
set -euo pipefail
cd "$(dirname "$0")/.."
minutes=30
cases=100000
while (($#)); do
  case "$1" in
    --minutes) minutes=${2:?--minutes needs a value}; shift 2 ;;
    --cases) cases=${2:?--cases needs a value}; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "fuzz.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ $minutes =~ ^[1-9][0-9]*$ && $cases =~ ^[1-9][0-9]*$ ]] || { echo "fuzz.sh: give whole numbers" >&2; exit 2; }

cargo test -q -p keelfs-vhost --test fuzz_requests --test virtqueue --no-run
targets=(
  "fuzz_requests hostile_well_formed_requests"
  "virtqueue generated_hostile_chains"
)
end=$((SECONDS + minutes * 60))
seed=$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')
runs=0
total_cases=0
while ((SECONDS < end)); do
  for t in "${targets[@]}"; do
    read -r test filter <<<"$t"
    log=$(mktemp)
    if ! KEELFS_FUZZ_SEED=$seed KEELFS_FUZZ_CASES=$cases \
      cargo test -q -p keelfs-vhost --test "$test" "$filter" -- --nocapture >"$log" 2>&1; then
      grep -E 'panicked|case |round ' "$log" | head -n 20
      echo "fuzz.sh: FAILED: replay with KEELFS_FUZZ_SEED=$seed KEELFS_FUZZ_CASES=$cases cargo test -p keelfs-vhost --test $test $filter"
      rm -f "$log"
      exit 1
    fi
    echo "fuzz.sh: $test seed $seed: $(grep -E '^(fuzz|chain fuzz): (seed [0-9]+: |dropped)' "$log" | tail -n 1)"
    rm -f "$log"
    runs=$((runs + 1))
    total_cases=$((total_cases + cases))
  done
  seed=$((seed + 1))
done
# The crafted superblocks are a fixed table: once per run.
cargo test -q -p keelfs-core --test fs_damage crafted >/dev/null
echo "fuzz.sh: $runs runs, $total_cases cases in ${minutes} min: nothing found"
