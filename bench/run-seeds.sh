#!/usr/bin/env bash
# keelfs's fio workloads (bench/workloads, see its README) on every
# system that runs them through a kernel mount, side by side on equal
# RAM-backed images, interleaved and repeated (issue 8):
#
#   keelfs-fuse  keelfsd (io_uring backend) mounted through /dev/fuse,
#                cache auto: every buffered write is a round trip
#   keelfs-fuse-wb  the same with cache always: writeback caching in the
#                host kernel, which sends dirty pages in batches
#   ext4, xfs    the host kernel on a loop device
#   device       fio's io_uring engine on the raw image (w1 only: the limit)
#
# plus 1-byte writes with dd (per-write metadata upkeep). --transports
# "dev uring" runs each keelfs system once per FUSE transport (named
# keelfs-fuse-dev, keelfs-fuse-uring, ...), interleaved in every round;
# without it keelfsd picks (fuse_transport auto). The vhost-user systems (keelfsd,
# virtiofsd) are measured by bench/run-vhost.sh with the host-side driver.
# Each line of OUT.json is one result; bench/plot.py draws them.
#
# Usage: bench/run-seeds.sh [--rounds N] [--runtime SECS] [--transports LIST] [OUT.json]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=3 runtime=8 transports=
while [[ $# -gt 0 ]]; do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --runtime) runtime=$2; shift 2 ;;
    --transports) transports=$2; shift 2 ;;
    *) break ;;
  esac
done
out=${1:-bench/results/seeds-$(date +%F).json}
workloads=bench/workloads
[[ -f $workloads/w1-dio-overwrite.fio ]] || { echo "run-seeds: no fio workloads at $workloads" >&2; exit 2; }
command -v fio >/dev/null || { echo "run-seeds: fio is missing (scripts/setup.sh)" >&2; exit 2; }
cargo build --release -q -p keelfsd
keelfsd=${CARGO_TARGET_DIR:-$PWD/target}/release/keelfsd
work=$(mktemp -d /dev/shm/keelfs-seeds.XXXXXX)
declare -A loops=()
daemon_pid=
cleanup() {
  if [[ -n $daemon_pid ]]; then kill -TERM "$daemon_pid" 2>/dev/null; wait "$daemon_pid" 2>/dev/null || true; fi
  for m in "$work"/mnt-*; do mountpoint -q "$m" && umount "$m"; done
  for l in "${loops[@]}"; do losetup -d "$l" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

size=4G
"$keelfsd" mkfs "$work/keelfs.img" --size $size --force >/dev/null 2>&1
for fs in ext4 xfs; do
  truncate -s $size "$work/$fs.img"
  if [[ $fs == ext4 ]]; then mkfs.ext4 -q -F "$work/$fs.img"; else mkfs.xfs -q -f "$work/$fs.img"; fi
  loops[$fs]=$(losetup -f --show "$work/$fs.img")
  mkdir -p "$work/mnt-$fs"
  mount "${loops[$fs]}" "$work/mnt-$fs"
done
truncate -s 1G "$work/raw.img"
mkdir -p "$work/mnt-keelfs-fuse"

fuse_systems=(keelfs-fuse keelfs-fuse-wb)
if [[ -n $transports ]]; then
  fuse_systems=()
  for s in keelfs-fuse keelfs-fuse-wb; do
    for t in $transports; do fuse_systems+=("$s-$t"); done
  done
fi

# start_keelfs SYSTEM: keelfs-fuse (cache auto) or keelfs-fuse-wb (always),
# with -dev or -uring: that FUSE transport.
start_keelfs() {
  local cache=auto transport=auto
  [[ $1 == keelfs-fuse-wb* ]] && cache=always
  [[ $1 =~ -(dev|uring)$ ]] && transport=${BASH_REMATCH[1]}
  "$keelfsd" serve --device "$work/keelfs.img" --fuse-mount "$work/mnt-keelfs-fuse" --cache $cache \
    --fuse-transport "$transport" 2>>"$work/keelfsd.log" &
  daemon_pid=$!
  for _ in $(seq 200); do mountpoint -q "$work/mnt-keelfs-fuse" && return 0; sleep 0.05; done
  echo "run-seeds: keelfsd did not mount" >&2; exit 1
}
stop_keelfs() {
  kill -TERM "$daemon_pid"; wait "$daemon_pid" || true; daemon_pid=
}

# cpu_ns PID: utime+stime of a process and its children in ns (0 when
# there is none): a sandboxed keelfsd serves from a child of the process
# started, whose time its parent sees only once it has exited.
cpu_ns() {
  [[ -n ${1:-} ]] || { echo 0; return; }
  local stats=("/proc/$1/stat") child
  for child in $(pgrep -P "$1"); do stats+=("/proc/$child/stat"); done
  awk -v hz="$(getconf CLK_TCK)" '{ sub(/.*\) /, ""); split($0, f, " "); t += f[12] + f[13] }
    END { printf "%d\n", t * 1e9 / hz }' "${stats[@]}"
}

# fio_line SYSTEM WORKLOAD ROUND JSONFILE CPU_NS: one result line.
fio_line() {
  python3 - "$@" <<'EOF'
import json, sys
system, workload, rnd, path, cpu_ns = sys.argv[1:6]
d = json.load(open(path))
j = d["jobs"][0]
r, w = j["read"], j["write"]
ops = r["total_ios"] + w["total_ios"]
def pct(side):
    p = side.get("clat_ns", {}).get("percentile", {})
    return {k: round(v / 1000, 2) for k, v in p.items()}
both = pct(w) if w["iops"] >= r["iops"] else pct(r)
line = {"bench": "seeds", "round": int(rnd), "system": system, "workload": workload,
        "read_iops": round(r["iops"]), "write_iops": round(w["iops"]), "iops": round(r["iops"] + w["iops"]),
        "lat_us_p50": both.get("50.000000"), "lat_us_p99": both.get("99.000000"),
        "lat_us_percentiles": both, "errors": j.get("error", 0)}
if int(cpu_ns) > 0 and ops:
    line["daemon_cpu_us_per_op"] = round(int(cpu_ns) / 1000 / ops, 2)
print(json.dumps(line))
EOF
}

# run_fio SYSTEM DIR JOB ROUND [PID]
run_fio() {
  local system=$1 dir=$2 job=$3 round=$4 pid=${5:-}
  local name; name=$(basename "$job" .fio)
  rm -rf "${dir:?}/seed"; mkdir -p "$dir/seed"
  local before after
  before=$(cpu_ns "$pid")
  # The job files' own runtimes, scaled: a job file's [global] wins over
  # command-line options, so edit a copy.
  sed -e "s/^runtime=.*/runtime=$runtime/" -e "s/^ramp_time=.*/ramp_time=1/" "$job" >"$work/$name.fio"
  (cd "$dir/seed" && fio --output-format=json "$work/$name.fio" >"$work/fio.json" 2>"$work/fio.err") ||
    { echo "run-seeds: fio $name on $system failed: $(tail -3 "$work/fio.err")" >&2; return 1; }
  after=$(cpu_ns "$pid")
  fio_line "$system" "$name" "$round" "$work/fio.json" $((after - before)) | tee -a "$out"
  rm -rf "${dir:?}/seed"
}

# Seed 003: 1-byte writes with dd; writes per second.
run_bytes() {
  local system=$1 dir=$2 round=$3 count=500000
  local t0 t1
  t0=$(date +%s%N)
  dd if=/dev/zero of="$dir/bytes" bs=1 count=$count status=none
  t1=$(date +%s%N)
  rm -f "$dir/bytes"
  printf '{"bench":"seeds","round":%d,"system":"%s","workload":"byte-writes","write_iops":%d,"iops":%d}\n' \
    "$round" "$system" $((count * 1000000000 / (t1 - t0))) $((count * 1000000000 / (t1 - t0))) | tee -a "$out"
}

: >"$out"
for round in $(seq "$rounds"); do
  for job in "$workloads"/w1-dio-overwrite.fio "$workloads"/w2-aio-append.fio "$workloads"/w3-buffered-randrw.fio; do
    for system in "${fuse_systems[@]}"; do
      start_keelfs "$system"
      run_fio "$system" "$work/mnt-keelfs-fuse" "$job" "$round" "$daemon_pid"
      stop_keelfs
    done
    run_fio ext4 "$work/mnt-ext4" "$job" "$round"
    run_fio xfs "$work/mnt-xfs" "$job" "$round"
  done
  # The device limit for w1: the same 4k randrw, O_DIRECT, on the raw image.
  fio --output-format=json --name=device --filename="$work/raw.img" --size=1G --rw=randrw --bs=4k \
    --ioengine=io_uring --iodepth=4 --direct=1 --runtime="$runtime" --time_based --ramp_time=1 >"$work/fio.json"
  fio_line device w1-dio-overwrite "$round" "$work/fio.json" 0 | tee -a "$out"
  for system in "${fuse_systems[@]}"; do
    start_keelfs "$system"
    run_bytes "$system" "$work/mnt-keelfs-fuse" "$round"
    stop_keelfs
  done
  run_bytes ext4 "$work/mnt-ext4" "$round"
  run_bytes xfs "$work/mnt-xfs" "$round"
done
echo "run-seeds: results in $out" >&2
