#!/usr/bin/env bash
# keelfs's fio workloads (bench/workloads, see its README) on every
# system that runs them through a kernel mount, side by side on equal
# RAM-backed images, interleaved and repeated (issue 8):
#
#   keelfs-fuse  keelfsd (io_uring backend) mounted through /dev/fuse,
#                cache auto: with no guest sharing the export, writeback
#                caching in the host kernel, which sends dirty pages in
#                batches
#   keelfs-fuse-wb  the same with cache always (also kept across opens)
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
# The poll-mode matrix (--matrix poll, the default): keelfs-fuse in each
# keelfsd poll_mode (busy, adaptive, interrupt), with each kind of fio
# driver: sleep (the job files as they are: each job blocks in its
# syscalls and leaves its core while it waits) and busy (beside them, one
# fio cpuio job per CPU fio may use keeps that CPU busy, as running vCPUs
# or busy applications do; fio's thinktime_spin would model it per job,
# but fio 3.33 hangs with it), in two setups:
#   oversubscribed  keelfsd's one reactor unpinned beside the jobs (four
#             per job file: load threads >= cores)
#   dedicated  the reactor pinned to the last CPU (reactors = [N]), fio
#             pinned to the others (taskset)
# ext4 runs beside each round as the peer. Rounds interleave the modes
# (their order rotates each round); each keelfs line carries poll_mode,
# setup and driver, and bench/poll_summary.py prints every mode's median
# as a ratio to the better of busy and interrupt (OUT.summary.txt). By
# default w3 only, 2 rounds of 3 s: a few minutes. --full runs w1, w2 and
# w3, 3 rounds of 8 s, and the systems comparison above (--matrix all).
#
# The metadata matrix (--matrix metadata, issue 34): keelfs's host mount
# (keelfs-fuse, keelfsd's defaults) beside ext4 and xfs, through the
# phases of `keelfs-bench posix-meta` over one tree of --files files
# (20000): create, stat cold (after keelfsd restarts and the host's
# caches are dropped), stat warm, open-read-close, readdir (ls -l),
# rename and mkdir-rmdir storms, and unlink, one system after another,
# their order rotating each round; bench/meta_summary.py prints keelfs's
# ratios to ext4 and to xfs (OUT.summary.txt).
#
# Two builds (--builds "OLD NEW", the systems matrix): two keelfsd
# binaries in place of this tree's, as keelfs-fuse-TRANSPORT@old and @new
# (cache auto; --transports defaults to "dev uring"), their order
# alternating each round, under each driver of --drivers (each line
# tagged with its driver; w2, which has no runtime, with a sleeping one
# only), beside ext4 and xfs; then the median ratios
# new/old of IOPS and of keelfsd's CPU per operation (OUT.summary.txt).
# --poll-mode MODE runs both builds in that poll_mode (interrupt: no
# spinning, so CPU per operation is the requests' own cost).
#
# Usage: bench/run-seeds.sh [--matrix poll|systems|metadata|all] [--full] [--rounds N] [--runtime SECS]
#                           [--transports LIST] [--builds "OLD NEW" [--poll-mode MODE]]
#                           [--modes "busy adaptive interrupt"] [--drivers "sleep busy"]
#                           [--setups "oversubscribed dedicated"] [--files N] [OUT.json]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds='' runtime='' matrix=poll full=0 transports='' files=20000 builds='' poll_mode=''
modes='busy adaptive interrupt' drivers='sleep busy' setups='oversubscribed dedicated'
while [[ $# -gt 0 ]]; do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --runtime) runtime=$2; shift 2 ;;
    --transports) transports=$2; shift 2 ;;
    --matrix) matrix=$2; shift 2 ;;
    --full) full=1 matrix=all; shift ;;
    --modes) modes=$2; shift 2 ;;
    --drivers) drivers=$2; shift 2 ;;
    --setups) setups=$2; shift 2 ;;
    --files) files=$2; shift 2 ;;
    --builds) builds=$2; shift 2 ;;
    --poll-mode) poll_mode=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "bench/${0##*/}" | sed '$d'; exit 0 ;;
    -*) echo "run-seeds: unknown option '$1' (--help)" >&2; exit 2 ;;
    *) break ;;
  esac
done
case $matrix in
  poll|systems|all|metadata) ;;
  *) echo "run-seeds: --matrix poll, systems, metadata or all, not '$matrix'" >&2; exit 2 ;;
esac
build_old='' build_new='' systems_drivers=sleep
if [[ -n $builds ]]; then
  read -r build_old build_new extra <<<"$builds"
  [[ -n $build_new && -z $extra && $matrix == systems ]] ||
    { echo "run-seeds: --builds takes two keelfsd binaries, with --matrix systems" >&2; exit 2; }
  for b in "$build_old" "$build_new"; do [[ -x $b ]] || { echo "run-seeds: $b is not an executable" >&2; exit 2; }; done
  : "${transports:=dev uring}"
  systems_drivers=$drivers
fi
if [[ $matrix == poll || $matrix == metadata ]]; then : "${rounds:=2}" "${runtime:=3}"; fi
: "${rounds:=3}" "${runtime:=8}"
# The systems comparison runs its rounds only when asked for.
systems_rounds=$rounds
[[ $matrix != poll && $matrix != metadata ]] || systems_rounds=0
last_cpu=$(($(nproc) - 1))
if [[ $matrix != systems && $matrix != metadata && " $setups " == *" dedicated "* && $last_cpu -lt 1 ]]; then
  echo "run-seeds: the dedicated setup needs two CPUs or more" >&2
  exit 2
fi
if [[ $matrix == poll ]]; then
  out=${1:-bench/results/seeds-poll-$(date +%F).json}
elif [[ $matrix == metadata ]]; then
  out=${1:-bench/results/seeds-meta-$(date +%F).json}
else
  out=${1:-bench/results/seeds-$(date +%F).json}
fi
workloads=bench/workloads
. bench/poll_state.sh
[[ -f $workloads/w1-dio-overwrite.fio ]] || { echo "run-seeds: no fio workloads at $workloads" >&2; exit 2; }
command -v fio >/dev/null || { echo "run-seeds: fio is missing (scripts/setup.sh)" >&2; exit 2; }
cargo build --release -q -p keelfsd -p keelfs-bench
keelfsd=${CARGO_TARGET_DIR:-$PWD/target}/release/keelfsd
bench=${CARGO_TARGET_DIR:-$PWD/target}/release/keelfs-bench
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
if [[ -n $builds ]]; then
  fuse_systems=()
  for t in $transports; do fuse_systems+=("keelfs-fuse-$t@old" "keelfs-fuse-$t@new"); done
elif [[ -n $transports ]]; then
  fuse_systems=()
  for s in keelfs-fuse keelfs-fuse-wb; do
    for t in $transports; do fuse_systems+=("$s-$t"); done
  done
fi

# start_keelfs SYSTEM: keelfs-fuse (cache auto) or keelfs-fuse-wb (always),
# with -dev or -uring: that FUSE transport; with @old or @new, that build.
start_keelfs() {
  local cache=auto transport=auto system=${1%@*} bin=$keelfsd
  [[ $1 == *@old ]] && bin=$build_old
  [[ $1 == *@new ]] && bin=$build_new
  [[ $system == keelfs-fuse-wb* ]] && cache=always
  [[ $system =~ -(dev|uring)$ ]] && transport=${BASH_REMATCH[1]}
  if [[ -n $poll_mode ]]; then
    "$bin" serve --config <(printf '[daemon]\npoll_mode="%s"\n[[device]]\nname="d"\npath="%s"\n[[export]]\ntag="d"\ndevice="d"\nfuse_mount="%s"\ncache="%s"\nfuse_transport="%s"\n' \
      "$poll_mode" "$work/keelfs.img" "$work/mnt-keelfs-fuse" "$cache" "$transport") 2>>"$work/keelfsd.log" &
    daemon_pid=$!
    for _ in $(seq 200); do mountpoint -q "$work/mnt-keelfs-fuse" && return 0; sleep 0.05; done
    echo "run-seeds: keelfsd did not mount" >&2; exit 1
  fi
  "$bin" serve --device "$work/keelfs.img" --fuse-mount "$work/mnt-keelfs-fuse" --cache $cache \
    --fuse-transport "$transport" 2>>"$work/keelfsd.log" &
  daemon_pid=$!
  for _ in $(seq 200); do mountpoint -q "$work/mnt-keelfs-fuse" && return 0; sleep 0.05; done
  echo "run-seeds: keelfsd did not mount" >&2; exit 1
}
# start_keelfs_poll MODE SETUP: keelfs-fuse (cache auto) in poll_mode
# MODE, its reactor pinned to the last CPU when SETUP is dedicated.
start_keelfs_poll() {
  local reactors=1
  [[ $2 == dedicated ]] && reactors="[$last_cpu]"
  "$keelfsd" serve --config <(printf '[daemon]\npoll_mode="%s"\nreactors=%s\nrpc_socket="%s"\n[[device]]\nname="d"\npath="%s"\n[[export]]\ntag="d"\ndevice="d"\nfuse_mount="%s"\ncache="auto"\n' \
    "$1" "$reactors" "$work/poll.rpc" "$work/keelfs.img" "$work/mnt-keelfs-fuse") 2>>"$work/keelfsd.log" &
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
text = open(path).read()
d = json.loads(text[text.index("{"):])  # after what a cpuio job prints first
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

# What run_fio adds: fields at the head of each line (tags: '"k":"v",'),
# a command fio runs under (fio_pin: taskset) and jobs after the job
# file's own (job_append, printf %b).
tags='' job_append='' fio_pin=()

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
  printf '%b' "$job_append" >>"$work/$name.fio"
  (cd "$dir/seed" && "${fio_pin[@]}" fio --output-format=json "$work/$name.fio" >"$work/fio.json" 2>"$work/fio.err") ||
    { echo "run-seeds: fio $name on $system failed: $(tail -3 "$work/fio.err")" >&2; return 1; }
  after=$(cpu_ns "$pid")
  fio_line "$system" "$name" "$round" "$work/fio.json" $((after - before)) | sed "s/^{/{$tags/" | tee -a "$out"
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

# driver_kind DRIVER CPUS: job_append for a sleeping fio driver, or a
# busy one on CPUS cpus (a group of its own, after the measured one).
driver_kind() {
  case $1 in
    sleep) job_append='' ;;
    busy) job_append="\n[busy]\nnew_group\nioengine=cpuio\ncpuload=100\nnumjobs=$2\n" ;;
    *) echo "run-seeds: drivers are sleep and busy, not '$1'" >&2; exit 2 ;;
  esac
}

: >"$out"
for round in $(seq "$systems_rounds"); do
  # Two builds alternate which goes first.
  order=("${fuse_systems[@]}")
  if [[ -n $builds && $((round % 2)) == 0 ]]; then
    order=()
    for ((i = ${#fuse_systems[@]} - 1; i >= 0; i--)); do order+=("${fuse_systems[i]}"); done
  fi
  for drv in $systems_drivers; do
    driver_kind "$drv" "$(nproc)"
    [[ -z $builds ]] || tags="\"driver\":\"$drv\","
    for job in "$workloads"/w1-dio-overwrite.fio "$workloads"/w2-aio-append.fio "$workloads"/w3-buffered-randrw.fio; do
      # A busy driver's cpuio jobs run for the job file's runtime: w2
      # has none (it writes its size), so it runs with a sleeping one.
      [[ $drv == sleep ]] || grep -q '^time_based' "$job" || continue
      for system in "${order[@]}"; do
        start_keelfs "$system"
        run_fio "$system" "$work/mnt-keelfs-fuse" "$job" "$round" "$daemon_pid"
        stop_keelfs
      done
      run_fio ext4 "$work/mnt-ext4" "$job" "$round"
      run_fio xfs "$work/mnt-xfs" "$job" "$round"
    done
  done
  driver_kind sleep 0
  tags=''
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
if [[ -n $builds ]]; then
  python3 bench/builds_summary.py "$out" | tee "${out%.json}.summary.txt" >&2
fi

if [[ $matrix == poll || $matrix == all ]]; then
  poll_jobs=("$workloads"/w3-buffered-randrw.fio)
  ((full)) && poll_jobs=("$workloads"/w1-dio-overwrite.fio "$workloads"/w2-aio-append.fio "${poll_jobs[@]}")
  read -ra mode_list <<<"$modes"
  for round in $(seq "$rounds"); do
    # The modes' order rotates each round, so that none always runs first.
    shift_by=$(((round - 1) % ${#mode_list[@]}))
    order=("${mode_list[@]:shift_by}" "${mode_list[@]:0:shift_by}")
    for job in "${poll_jobs[@]}"; do
      for drv in $drivers; do
        for setup in $setups; do
          fio_pin=()
          driver_kind "$drv" $((last_cpu + 1))
          if [[ $setup == dedicated ]]; then
            fio_pin=(taskset -c "0-$((last_cpu - 1))")
            driver_kind "$drv" "$last_cpu"
          fi
          for mode in "${order[@]}"; do
            tags="\"poll_mode\":\"$mode\",\"setup\":\"$setup\",\"driver\":\"$drv\","
            start_keelfs_poll "$mode" "$setup"
            run_fio keelfs-fuse "$work/mnt-keelfs-fuse" "$job" "$round" "$daemon_pid"
            poll_state "$keelfsd" "$work/poll.rpc" "\"round\":$round,$tags\"workload\":\"$(basename "$job" .fio)\"," |
              tee -a "$out"
            stop_keelfs
          done
        done
        # The peer, unpinned, with the same driver.
        tags="\"driver\":\"$drv\"," fio_pin=()
        driver_kind "$drv" $((last_cpu + 1))
        run_fio ext4 "$work/mnt-ext4" "$job" "$round"
      done
    done
  done
  tags='' job_append=''
  python3 bench/poll_summary.py "$out" | tee "${out%.json}.summary.txt" >&2
fi
# meta_run ROUND SYSTEM DIR PHASE WORKLOAD [FLAGS...]: one phase of the
# metadata matrix, charging keelfsd's CPU when it serves DIR.
meta_run() {
  local round=$1 system=$2 dir=$3 phase=$4 workload=$5
  shift 5
  local pid_flags=()
  [[ -z $daemon_pid ]] || pid_flags=(--daemon-pid "$daemon_pid")
  "$bench" posix-meta --dir "$dir" --workload "$workload" --files "$files" --seconds "$runtime" \
    "${pid_flags[@]}" --label "$system" --json "$@" |
    sed "s/^{/{\"round\":$round,\"phase\":\"$phase\",/" | tee -a "$out"
}

# meta_system ROUND SYSTEM: every phase on one system, in order.
meta_system() {
  local round=$1 system=$2 dir=$work/mnt-$2
  [[ $system == keelfs-fuse ]] && start_keelfs keelfs-fuse
  meta_run "$round" "$system" "$dir" create create
  # Cold: keelfsd mounts its image again, and the host's dentry, inode
  # and page caches are dropped (ext4's, xfs's and the FUSE client's).
  [[ $system == keelfs-fuse ]] && stop_keelfs
  sync
  echo 3 >/proc/sys/vm/drop_caches
  [[ $system == keelfs-fuse ]] && start_keelfs keelfs-fuse
  meta_run "$round" "$system" "$dir" stat-cold stat --passes 1
  for phase in stat open-read-close readdir rename mkdir-rmdir unlink; do
    meta_run "$round" "$system" "$dir" "${phase/#stat/stat-warm}" "$phase"
  done
  [[ $system != keelfs-fuse ]] || stop_keelfs
}

if [[ $matrix == metadata ]]; then
  meta_systems=(keelfs-fuse ext4 xfs)
  for round in $(seq "$rounds"); do
    shift_by=$(((round - 1) % ${#meta_systems[@]}))
    for system in "${meta_systems[@]:shift_by}" "${meta_systems[@]:0:shift_by}"; do
      meta_system "$round" "$system"
    done
  done
  for peer in ext4 xfs; do
    python3 bench/meta_summary.py "$out" --system keelfs-fuse --peers "$peer"
  done | tee "${out%.json}.summary.txt" >&2
fi
echo "run-seeds: results in $out" >&2
