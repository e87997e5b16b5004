#!/usr/bin/env bash
# keelfs's end-to-end suite, driven from the host: for each request-queue
# count, a fresh image, keelfsd serving it over vhost-user-fs, and a QEMU
# guest per test script (qemu-scripts/guest-tests/); then SIGTERM (the
# daemon must exit 0), fsck, a restart on the same image and a second guest
# that checks what the first wrote, SIGTERM and fsck again. With --rbd-pool
# the images are Ceph RBD images instead of files. Prints a summary table
# and exits non-zero when anything failed.
set -euo pipefail

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$script_dir/.." && pwd)
tests_dir=$script_dir/guest-tests
prog=run-e2e.sh
all_tests=(namespace fio-seeds fsx stress overlay persist crash)
default_tests=(namespace fio-seeds fsx stress overlay persist crash)

usage() {
  cat <<EOF
Usage: qemu-scripts/$prog [options]

Runs the guest end-to-end suite against keelfsd. For each queue count N in
--queues-list:
  1. keelfsd mkfs IMG; keelfsd serve --device IMG --socket SOCK --queues N
     (IMG: WORKDIR/q<N>/keelfs.img, or with --rbd-pool an RBD image)
  2. one guest boot (run-guest.sh --queues N) per test:
       namespace  guest-tests/namespace.sh   namespace operations
       fio-seeds  guest-tests/fio-seeds.sh   fio + crc32c verify, seed paths
       fsx        guest-tests/fsx.sh         fsx buffered, mmap, O_DIRECT
       stress     guest-tests/stress.sh      4 processes, namespace + data
       overlay    guest-tests/overlay.sh     overlayfs upper layer, ACLs
       persist    guest-tests/persist-write.sh (checks after umount + mount)
  3. SIGTERM: keelfsd must exit 0; keelfsd fsck IMG must exit 0
  4. (persist) keelfsd serve again on IMG; a guest runs
     guest-tests/persist-check.sh; SIGTERM, exit 0, fsck again
  5. (crash) on a second image:
     SIGKILL keelfsd in the middle of stress.sh; (RBD) keelfsd break-lock
     IMG --fence-live must exit 0 (a killed daemon's lock outlives it);
     fsck must exit 0 (journal replay); keelfsd must start again; a guest runs
     guest-tests/crash-check.sh; SIGTERM, exit 0, fsck again

Options:
  --keelfsd PATH       keelfsd binary (default: target/release/keelfsd, else
                       target/debug/keelfsd); copied into the work directory
                       first, so a rebuild during the run does not matter
  --workdir DIR        work directory for images, sockets and logs (default:
                       a new directory in /dev/shm, else in \$TMPDIR or /tmp,
                       removed after a passing run unless --keep)
  --queues-list "N.."  request-queue counts to run (default: "1 2")
  --cache MODE         keelfsd's cache mode: none, auto (default) or always
                       (writeback caching in the guest kernel)
  --spread            with 2 or more request queues, serve with --reactors 2
                      --spread-queues (queues polled on both reactors)
  --only NAMES         run only these tests (comma or space separated, from:
                       ${all_tests[*]}); repeatable
  --with-crash         (kept for compatibility; crash is in the default set
                       (${default_tests[*]})
  --crash-after SECS   crash test: SIGKILL this long after the stress workers
                       start (default: 8)
  --image-size SIZE    image size for keelfsd mkfs (default: 4G; sparse)
  --rbd-pool POOL      make every image an RBD image in Ceph pool POOL
                       (rbd:POOL/e2e-<pid>-<time>-q<N>[-crash], one per
                       run; keelfsd mkfs creates it) instead of a file in
                       the work directory, served sandboxed as by default.
                       The cluster is the default one (/etc/ceph/ceph.conf,
                       client.admin; e.g. scripts/ceph-dev.sh up, pool
                       keelfs). Images are removed (rbd rm) when the files
                       would be: kept after a failure or with --keep
  --timeout SECS       per guest boot (default: 600)
  --fsx-ops N          fsx's operations per mode in the fsx test (default:
                       the guest script's, 8000)
  --stress-iters N     iterations per worker in the stress test (default:
                       the guest script's, 120; the crash test's stress run
                       is killed early either way)
  --keep               keep the work directory (images, logs) after a pass
  --verbose            stream the guests' consoles (default: only on failure,
                       the log tail)
  --accel A            auto, kvm or tcg for the guests (run-guest.sh --accel;
                       default auto: KVM only when it boots the guest kernel)
  -h, --help           show this help

Logs: WORKDIR/logs/q<N>-<test>.log (guest console and run-guest.sh),
WORKDIR/q<N>/daemon-<k>.log (keelfsd stdout/stderr), fsck output in
WORKDIR/logs/q<N>-fsck-<k>.log, break-lock's in
WORKDIR/logs/q<N>-crash-break-lock.log.
EOF
}

# shellcheck source=qemu-scripts/lib.sh
source "$script_dir/lib.sh"
log() { echo "$prog: $*" >&2; }

keelfsd_src=""
workdir=""
queues_list="1 2"
only=()
image_size=4G
timeout=600
keep=0
verbose=0
with_crash=0
crash_after=8
spread=0
cache=auto
rbd_pool=""
# Kernel command line words for the guests' /init (build-guest.sh), which
# hands them to the test scripts as FSX_OPS and STRESS_ITERS.
guest_append=()
positive() { [[ $2 =~ ^[1-9][0-9]*$ ]] || die "$1: '$2' is not a positive integer"; }
while (($#)); do
  case "$1" in
    --keelfsd) need_arg "$1" $#; keelfsd_src=$2; shift 2 ;;
    --workdir) need_arg "$1" $#; workdir=$2; shift 2 ;;
    --queues-list) need_arg "$1" $#; queues_list=$2; shift 2 ;;
    --only) need_arg "$1" $#; read -r -a more <<<"${2//,/ }"; only+=("${more[@]}"); shift 2 ;;
    --image-size) need_arg "$1" $#; image_size=$2; shift 2 ;;
    --timeout) need_arg "$1" $#; timeout=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    --with-crash) with_crash=1; shift ;;
    --spread) spread=1; shift ;;
    --cache) need_arg "$1" $#; cache=$2; shift 2 ;;
    --crash-after) need_arg "$1" $#; crash_after=$2; shift 2 ;;
    --rbd-pool) need_arg "$1" $#; rbd_pool=$2; shift 2 ;;
    --fsx-ops) need_arg "$1" $#; positive "$1" "$2"; guest_append+=("keelfs.fsx_ops=$2"); shift 2 ;;
    --stress-iters) need_arg "$1" $#; positive "$1" "$2"; guest_append+=("keelfs.stress_iters=$2"); shift 2 ;;
    --verbose) verbose=1; shift ;;
    --accel) need_arg "$1" $#; set_accel "$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

for q in $queues_list; do [[ $q =~ ^[1-9][0-9]*$ ]] || die "--queues-list: '$q' is not a positive integer"; done
[[ -n ${queues_list// /} ]] || die "--queues-list is empty"
[[ $timeout =~ ^[0-9]+$ ]] || die "--timeout '$timeout' is not a number of seconds"
for t in "${only[@]}"; do
  [[ " ${all_tests[*]} " == *" $t "* ]] || die "--only: unknown test '$t' (tests: ${all_tests[*]})"
done
[[ $cache =~ ^(none|auto|always)$ ]] || die "--cache '$cache': none, auto or always"
[[ $crash_after =~ ^[0-9]+$ ]] || die "--crash-after '$crash_after' is not a number of seconds"
if [[ -n $rbd_pool ]]; then
  [[ $rbd_pool =~ ^[A-Za-z0-9._-]{1,128}$ ]] || die "--rbd-pool '$rbd_pool': 1 to 128 of A-Z a-z 0-9 . _ -"
  command -v rbd >/dev/null || die "rbd not found (scripts/setup.sh installs ceph-common)"
fi
((${#only[@]})) || only=("${default_tests[@]}")
((with_crash == 0)) || only+=(crash)
selected() { [[ " ${only[*]} " == *" $1 "* ]]; }

[[ -n $keelfsd_src ]] || keelfsd_src=$(find_keelfsd)
[[ -x $keelfsd_src ]] || die "--keelfsd $keelfsd_src: not an executable"
command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 not found (scripts/setup.sh installs it)"

make_workdir e2e
mkdir -p "$workdir/logs"
keelfsd=$workdir/keelfsd
cp "$keelfsd_src" "$keelfsd"

# ------------------------------------------------------------ images --
# With --rbd-pool, image names unique to this run: a name left by an
# earlier run that failed is never formatted over.
rbd_run=e2e-$$-$(date +%s)
rbd_images=()
# image_for FILE NAME: FILE, or with --rbd-pool the RBD image NAME of
# this run.
image_for() {
  if [[ -n $rbd_pool ]]; then
    echo "rbd:$rbd_pool/$rbd_run-$2"
  else
    echo "$1"
  fi
}
# remove_image IMG: a file, or an RBD image (rbd rm; one that does not
# exist is fine, one still open elsewhere is reported and kept).
remove_image() {
  case $1 in
    rbd:*)
      local spec=${1#rbd:} out i
      if ! out=$(rbd rm --no-progress "$spec" 2>&1) && [[ $out != *"No such file"* ]]; then
        log "rbd rm $spec failed, image kept: $out"
        return 0
      fi
      for i in "${!rbd_images[@]}"; do
        [[ ${rbd_images[i]} != "$1" ]] || unset 'rbd_images[i]'
      done
      ;;
    *) rm -f "$1" ;;
  esac
}
# mkfs_image IMG LOG: keelfsd mkfs (which creates an RBD image).
mkfs_image() {
  remove_image "$1"
  [[ $1 != rbd:* ]] || rbd_images+=("$1")
  "$keelfsd" mkfs "$1" --size "$image_size" >"$2" 2>&1
}

# ------------------------------------------------------------ processes --
daemon_pid=""
guest_pid=""
# shellcheck disable=SC2317  # invoked by traps
cleanup() {
  stop_guest_and_daemon "$guest_pid" "$daemon_pid" 50
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT TERM

# ------------------------------------------------------------ results --
rows=()
nfail=0
# record TEST QUEUES RESULT SECONDS [NOTE]
record() {
  rows+=("$(printf '%-26s %-6s %-6s %7s  %s' "$1" "$2" "$3" "$4" "${5:-}")")
  [[ $3 == PASS ]] || nfail=$((nfail + 1))
  printf '%s: %-26s queues=%s %s (%ss)%s\n' "$prog" "$1" "$2" "$3" "$4" "${5:+ $5}" >&2
}
daemon_tail() { # LOG
  echo "----- keelfsd log tail ($1):"
  tail -n 30 "$1" | sed 's/^/  | /'
}

# start_daemon IMG SOCK QUEUES LOG: starts keelfsd, waits for its socket
# and its sandbox.
start_daemon() {
  local img=$1 sock=$2 q=$3 dlog=$4 extra=()
  rm -f "$sock"
  ((spread && q > 1)) && extra=(--reactors 2 --spread-queues)
  [[ -z ${5:-} ]] || extra+=(--rpc "$5")
  "$keelfsd" serve --device "$img" --socket "$sock" --queues "$q" --cache "$cache" "${extra[@]}" >"$dlog" 2>&1 &
  daemon_pid=$!
  for _ in $(seq 1 150); do
    [[ -S $sock ]] && break
    kill -0 "$daemon_pid" 2>/dev/null || break
    sleep 0.2
  done
  # Every daemon here serves sandboxed, as by default (RBD included: the
  # suite must not pass on a daemon that left its sandbox). The socket is
  # bound before the sandbox is entered.
  local deadline=$((SECONDS + 30))
  if [[ -S $sock ]] && wait_log "$dlog" 'sandboxed: namespaces' "$daemon_pid"; then
    return 0
  fi
  if [[ -S $sock ]] && kill -0 "$daemon_pid" 2>/dev/null; then
    kill -KILL "$daemon_pid"; wait "$daemon_pid" 2>/dev/null || true
    echo "keelfsd made $sock but did not say it was sandboxed within 30 s"
    daemon_pid=""
    daemon_tail "$dlog"
    return 1
  fi
  local st=0
  if kill -0 "$daemon_pid" 2>/dev/null; then
    kill -KILL "$daemon_pid"; wait "$daemon_pid" 2>/dev/null || true
    echo "keelfsd did not create $sock within 30 s"
  else
    wait "$daemon_pid" || st=$?
    echo "keelfsd exited with status $st before creating $sock"
  fi
  daemon_pid=""
  daemon_tail "$dlog"
  return 1
}

# stop_daemon QUEUES LOG LABEL: SIGTERM, wait up to 60 s; must exit 0.
stop_daemon() {
  local q=$1 dlog=$2 label=$3 t0=$SECONDS st=0
  if [[ -z $daemon_pid ]]; then
    record "$label" "$q" FAIL 0 "keelfsd was not running"
    return 1
  fi
  kill -TERM "$daemon_pid" 2>/dev/null || true
  for _ in $(seq 1 300); do kill -0 "$daemon_pid" 2>/dev/null || break; sleep 0.2; done
  if kill -0 "$daemon_pid" 2>/dev/null; then
    kill -KILL "$daemon_pid" 2>/dev/null || true
    wait "$daemon_pid" 2>/dev/null || true
    daemon_pid=""
    record "$label" "$q" FAIL $((SECONDS - t0)) "keelfsd still running 60 s after SIGTERM (killed)"
    daemon_tail "$dlog"
    return 1
  fi
  wait "$daemon_pid" || st=$?
  daemon_pid=""
  if ((st == 0)); then
    record "$label" "$q" PASS $((SECONDS - t0))
  else
    record "$label" "$q" FAIL $((SECONDS - t0)) "keelfsd exited $st after SIGTERM"
    daemon_tail "$dlog"
    return 1
  fi
}

# run_fsck IMG QUEUES K
run_fsck() {
  local img=$1 q=$2 k=$3 t0=$SECONDS st=0 flog="$workdir/logs/q$2-fsck-$3.log"
  "$keelfsd" fsck "$img" >"$flog" 2>&1 || st=$?
  if ((st == 0)); then
    record "fsck ($k)" "$q" PASS $((SECONDS - t0)) "$(grep -m1 'clean' "$flog" | sed 's/^[^:]*: //')"
  else
    record "fsck ($k)" "$q" FAIL $((SECONDS - t0)) "keelfsd fsck exited $st"
    sed 's/^/  | /' "$flog" | tail -n 40
  fi
}

# run_test NAME QUEUES SOCK SCRIPT [run-guest.sh args...]
run_test() {
  local name=$1 q=$2 sock=$3 script=$4 t0=$SECONDS st=0 note=""
  shift 4
  local glog="$workdir/logs/q$q-$name.log"
  if [[ -z $daemon_pid ]] || ! kill -0 "$daemon_pid" 2>/dev/null; then
    record "$name" "$q" FAIL 0 "keelfsd is not running"
    return 1
  fi
  log "q=$q $name: guest running $(basename "$script") (log: $glog)"
  ((${#guest_append[@]} == 0)) || set -- --append "${guest_append[*]}" "$@"
  if ((verbose)); then
    "$script_dir/run-guest.sh" --socket "$sock" --queues "$q" --timeout "$timeout" \
      --script "$script" "$@" > >(tee "$glog") 2>&1 &
  else
    "$script_dir/run-guest.sh" --socket "$sock" --queues "$q" --timeout "$timeout" \
      --script "$script" "$@" >"$glog" 2>&1 &
  fi
  guest_pid=$!
  wait "$guest_pid" || st=$?
  guest_pid=""
  case $st in
    0) ;;
    124) note="guest timed out after ${timeout}s" ;;
    126) note="the guest stalled (no heartbeat for a minute; its kernel's report is in the log)" ;;
    125) note="QEMU ended without the guest's exit status (crash or panic)" ;;
    *) note="guest script exited $st: $(grep -a '^FAIL' "$glog" | head -n 3 | tr -d '\r' | paste -sd';' - || true)" ;;
  esac
  # The guest suites skip nothing: a SKIP line is a check that did not run.
  local skips
  skips=$(grep -ac '^SKIP' "$glog" || true)
  if ((skips > 0 && st == 0)); then
    st=1
    note="$skips check(s) skipped: $(grep -a '^SKIP' "$glog" | head -n 3 | tr -d '\r' | paste -sd';' -)"
  fi
  if ! kill -0 "$daemon_pid" 2>/dev/null; then
    local dst=0
    wait "$daemon_pid" || dst=$?
    daemon_pid=""
    note="keelfsd died during the test (exit status $dst); $note"
    ((st != 0)) || st=1
  fi
  if ((st == 0)); then
    record "$name" "$q" PASS $((SECONDS - t0))
  else
    record "$name" "$q" FAIL $((SECONDS - t0)) "$note"
    echo "----- guest log tail ($glog):"
    grep -a -v '^PASS' "$glog" | tail -n 50 | sed 's/^/  | /'
    daemon_tail "$current_dlog"
    return 1
  fi
}

# requests_served RPC: the virtio-fs requests keelfsd has answered so far.
requests_served() {
  "$keelfsd" stats --rpc "$1" 2>/dev/null |
    python3 -c 'import json, sys; print(sum(r["virtio_fs_requests"] for r in json.load(sys.stdin)["reactors"]))' ||
    echo unknown
}

# run_crash QUEUES DIR: SIGKILL keelfsd under stress.sh, then fsck, restart,
# crash-check.sh, SIGTERM, fsck. The kill counts only if the guest was
# still at work when it landed: keelfsd answered requests in the second
# before it, and the workers had not finished.
run_crash() {
  local q=$1 dir=$2 img sock=$2/crash.sock rpc=$2/crash.rpc t0=$SECONDS
  local glog="$workdir/logs/q$q-crash-load.log" started=0 before=unknown after=unknown busy=0
  img=$(image_for "$dir/crash.img" "q$q-crash")
  if ! mkfs_image "$img" "$workdir/logs/q$q-crash-mkfs.log"; then
    record "crash: mkfs" "$q" FAIL 0 "see $workdir/logs/q$q-crash-mkfs.log"
    return 1
  fi
  current_dlog=$dir/daemon-crash-1.log
  start_daemon "$img" "$sock" "$q" "$current_dlog" "$rpc" || { record "crash: keelfsd start" "$q" FAIL 0; return 1; }
  log "q=$q crash: guest running stress.sh; SIGKILL to keelfsd ${crash_after}s after the workers start (log: $glog)"
  "$script_dir/run-guest.sh" --socket "$sock" --queues "$q" --timeout "$timeout" \
    --script "$tests_dir/stress.sh" >"$glog" 2>&1 &
  guest_pid=$!
  for _ in $(seq 1 600); do
    grep -aq '^=== .* workers x' "$glog" && { started=1; break; }
    kill -0 "$guest_pid" 2>/dev/null || break
    sleep 0.2
  done
  if ((started)); then
    sleep $((crash_after > 1 ? crash_after - 1 : 0))
    before=$(requests_served "$rpc")
    sleep 1
    after=$(requests_served "$rpc")
    # Workers still running: stress.sh prints "workers took" when they end.
    if [[ $before =~ ^[0-9]+$ && $after =~ ^[0-9]+$ ]] && ((after > before)) &&
      kill -0 "$guest_pid" 2>/dev/null && ! grep -aq '^workers took' "$glog"; then
      busy=1
    fi
  fi
  kill -KILL "$daemon_pid" 2>/dev/null || true
  wait "$daemon_pid" 2>/dev/null || true
  daemon_pid=""
  # The guest hangs on its lost device: stop it.
  kill -TERM "$guest_pid" 2>/dev/null || true
  wait "$guest_pid" 2>/dev/null || true
  guest_pid=""
  if ((started && busy)); then
    record "crash: SIGKILL mid-stress" "$q" PASS $((SECONDS - t0)) \
      "killed ${crash_after}s after the workers started, $((after - before)) requests in the last second"
  elif ((started)); then
    record "crash: SIGKILL mid-stress" "$q" FAIL $((SECONDS - t0)) \
      "the guest was not at work when SIGKILL landed (requests served: $before, then $after a second later; see $glog)"
  else
    record "crash: SIGKILL mid-stress" "$q" FAIL $((SECONDS - t0)) "the stress workers never started (see $glog)"
  fi
  [[ $img != rbd:* ]] || break_lock "$img" "$q"
  run_fsck "$img" "$q" crash
  current_dlog=$dir/daemon-crash-2.log
  t0=$SECONDS
  if ! start_daemon "$img" "$sock" "$q" "$current_dlog"; then
    record "crash: keelfsd restart" "$q" FAIL $((SECONDS - t0)) "$(tail -n 1 "$current_dlog")"
    return 1
  fi
  record "crash: keelfsd restart" "$q" PASS $((SECONDS - t0))
  run_test crash-check "$q" "$sock" "$tests_dir/crash-check.sh" || true
  stop_daemon "$q" "$current_dlog" "keelfsd SIGTERM (crash)" || true
  run_fsck "$img" "$q" crash-2
  ((nfail > 0 || keep)) || remove_image "$img"
}

# break_lock IMG QUEUES: an RBD image's lock outlives a killed keelfsd
# (its client's watch lingers for about 30 s): fence the dead client and
# break its lock, as an operator would before serving the image again.
break_lock() {
  local img=$1 q=$2 t0=$SECONDS st=0 blog="$workdir/logs/q$2-crash-break-lock.log"
  "$keelfsd" break-lock "$img" --fence-live >"$blog" 2>&1 || st=$?
  if ((st == 0)); then
    record "crash: break-lock" "$q" PASS $((SECONDS - t0)) "$(tail -n 1 "$blog" | sed 's/^rbd:[^ ]*: //')"
  else
    record "crash: break-lock" "$q" FAIL $((SECONDS - t0)) "keelfsd break-lock --fence-live exited $st"
    sed 's/^/  | /' "$blog" | tail -n 20
  fi
}

# ------------------------------------------------------------ the run --
suite_t0=$SECONDS
log "keelfsd: $keelfsd_src (copied to $keelfsd)"
log "work directory: $workdir"
log "queues: $queues_list; cache: $cache; tests: ${only[*]}"
[[ -z $rbd_pool ]] || log "images: RBD, rbd:$rbd_pool/$rbd_run-*"
"$script_dir/build-guest.sh" --quiet || die "building the guest failed"
log "guest: kernel $(cat "$script_dir/.guest/kernel-version"), $(qemu-system-x86_64 --version | head -n1)"

current_dlog=""
for q in $queues_list; do
  dir=$workdir/q$q
  mkdir -p "$dir"
  img=$(image_for "$dir/keelfs.img" "q$q")
  sock=$dir/keelfs.sock
  if ! mkfs_image "$img" "$workdir/logs/q$q-mkfs.log"; then
    record mkfs "$q" FAIL 0 "keelfsd mkfs failed (see $workdir/logs/q$q-mkfs.log)"
    cat "$workdir/logs/q$q-mkfs.log"
    continue
  fi
  current_dlog=$dir/daemon-1.log
  if ! start_daemon "$img" "$sock" "$q" "$current_dlog"; then
    record "keelfsd start" "$q" FAIL 0 "see $current_dlog"
    continue
  fi
  for t in namespace fio-seeds fsx stress overlay; do
    selected "$t" || continue
    run_test "$t" "$q" "$sock" "$tests_dir/$t.sh" || true
  done
  if selected persist; then
    run_test persist-write "$q" "$sock" "$tests_dir/persist-write.sh" \
      --add "$tests_dir/persist-check.sh" || true
    grep -a -o 'PERSIST-MANIFEST-MD5=[0-9a-f]*' "$workdir/logs/q$q-persist-write.log" |
      tail -n 1 >"$dir/persist-expected" || true
    [[ -s $dir/persist-expected ]] ||
      record "persist: manifest md5" "$q" FAIL 0 "persist-write.sh printed no PERSIST-MANIFEST-MD5 line"
  fi
  stop_daemon "$q" "$current_dlog" "keelfsd SIGTERM (1)" || true
  run_fsck "$img" "$q" 1
  if selected persist; then
    current_dlog=$dir/daemon-2.log
    if start_daemon "$img" "$sock" "$q" "$current_dlog"; then
      # Added even when empty: persist-check.sh then fails the comparison.
      run_test persist-check-restart "$q" "$sock" "$tests_dir/persist-check.sh" \
        --add "$dir/persist-expected" || true
      stop_daemon "$q" "$current_dlog" "keelfsd SIGTERM (2)" || true
      run_fsck "$img" "$q" 2
    else
      record "keelfsd restart" "$q" FAIL 0 "see $current_dlog"
    fi
  fi
  if selected crash; then
    run_crash "$q" "$dir" || true
  fi
  if grep -aq 'panicked' "$dir"/daemon-*.log; then
    record "keelfsd log" "$q" FAIL 0 "a panic in $dir/daemon-*.log"
    grep -a -A5 'panicked' "$dir"/daemon-*.log | head -n 30
  fi
  # The image is only worth keeping when something failed.
  ((nfail > 0 || keep)) || remove_image "$img"
done

total=$((SECONDS - suite_t0))
echo
echo "keelfs e2e summary (keelfsd: $keelfsd_src, cache $cache${rbd_pool:+, RBD pool $rbd_pool})"
printf '%-26s %-6s %-6s %7s  %s\n' TEST QUEUES RESULT SECONDS NOTE
printf '%s\n' "${rows[@]}"
echo "total wall time: ${total}s ($((total / 60))m$((total % 60))s)"
echo "e2e: $((${#rows[@]} - nfail)) passed, $nfail failed"
((${#rbd_images[@]} == 0)) || echo "RBD images kept: ${rbd_images[*]} (rbd rm POOL/IMAGE removes one)"
if ((nfail > 0)); then
  echo "logs and images kept in $workdir"
  exit 1
fi
if ((auto_workdir && !keep)); then
  rm -rf "$workdir"
else
  echo "logs in $workdir"
fi
