#!/usr/bin/env bash
# The long fuzz run: keelfs's structure-aware fuzzers (hostile but
# well-formed FUSE requests against the dispatcher, generated hostile
# descriptor chains against the virtqueue path, crafted superblocks with
# valid checksums, journal and checkpoint records mutated under valid
# checksums) run seed after seed until the time is up. CI runs each
# once with a fresh seed; this is the run that hunts.
#
# Usage: scripts/fuzz.sh [--minutes N] [--cases N] [--afl [--target T]]
#   --minutes N  how long to run (default 30)
#   --cases N    requests (or chain rounds) per seed (default 100000)
#   --afl        instead, run a harness of fuzz/ under AFL++,
#                coverage-guided, for N minutes (installs cargo-afl)
#   --target T   with --afl: requests (the FUSE dispatcher, the default)
#                or image (a mutated image mounted and used)
#   --keep DIR   with --afl: copy AFL++'s minimised corpus to DIR
# Prints one line per seed and a total; on a failure, the command that
# replays it, and exits 1.
set -euo pipefail
cd "$(dirname "$0")/.."
minutes=30
cases=100000
afl=
target=requests
keep=
while (($#)); do
  case "$1" in
    --minutes) minutes=${2:?--minutes needs a value}; shift 2 ;;
    --cases) cases=${2:?--cases needs a value}; shift 2 ;;
    --afl) afl=1; shift ;;
    --target) target=${2:?--target needs a value}; shift 2 ;;
    --keep) keep=${2:?--keep needs a directory}; shift 2 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "fuzz.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ $minutes =~ ^[1-9][0-9]*$ && $cases =~ ^[1-9][0-9]*$ ]] || { echo "fuzz.sh: give whole numbers" >&2; exit 2; }
case $target in
  requests) bin=fuzz_requests ;;
  image) bin=fuzz_image ;;
  *) echo "fuzz.sh: --target is requests or image, not '$target'" >&2; exit 2 ;;
esac

# run_afl: the harness $bin of fuzz/ under afl-fuzz for $minutes; a crash
# is replayed with the uninstrumented build of the same binary.
run_afl() {
  command -v cargo-afl >/dev/null || cargo install --locked cargo-afl
  cargo afl config --build >/dev/null 2>&1 || cargo afl config --build --force
  CARGO_TARGET_DIR=target/afl cargo afl build --release -q -p keelfs-fuzz --features afl --bin "$bin"
  cargo build -q -p keelfs-fuzz --bin "$bin"
  local work seeds out stats
  work=$(mktemp -d /tmp/keelfs-afl.XXXXXX)
  seeds=$work/seeds out=$work/out
  mkdir -p "$seeds"
  target/debug/"$bin" --seeds "$seeds" 32
  # The machine's core_pattern may pipe cores elsewhere; the harness
  # panics (SIGABRT) on what it finds either way.
  AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 AFL_NO_UI=1 \
    cargo afl fuzz -V $((minutes * 60)) -i "$seeds" -o "$out" target/afl/release/"$bin" >"$work/afl.log" 2>&1 || {
    tail -n 20 "$work/afl.log"
    echo "fuzz.sh: afl-fuzz failed (log: $work/afl.log)" >&2
    exit 1
  }
  stats=$out/default/fuzzer_stats
  field() { sed -n "s/^$1 *: *//p" "$stats"; }
  echo "fuzz.sh: AFL++ ($target): $(field execs_done) executions in ${minutes} min, corpus $(field corpus_count)," \
    "edges $(field edges_found) of $(field total_edges) ($(field bitmap_cvg)), crashes $(field saved_crashes)," \
    "hangs $(field saved_hangs)"
  if [[ $(field saved_crashes) != 0 || $(field saved_hangs) != 0 ]]; then
    echo "fuzz.sh: FOUND: replay with target/debug/$bin $out/default/crashes/id:* (or hangs/)"
    exit 1
  fi
  if [[ -n $keep ]]; then
    mkdir -p "$keep"
    cargo afl cmin -i "$out/default/queue" -o "$work/min" -- target/afl/release/"$bin" >"$work/cmin.log" 2>&1
    local i=0 f
    for f in "$work"/min/*; do
      cp "$f" "$keep/afl-$(printf '%04d' "$i")"
      i=$((i + 1))
    done
    echo "fuzz.sh: kept $i inputs (afl-cmin of the queue) in $keep"
  fi
  rm -rf "$work"
}
if [[ -n $afl ]]; then
  run_afl
  exit 0
fi

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
  # Journal and checkpoint records mutated under valid checksums: 300
  # images per mutator and seed.
  if ! KEELFS_DAMAGE_SEED=$seed cargo test -q -p keelfs-fs --test fs_damage valid_checksums >/dev/null 2>&1; then
    echo "fuzz.sh: FAILED: replay with KEELFS_DAMAGE_SEED=$seed cargo test -p keelfs-fs --test fs_damage valid_checksums"
    exit 1
  fi
  runs=$((runs + 1))
  total_cases=$((total_cases + 600))
  seed=$((seed + 1))
done
# The crafted superblocks are a fixed table: once per run.
cargo test -q -p keelfs-fs --test fs_damage crafted >/dev/null
echo "fuzz.sh: $runs runs, $total_cases cases in ${minutes} min: nothing found"
