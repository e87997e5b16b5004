#!/usr/bin/env bash
# Instructions per operation of two keelfsd builds, counted by
# callgrind: a figure that the machine's noise does not move, for changes
# too small for compare-builds.sh's interleaved rounds to resolve on a
# shared 2-core machine (their rounds spread by a third). Each build
# serves a RAM-backed image (io_uring) in poll_mode interrupt, so that no
# spinning is counted, with the sandbox off (valgrind lacks pidfd_open),
# under `valgrind --tool=callgrind`; `keelfs-bench vhost` drives one
# workload for --seconds, with compare-builds.sh's settings for it. Each
# build starts on a new image, so stat, open-read-close and unlink first
# run create, unmeasured: the counters are zeroed after it
# (`callgrind_control -z`).
#
# Reported per operation the bench completed: the reactor's ticks (all
# of its work, inclusive), memcpy, malloc and free. A data workload's
# file is written before it is measured and counted too, alike for both
# builds: compare builds, not absolute figures.
#
# Build both binaries the same way, as `cargo build --release -p keelfsd`
# (the shipped binary). Built together with keelfs-bench, keelfsd gets
# keelfs-bench's test-utils features (Cargo unifies them), and that alone
# moved stat's serving instructions by 4% (bench/RESULTS.md, "Issue 35,
# part 7").
#
# Usage: bench/callgrind-builds.sh OLD_KEELFSD NEW_KEELFSD
#                                  [--workload dio-overwrite] [--seconds 20] [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $# -ge 2 ]] || { sed -n '19,20p' "$0" >&2; exit 2; }
old=$1 new=$2
shift 2
workload=dio-overwrite seconds=20
while [[ $# -gt 0 ]]; do
  case $1 in
    --workload) workload=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    *) break ;;
  esac
done
for b in "$old" "$new"; do [[ -x $b ]] || { echo "callgrind-builds: $b is not an executable" >&2; exit 2; }; done
command -v valgrind >/dev/null || { echo "callgrind-builds: valgrind is missing (apt-get install valgrind)" >&2; exit 1; }
cargo build --release -q -p keelfs-bench
bench=$PWD/target/release/keelfs-bench
work=$(mktemp -d /dev/shm/keelfs-callgrind.XXXXXX)
out=${1:-$work}
mkdir -p "$out"
daemon_pid=
cleanup() {
  if [[ -n $daemon_pid ]] && kill -TERM "$daemon_pid" 2>/dev/null; then
    wait "$daemon_pid" 2>/dev/null || true
  fi
  rm -f "$work/img" "$work/img.session"
}
trap cleanup EXIT

# compare-builds.sh's settings for each kind of workload.
flags=(--threads 1 --iodepth 32 --file-size 16M) cache=none
case $workload in
  buffered-*) cache=auto ;;
  create | stat | open-read-close | unlink) flags=(--tree wide --files 20000 --threads 1 --iodepth 4) cache=auto ;;
esac
for label in old new; do
  bin=$old; [[ $label == new ]] && bin=$new
  rm -f "$work/img" "$work/img.session" "$work/sock"
  fallocate -l 2G "$work/img"
  "$bin" mkfs "$work/img" --force >/dev/null 2>&1
  printf '[daemon]\npoll_mode="interrupt"\nsandbox="none"\n[[device]]\nname="d"\npath="%s"\n[[export]]\ntag="t"\ndevice="d"\nsocket="%s"\nrequest_queues=1\ncache="%s"\n' \
    "$work/img" "$work/sock" "$cache" >"$work/config.toml"
  valgrind --tool=callgrind --callgrind-out-file="$out/callgrind.$label.out" \
    "$bin" serve --config "$work/config.toml" 2>"$out/$label.log" &
  daemon_pid=$!
  for _ in $(seq 600); do [[ -S $work/sock ]] && break; sleep 0.1; done
  case $workload in
    stat | open-read-close | unlink)
      # The tree the workload needs, then counting from zero.
      "$bench" vhost --socket "$work/sock" --workload create "${flags[@]}" --seconds 600 --json >"$out/$label.create.json"
      callgrind_control -z "$daemon_pid" >/dev/null 2>&1
      ;;
  esac
  "$bench" vhost --socket "$work/sock" --workload "$workload" "${flags[@]}" \
    --seconds "$seconds" --label "$label" --json >"$out/$label.json"
  kill -TERM "$daemon_pid"
  wait "$daemon_pid" || true
  daemon_pid=
done

python3 - "$out" <<'PY'
import json, re, subprocess, sys
out = sys.argv[1]
wanted = {"ticks": r"keelfs_reactor::Reactor::tick \[", "memcpy": r":__memcpy\w* \[",
          "malloc": r"malloc\.c:malloc \[", "free": r"malloc\.c:free \["}
per_op = {}
for label in ("old", "new"):
    run = json.load(open(f"{out}/{label}.json"))
    # A metadata run counts its operations; a data run, its rate.
    ops = run.get("ops") or run["iops"] * run["seconds"]
    text = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", f"{out}/callgrind.{label}.out"],
                          capture_output=True, text=True, check=True).stdout
    figures = {}
    for name, pattern in wanted.items():
        for line in text.splitlines():
            if re.search(pattern, line):
                figures[name] = int(line.split()[0].replace(",", "")) / ops
                break
    per_op[label] = figures
    print(json.dumps({"bench": "callgrind-builds", "label": label, "workload": run["workload"],
                      "operations": int(ops), "instructions_per_operation": {k: round(v) for k, v in figures.items()}}))
for name in wanted:
    o, n = per_op["old"].get(name), per_op["new"].get(name)
    if o and n:
        print(f"callgrind-builds: {name}: new/old instructions per operation {n / o:.3f} ({o:.0f} -> {n:.0f})")
PY
