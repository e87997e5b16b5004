#!/usr/bin/env bash
# The seed workloads through vhost-user-fs, keelfsd and virtiofsd side by
# side (issue 8), driven by `keelfs-bench vhost` (no guest: the load
# generator is the VMM and the driver). Each round runs every system once
# per workload, interleaved, so that both see the same machine noise.
#
#   keelfsd   io_uring backend on a loop device over a RAM-backed image
#             in /dev/shm: the same kind of device virtiofsd's ext4 has
#   keelfsd-irq  the same with poll_mode interrupt: the reactor sleeps
#             whenever a pass finds no work, instead of polling for 1 ms
#   keelfsd-tmpfs  io_uring backend on the RAM-backed image itself (no
#             loop device: O_DIRECT on tmpfs runs in io-wq workers that
#             are charged to keelfsd)
#   keelfsd-pmem  pmem backend on a /dev/shm file
#   keelfsd-nosandbox, keelfsd-pmem-nosandbox: the same with --sandbox
#             none (not run by default; for measuring the sandbox's cost)
#   virtiofsd ext4 on a loop device over an equal RAM-backed image,
#             --cache never (direct) or auto (buffered workloads),
#             --allow-direct-io so that O_DIRECT reaches ext4; its default
#             --thread-pool-size 0 (requests served one at a time on the
#             queue's thread)
#   virtiofsd-pool  the same with --thread-pool-size 16, so that requests
#             in flight are served in parallel
#   keelfsd-rbd  (with --rbd-pool POOL) keelfsd serving a 1 GiB RBD image
#             in that pool through librbd, sandboxed as by default;
#             keelfsd-rbd-irq the same with poll_mode interrupt (the
#             default on RBD, written out); keelfsd-rbd-nosandbox the
#             same with --sandbox none (not run by default; for the
#             sandbox's cost on RBD). virtiofsd has no counterpart: it needs a host
#             filesystem, and on RBD that needs the kernel's rbd or nbd
#             driver (or a FUSE layer of its own in between).
#
# The driver (`keelfs-bench vhost`) sleeps on the call eventfd while all
# its requests are in flight, as a guest's vCPU halts; --driver busy
# (formerly spin) makes it poll the used ring without pause, as a running
# vCPU keeps its core busy (it then takes a core of its own).
#
# The poll-mode matrix (--matrix poll, the default): keelfsd on the loop
# device in each poll_mode (busy, adaptive, interrupt) with each driver
# (sleep, busy), in two setups:
#   oversubscribed  two driver threads (two queues) and the daemon's one
#             unpinned reactor on the machine's cores: load threads >=
#             cores, as busy guests on a full host
#   dedicated  the reactor pinned to the last CPU (reactors = [N]), one
#             driver thread pinned to the others (taskset)
# Rounds interleave the modes (their order rotates each round); each line
# carries poll_mode, setup and driver, and bench/poll_summary.py prints
# every mode's median as a ratio to the better of busy and interrupt
# (OUT.summary.txt). By default two workloads (dio-randrw, byte-writes),
# 2 rounds of 3 s: a few minutes. --full runs every workload, 3 rounds of
# 5 s, and the systems comparison above as well (--matrix all).
#
# CPU: each line charges the daemon (with its children) its own utime +
# stime, the load generator its own, and "other" the rest of the
# machine's busy time in the run (/proc/stat): the loop devices' kernel
# workers, which neither process is charged for, and noise.
#
# Each round also measures the device limit: fio's io_uring engine and
# keelfs's block layer, 4k random writes at QD32, on the raw tmpfs file
# ("device") and on a loop device over it ("device-loop"). With
# --rbd-pool, the RBD limit instead: qemu-img bench through QEMU's rbd
# driver (what a virtio-blk guest's requests go through) beside keelfs's
# block layer, each on a 256 MiB image of its own in the pool, 4k writes
# ("device-rbd") and reads ("device-rbd-read") at --depth, and 4k
# sequential writes ("device-rbd-seq", the appends' counterpart: the OSD
# serves writes within one object much faster). qemu-img bench only
# steps through an image, so the first two step 4099 blocks
# (bench/run-rbd.sh says why); which side goes first alternates over
# rounds; the OSD's CPU is reported apart (osd_cpu_us_per_op).
#
# With --rbd-pool, what the run writes to the cluster is kept small (a
# 1 GiB image, aio-append's file wrapping at 512 MiB, at most 256 MiB per
# side in each device run), and it stops when the host has less than
# --min-avail MiB of memory available: the dev cluster's OSD keeps its
# data in RAM, in a sparse file in /dev/shm larger than RAM
# (bench/run-rbd.sh).
#
# The metadata matrix (--matrix metadata, issue 34): keelfsd (its
# defaults) beside virtiofsd and virtiofsd-pool (--cache auto, their
# default) on the same fair devices, through the metadata workloads of
# `keelfs-bench vhost` as phases over one tree per system: create, stat
# cold (one pass, right after the daemon starts and the host's caches are
# dropped), stat warm, open-read-close, readdirplus (of the whole tree),
# rename and mkdir-rmdir storms, and unlink; then the mixed profile: a
# recorded trace of a real workload's FUSE requests (an untar of the libc
# crate's sources, a stat and a read of every file, their removal:
# bench/workloads/untar-libc.trace.xz, made by bench/record-trace.sh)
# replayed --trace-passes times (10). --meta-phases runs only some
# (phases after create need the tree it makes, except trace). Each
# system runs the phases
# in order with one driver, then the next system; the systems' order
# rotates each round, and both drivers run. --tree wide|deep and --files
# N (per thread; 20000) shape the tree; --meta-depth operations in
# flight per thread (4), --meta-threads threads (1).
#
# Usage: bench/run-vhost.sh [--matrix poll|systems|metadata|all] [--full]
#                           [--rounds N] [--seconds N] [--systems "A B ..."]
#                           [--driver sleep|busy] [--depth N]
#                           [--modes "busy adaptive interrupt"] [--drivers "sleep busy"]
#                           [--setups "oversubscribed dedicated"]
#                           [--workloads "dio-randrw ..."]
#                           [--rbd-pool POOL] [--min-avail MiB] [OUT.json]
#                           [--tree wide|deep] [--files N] [--meta-depth N] [--meta-threads N]
#                           [--trace-passes N] [--meta-phases "create ... trace"]
#   --matrix: the poll-mode matrix (default), the systems comparison
#     (the default with --systems or --rbd-pool), both (all), or the
#     metadata matrix
#   --driver: the systems comparison's driver (sleep); --drivers, --modes
#     and --setups narrow the poll-mode matrix
#   --depth: requests in flight for the three direct-I/O workloads (32)
#   --workloads: run only these (dio-overwrite dio-randrw aio-append
#     buffered-randrw byte-writes), in both matrices
#   default systems: "keelfsd keelfsd-irq keelfsd-tmpfs keelfsd-pmem virtiofsd virtiofsd-pool",
#     or "keelfsd-rbd keelfsd-rbd-irq" with --rbd-pool
# Needs: virtiofsd (`cargo install virtiofsd`), root (loop devices); with
# --rbd-pool, a Ceph cluster whose one OSD runs on this host
# (scripts/ceph-dev.sh up) and qemu-img's rbd driver (qemu-block-extra).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds='' seconds='' systems='' driver=sleep depth=32 rbd_pool='' min_avail=4096 only_workloads=''
tree=wide files=20000 meta_depth=4 meta_threads=1 trace_passes=10
meta_phases='create stat-cold stat-warm open-read-close readdirplus rename mkdir-rmdir unlink trace'
matrix='' full=0 modes='busy adaptive interrupt' drivers='sleep busy' setups='oversubscribed dedicated'
while [[ $# -gt 0 ]]; do
  case $1 in
    --matrix) matrix=$2; shift 2 ;;
    --full) full=1; shift ;;
    --modes) modes=$2; shift 2 ;;
    --drivers) drivers=$2; shift 2 ;;
    --setups) setups=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --systems) systems=$2; shift 2 ;;
    --driver) driver=$2; shift 2 ;;
    --depth) depth=$2; shift 2 ;;
    --workloads) only_workloads=$2; shift 2 ;;
    --rbd-pool) rbd_pool=$2; shift 2 ;;
    --min-avail) min_avail=$2; shift 2 ;;
    --tree) tree=$2; shift 2 ;;
    --files) files=$2; shift 2 ;;
    --meta-depth) meta_depth=$2; shift 2 ;;
    --meta-threads) meta_threads=$2; shift 2 ;;
    --trace-passes) trace_passes=$2; shift 2 ;;
    --meta-phases) meta_phases=$2; shift 2 ;;
    -h|--help) sed -n '2,109p' "bench/${0##*/}"; exit 0 ;;
    -*) echo "run-vhost: unknown option '$1' (--help)" >&2; exit 2 ;;
    *) break ;;
  esac
done
if [[ -z $matrix ]]; then
  matrix=poll
  if ((full)); then matrix=all; elif [[ -n $systems || -n $rbd_pool ]]; then matrix=systems; fi
fi
case $matrix in
  poll|systems|all|metadata) ;;
  *) echo "run-vhost: --matrix poll, systems, metadata or all, not '$matrix'" >&2; exit 2 ;;
esac
case $tree in
  wide|deep) ;;
  *) echo "run-vhost: --tree wide or deep, not '$tree'" >&2; exit 2 ;;
esac
if ((full)); then : "${rounds:=3}" "${seconds:=5}"; fi
if [[ $matrix == poll || $matrix == metadata ]]; then : "${rounds:=2}" "${seconds:=3}"; fi
: "${rounds:=3}" "${seconds:=5}"
# The systems comparison runs its rounds only when asked for.
systems_rounds=$rounds
[[ $matrix != poll && $matrix != metadata ]] || systems_rounds=0
if [[ $matrix == metadata ]]; then
  [[ -z $rbd_pool ]] || { echo "run-vhost: the metadata matrix runs on local images, not --rbd-pool" >&2; exit 2; }
  : "${systems:=keelfsd virtiofsd virtiofsd-pool}"
fi
kind=vhost
if [[ -n $rbd_pool ]]; then
  kind=vhost-rbd
  : "${systems:=keelfsd-rbd keelfsd-rbd-irq}"
else
  : "${systems:=keelfsd keelfsd-irq keelfsd-tmpfs keelfsd-pmem virtiofsd virtiofsd-pool}"
fi
[[ $matrix != poll ]] || systems=''
[[ $matrix == systems || -z $rbd_pool ]] || { echo "run-vhost: the poll-mode matrix runs on a local image, not --rbd-pool" >&2; exit 2; }
if [[ $matrix == poll ]]; then
  out=${1:-bench/results/$kind-poll-$(date +%F).json}
elif [[ $matrix == metadata ]]; then
  out=${1:-bench/results/$kind-meta-$(date +%F).json}
else
  out=${1:-bench/results/$kind-$(date +%F).json}
fi
# Whether any system serves a local image (the RAM images, loop devices
# and ext4 mount are made only then).
local_systems=0
for sys in $systems; do
  case $sys in
    keelfsd-rbd*) [[ -n $rbd_pool ]] || { echo "run-vhost: $sys needs --rbd-pool POOL" >&2; exit 2; } ;;
    *) local_systems=1 ;;
  esac
done
osd_flags=()
if [[ -n $rbd_pool ]]; then
  mapfile -t osds < <(pgrep -x ceph-osd)
  if [[ ${#osds[@]} -ne 1 ]]; then
    echo "run-vhost: --rbd-pool wants exactly one ceph-osd on this host, found ${#osds[@]}" >&2
    exit 2
  fi
  osd_flags=(--osd-pid "${osds[0]}")
fi
# With --rbd-pool, stop (cleanly, removing the images) when memory runs low.
# shellcheck source=bench/memory.sh
. bench/memory.sh
. bench/poll_state.sh
check_memory() { [[ -z $rbd_pool ]] || stop_below_min_avail run-vhost "$min_avail"; }
check_memory
case $driver in
  sleep|eventfd) driver_flags=(--driver sleep) ;;
  busy|spin) driver_flags=(--driver busy) ;;
  *) echo "run-vhost: --driver sleep or busy, not '$driver'" >&2; exit 2 ;;
esac
last_cpu=$(($(nproc) - 1))
if [[ $matrix != systems && $matrix != metadata && " $setups " == *" dedicated "* && $last_cpu -lt 1 ]]; then
  echo "run-vhost: the dedicated setup needs two CPUs or more" >&2
  exit 2
fi
virtiofsd=$(command -v virtiofsd || echo "$HOME/.cargo/bin/virtiofsd")
if [[ " $systems " == *" virtiofsd"* && ! -x $virtiofsd ]]; then
  echo "run-vhost: virtiofsd is missing: cargo install virtiofsd" >&2
  exit 2
fi
cargo build --release -q -p keelfsd -p keelfs-bench
target=${CARGO_TARGET_DIR:-$PWD/target}
keelfsd=$target/release/keelfsd
bench=$target/release/keelfs-bench
work=$(mktemp -d /dev/shm/keelfs-vhost-bench.XXXXXX)
loops=()
rbd_images=()
daemon_pid=
cleanup() {
  if [[ -n $daemon_pid ]] && kill -TERM "$daemon_pid" 2>/dev/null; then
    wait "$daemon_pid" 2>/dev/null || true
  fi
  mountpoint -q "$work/ext4" && umount "$work/ext4"
  for l in "${loops[@]}"; do losetup -d "$l" 2>/dev/null || true; done
  for i in "${rbd_images[@]}"; do rbd rm --no-progress "$rbd_pool/$i" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

# Images are preallocated, as a real device is: on a sparse tmpfs file the
# first write to each page allocates it, io_uring punts such writes to its
# worker threads, and appends (always to fresh blocks) would pay that while
# overwrites do not.
# They are also written once through: tmpfs makes the first write to a
# fallocated page slower than later ones (it zeroes it), which again taxed
# appends more than overwrites; a device that has been in use pays nothing
# of the kind.
size=3G
# attach IMG: a loop device over it, configured alike for both daemons,
# in $attached (not in a subshell, so that cleanup sees it in $loops).
attach() {
  attached=$(losetup -f --show "$1")
  loops+=("$attached")
}
if ((local_systems)); then
  for img in keelfs keelfs-tmpfs keelfs-pmem ext4; do
    fallocate -l $size "$work/$img.img"
    dd if=/dev/zero of="$work/$img.img" bs=1M count=3072 conv=notrunc status=none
  done
  attach "$work/keelfs.img"; keelfs_loop=$attached
  attach "$work/ext4.img"; ext4_loop=$attached
  "$keelfsd" mkfs "$keelfs_loop" --force >/dev/null 2>&1
  "$keelfsd" mkfs "$work/keelfs-tmpfs.img" --force >/dev/null 2>&1
  "$keelfsd" mkfs "$work/keelfs-pmem.img" --force >/dev/null 2>&1
  mkfs.ext4 -q -F "$ext4_loop"
  mkdir -p "$work/ext4"
  mount "$ext4_loop" "$work/ext4"
fi
# rbd_image NAME MiB: an image in the pool, written once through like the
# RAM images (a write to an RBD object that does not exist yet creates
# it, and a read of one never reaches the OSD).
rbd_image() {
  rbd create --size "$2M" "$rbd_pool/$1"
  rbd_images+=("$1")
  qemu-img bench -q -f raw -t none -w --pattern=90 -s 4M -d 8 -c "$(($2 / 4))" "rbd:$rbd_pool/$1"
}
if [[ -n $rbd_pool ]]; then
  keelfs_rbd=rbd:$rbd_pool/bench-vhost-keelfs-$$
  rbd_image "bench-vhost-keelfs-$$" 1024
  "$keelfsd" mkfs "$keelfs_rbd" --force >/dev/null 2>&1
  rbd_image "bench-vhost-dev-$$" 256
  rbd_image "bench-vhost-qemu-$$" 256
fi

wait_socket() {
  for _ in $(seq 200); do [[ -S $1 ]] && return 0; sleep 0.05; done
  echo "run-vhost: $1 never appeared" >&2
  return 1
}

# start SYSTEM CACHE: sets daemon_pid and socket; CACHE "default" gives
# each daemon its own default
start() {
  local sys=$1 cache=$2
  local cache_flag=(--cache "$cache")
  [[ $cache != default ]] || { cache=auto; [[ $sys == virtiofsd* ]] || cache_flag=(); }
  socket=$work/$sys.sock
  rm -f "$socket"
  local sandbox=namespace
  [[ $sys == *-nosandbox ]] && sandbox=none
  case $sys in
    keelfsd|keelfsd-nosandbox) "$keelfsd" serve --sandbox "$sandbox" --device "$keelfs_loop" --socket "$socket" --queues 2 "${cache_flag[@]}" 2>"$work/$sys.log" & ;;
    keelfsd-irq) "$keelfsd" serve --config <(printf '[daemon]\npoll_mode="interrupt"\n[[device]]\nname="d"\npath="%s"\n[[export]]\ntag="d"\ndevice="d"\nsocket="%s"\nrequest_queues=2\ncache="%s"\n' "$keelfs_loop" "$socket" "$cache") 2>"$work/$sys.log" & ;;
    keelfsd-tmpfs) "$keelfsd" serve --device "$work/keelfs-tmpfs.img" --socket "$socket" --queues 2 --cache "$cache" 2>"$work/$sys.log" & ;;
    keelfsd-rbd|keelfsd-rbd-nosandbox) "$keelfsd" serve --sandbox "$sandbox" --device "$keelfs_rbd" --socket "$socket" --queues 2 --cache "$cache" 2>"$work/$sys.log" & ;;
    keelfsd-rbd-irq) "$keelfsd" serve --sandbox "$sandbox" --config <(printf '[daemon]\npoll_mode="interrupt"\n[[device]]\nname="r"\nbackend="rbd"\npath="%s"\n[[export]]\ntag="r"\ndevice="r"\nsocket="%s"\nrequest_queues=2\ncache="%s"\n' "$keelfs_rbd" "$socket" "$cache") 2>"$work/$sys.log" & ;;
    keelfsd-pmem|keelfsd-pmem-nosandbox) "$keelfsd" serve --sandbox "$sandbox" --config <(printf '[[device]]\nname="p"\nbackend="pmem"\npath="%s"\n[[export]]\ntag="p"\ndevice="p"\nsocket="%s"\nrequest_queues=2\ncache="%s"\n' "$work/keelfs-pmem.img" "$socket" "$cache") 2>"$work/$sys.log" & ;;
    virtiofsd) "$virtiofsd" --socket-path "$socket" --shared-dir "$work/ext4" --cache "$cache" --sandbox none --allow-direct-io 2>"$work/$sys.log" & ;;
    virtiofsd-pool) "$virtiofsd" --socket-path "$socket" --shared-dir "$work/ext4" --cache "$cache" --sandbox none --allow-direct-io \
      --thread-pool-size 16 2>"$work/$sys.log" & ;;
  esac
  daemon_pid=$!
  wait_socket "$socket"
}

stop() {
  kill -TERM "$daemon_pid" 2>/dev/null || true
  wait "$daemon_pid" 2>/dev/null || true
  daemon_pid=
}

# workload, bench flags, keelfsd cache mode, virtiofsd cache mode
# aio-append's file wraps at 2 GiB (the bench truncates it and starts over),
# so that the preallocated images never fill; at 512 MiB with --rbd-pool.
append_size=2G
[[ -z $rbd_pool ]] || append_size=512M
workloads=(
  "dio-overwrite|--threads 1 --iodepth $depth --file-size 256M|none|never"
  "dio-randrw|--threads 1 --iodepth $depth --file-size 256M|none|never"
  "aio-append|--threads 1 --iodepth $depth --file-size $append_size|none|never"
  "buffered-randrw|--threads 1 --iodepth 4 --file-size 256M|auto|auto"
  "byte-writes|--threads 1 --iodepth 1 --file-size 256M|auto|auto"
)
if [[ -n $only_workloads ]]; then
  chosen=()
  for name in $only_workloads; do
    found=''
    for line in "${workloads[@]}"; do
      [[ ${line%%|*} != "$name" ]] || { chosen+=("$line"); found=1; }
    done
    [[ -n $found ]] || { echo "run-vhost: no workload '$name' (--help)" >&2; exit 2; }
  done
  workloads=("${chosen[@]}")
fi
: >"$out"
if ((local_systems)); then
  fallocate -l 256M "$work/raw.img"
  dd if=/dev/zero of="$work/raw.img" bs=1M count=256 conv=notrunc status=none
  attach "$work/raw.img"; raw_loop=$attached
fi
for round in $(seq "$systems_rounds"); do
  # The device limit, in the same round: fio's io_uring engine on a raw
  # RAM-backed file and on a loop device over it (and keelfs's own block
  # layer beside it), 4k random writes at the DIO workloads' depth.
  if ((local_systems)); then
    for dev in device:"$work/raw.img" device-loop:"$raw_loop"; do
      "$bench" bdev --backend uring --path "${dev#*:}" --size 256M --rw randwrite --bs 4k --iodepth 32 \
        --seconds "$seconds" --vs-fio --json | sed "s/^{/{\"round\":$round,\"label\":\"${dev%%:*}\",/" | tee -a "$out"
    done
  fi
  # On RBD: qemu-img bench through QEMU's rbd driver, and keelfs's block
  # layer, each on an image of its own: 4k writes and reads stepping
  # through it, and 4k sequential writes.
  if [[ -n $rbd_pool ]]; then
    first=()
    ((round % 2)) || first=(--peer-first)
    stride=$((4099 * 4096))
    for dev in "device-rbd:--rw write --step $stride --count 65536" "device-rbd-read:--rw read --step $stride" \
      "device-rbd-seq:--rw write --count 65536"; do
      check_memory
      # shellcheck disable=SC2086  # ${dev#*:} is a list of options: split on purpose
      "$bench" bdev --backend rbd --path "rbd:$rbd_pool/bench-vhost-dev-$$" --size 256M ${dev#*:} \
        --bs 4k --iodepth "$depth" --wait eventfd --seconds "$seconds" \
        --vs-qemu-img "rbd:$rbd_pool/bench-vhost-qemu-$$" "${first[@]}" "${osd_flags[@]}" --json |
        sed "s/^{/{\"round\":$round,\"label\":\"${dev%%:*}\",/" | tee -a "$out"
    done
  fi
  for line in "${workloads[@]}"; do
    IFS='|' read -r workload flags kcache vcache <<<"$line"
    for sys in $systems; do
      cache=$kcache; [[ $sys == virtiofsd* ]] && cache=$vcache
      check_memory
      start "$sys" "$cache"
      # shellcheck disable=SC2086  # $flags is a list of options: split on purpose
      "$bench" vhost --socket "$socket" --workload "$workload" $flags --seconds "$seconds" \
        --daemon-pid "$daemon_pid" --label "$sys" "${driver_flags[@]}" "${osd_flags[@]}" --json |
        sed "s/^{/{\"round\":$round,/" | tee -a "$out"
      stop
    done
  done
done

# poll_run ROUND WORKLOAD FLAGS CACHE SETUP DRIVER MODE: one result line of
# the poll-mode matrix.
poll_run() {
  local round=$1 workload=$2 flags=$3 cache=$4 setup=$5 drv=$6 mode=$7
  local reactors=1 threads=2 pin=()
  if [[ $setup == dedicated ]]; then
    reactors="[$last_cpu]" threads=1 pin=(taskset -c "0-$((last_cpu - 1))")
  fi
  socket=$work/poll.sock
  rm -f "$socket"
  "$keelfsd" serve --config <(printf '[daemon]\npoll_mode="%s"\nreactors=%s\nrpc_socket="%s"\n[[device]]\nname="d"\npath="%s"\n[[export]]\ntag="d"\ndevice="d"\nsocket="%s"\nrequest_queues=2\ncache="%s"\n' \
    "$mode" "$reactors" "$work/poll.rpc" "$poll_loop" "$socket" "$cache") 2>"$work/poll-$mode.log" &
  daemon_pid=$!
  wait_socket "$socket"
  # shellcheck disable=SC2086  # $flags is a list of options: split on purpose
  "${pin[@]}" "$bench" vhost --socket "$socket" --workload "$workload" $flags --threads "$threads" --queues 2 \
    --seconds "$seconds" --daemon-pid "$daemon_pid" --label "keelfsd-$mode-$setup" --driver "$drv" --json |
    sed "s/^{/{\"round\":$round,\"poll_mode\":\"$mode\",\"setup\":\"$setup\",/" | tee -a "$out"
  poll_state "$keelfsd" "$work/poll.rpc" \
    "\"round\":$round,\"poll_mode\":\"$mode\",\"setup\":\"$setup\",\"driver\":\"$drv\",\"workload\":\"$workload\"," |
    tee -a "$out"
  stop
}

if [[ $matrix == poll || $matrix == all ]]; then
  fallocate -l $size "$work/poll.img"
  dd if=/dev/zero of="$work/poll.img" bs=1M count=3072 conv=notrunc status=none
  attach "$work/poll.img"; poll_loop=$attached
  "$keelfsd" mkfs "$poll_loop" --force >/dev/null 2>&1
  poll_workloads=("${workloads[@]}")
  ((full)) || [[ -n $only_workloads ]] || poll_workloads=("${workloads[1]}" "${workloads[4]}")
  read -ra mode_list <<<"$modes"
  for round in $(seq "$rounds"); do
    # The modes' order rotates each round, so that none always runs first.
    shift_by=$(((round - 1) % ${#mode_list[@]}))
    order=("${mode_list[@]:shift_by}" "${mode_list[@]:0:shift_by}")
    for line in "${poll_workloads[@]}"; do
      IFS='|' read -r workload flags kcache _ <<<"$line"
      flags=${flags/--threads 1/}
      for setup in $setups; do
        for drv in $drivers; do
          for mode in "${order[@]}"; do
            poll_run "$round" "$workload" "$flags" "$kcache" "$setup" "$drv" "$mode"
          done
        done
      done
    done
  done
  python3 bench/poll_summary.py "$out" | tee "${out%.json}.summary.txt" >&2
fi

# meta_run ROUND SYSTEM DRIVER PHASE WORKLOAD FLAGS...: one phase of the
# metadata matrix, on a daemon started for it.
meta_run() {
  local round=$1 sys=$2 drv=$3 phase=$4 workload=$5 threads=$meta_threads
  shift 5
  # A trace replays one request at a time, on one thread.
  [[ $workload != trace ]] || threads=1
  start "$sys" default
  "$bench" vhost --socket "$socket" --workload "$workload" --tree "$tree" --files "$files" \
    --threads "$threads" --iodepth "$meta_depth" --seconds "$seconds" --driver "$drv" \
    --daemon-pid "$daemon_pid" --label "$sys" --json "$@" |
    sed "s/^{/{\"round\":$round,\"phase\":\"$phase\",/" | tee -a "$out"
  stop
}

if [[ $matrix == metadata ]]; then
  xz -dc bench/workloads/untar-libc.trace.xz >"$work/untar.trace"
  read -ra meta_systems <<<"$systems"
  for round in $(seq "$rounds"); do
    shift_by=$(((round - 1) % ${#meta_systems[@]}))
    order=("${meta_systems[@]:shift_by}" "${meta_systems[@]:0:shift_by}")
    for drv in $drivers; do
      for sys in "${order[@]}"; do
        for phase in $meta_phases; do
          case $phase in
            stat-cold)
              # Cold: the host's dentry, inode and page caches dropped,
              # and the daemon just started (keelfsd mounts its image
              # again).
              sync
              echo 3 >/proc/sys/vm/drop_caches
              meta_run "$round" "$sys" "$drv" stat-cold stat --passes 1 ;;
            stat-warm) meta_run "$round" "$sys" "$drv" stat-warm stat ;;
            trace) meta_run "$round" "$sys" "$drv" trace trace --trace "$work/untar.trace" --passes "$trace_passes" ;;
            *) meta_run "$round" "$sys" "$drv" "$phase" "$phase" ;;
          esac
        done
      done
    done
  done
  python3 bench/meta_summary.py "$out" | tee "${out%.json}.summary.txt" >&2
fi
echo "run-vhost: results in $out" >&2
[[ $matrix != poll && $matrix != metadata ]] || exit 0

# The regression guard: against the vhost results committed last.
last=$(git log --format= --name-only --diff-filter=AM -- "bench/results/$kind-2*.json" |
  grep -v -x -F -e '' -e "$out" | head -n 1 || true)
if [[ -n $last ]]; then
  echo "run-vhost: against $last (bench/compare.py):" >&2
  python3 bench/compare.py "$last" "$out" >&2
fi
