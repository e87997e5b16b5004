#!/usr/bin/env bash
# Live migration of a running keelfs guest between two QEMUs on this host,
# each with its own keelfsd on the same image: the source keelfsd hands the
# image over to the destination's (keelfsd serve --incoming) at switch-over.
# The guest runs guest-tests/migrate.sh (held files and directories, listing
# loops, fio with crc32c verification) across the migration and checks the
# result on the destination; then both daemons get SIGTERM (exit 0) and
# keelfsd fsck must pass. The image may be a Ceph RBD image (--rbd-pool),
# and each keelfsd may run in a network namespace of its own (--src-netns,
# --dst-netns: two "hosts" on one machine). Exits with the guest script's
# status, or 1 when a host-side check failed.
set -euo pipefail

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$script_dir/.." && pwd)
prog=migrate.sh

usage() {
  cat <<EOF
Usage: qemu-scripts/$prog [options]

Live-migrates a running guest from one QEMU to another on this host, each
QEMU with its own keelfsd serving the same image, and checks the guest:

  1. keelfsd mkfs IMG --size 1G (IMG: WORKDIR/keelfs.img, or with
     --rbd-pool the RBD image rbd:POOL/migrate-<pid>-<time>)
  2. source: keelfsd serve --device IMG --socket SRC.sock --tag keelfs
     --locks export (keelfsd holds the guest's locks, which then travel
     with its session; sandboxed as by default, on RBD too), in the network
     namespace --src-netns if given; QEMU (run-guest.sh --qmp SRC.qmp)
     boots the guest running guest-tests/migrate.sh. On RBD: rbd lock ls
     shows one lock holder, at the source namespace's address if given
  3. destination: keelfsd serve --device IMG --socket DST.sock --tag keelfs
     --incoming --locks export (does not lock or mount IMG until QEMU hands it the
     migrated state), in --dst-netns if given; QEMU (run-guest.sh --qmp
     DST.qmp --incoming defer) with the same device arguments
  4. QMP, destination: migrate-set-capabilities return-path;
     migrate-incoming {"uri": "unix:WORKDIR/migrate.sock"}
  5. when the guest prints KEELFS-MIGRATE-NOW (a quiet moment: only its
     directory-listing loops run), or with --during-io 5 s after it prints
     KEELFS-IO-START (fio writing and verifying): QMP, source:
     migrate-set-capabilities return-path, auto-converge;
     migrate-set-parameters max-bandwidth 10 GiB/s, downtime-limit 500 ms;
     migrate {"uri": "unix:WORKDIR/migrate.sock"}; query-migrate every
     0.5 s until "completed"
  6. the source QEMU must be paused (query-status: postmigrate): QMP quit;
     on RBD, while the source keelfsd still runs: rbd lock ls POOL/IMAGE
     must show exactly one lock holder, at the destination namespace's
     address if given (waiting up to 30 s for the destination to take it);
     SIGTERM to the source keelfsd, which must exit 0; the destination
     QEMU must be running; the guest finishes its checks there and powers
     off
  7. SIGTERM to the destination keelfsd (exit 0); keelfsd fsck IMG (exit 0);
     on RBD, rbd rm POOL/IMAGE after a pass (unless --keep)

QEMU always runs in this shell's network namespace and reaches each
keelfsd through its unix socket (a path: it works across namespaces).
QEMU (both sides; see run-guest.sh): -machine q35,accel=tcg|kvm -cpu max|host
  -smp 2 -m 1G -object memory-backend-memfd,id=mem,size=1G,share=on
  -numa node,memdev=mem -chardev socket,id=char0,path=SOCK
  -device vhost-user-fs-pci,chardev=char0,tag=keelfs,queue-size=1024,num-request-queues=1
  -kernel ... -initrd ... -append ... -nodefaults -display none -nic none
  -no-reboot -qmp unix:QMP,server=on,wait=off
  -chardev file,id=con,path=CONSOLE,append=on -serial chardev:con
and on the destination also -incoming defer. The guest's memory must be a
shared memfd (keelfsd maps it; QEMU logs dirty pages for the migration
through the back-end: VHOST_USER_PROTOCOL_F_LOG_SHMFD and LOG_ALL), and the
back-end must support VHOST_USER_PROTOCOL_F_DEVICE_STATE: QEMU moves the
back-end's state (open inodes and handles) from the source keelfsd to the
destination's inside the migration stream.

Options:
  --keelfsd PATH       source keelfsd (default: target/release/keelfsd, else
                       target/debug/keelfsd); copied into the work directory
  --keelfsd-dest PATH  destination keelfsd (default: the same); it also runs
                       the final fsck. qemu-scripts/upgrade.sh passes a new
                       build here
  --during-io          migrate while fio I/O is in flight (5 s after the
                       guest starts fio) instead of in the quiet period
  --rbd-pool POOL      the image is a new RBD image in Ceph pool POOL
                       (rbd:POOL/migrate-<pid>-<time>; default cluster:
                       /etc/ceph/ceph.conf, client.admin), made by keelfsd
                       mkfs, served by both daemons (sandboxed), its
                       lock holder checked with rbd lock ls, and removed
                       (rbd rm) after a pass unless --keep
  --src-netns NAME     run the source keelfsd in network namespace NAME
                       (/run/netns/NAME; nsenter --net: only the network is
                       the namespace's, files and sockets are shared), e.g.
                       one made by scripts/ceph-dev.sh host add NAME ADDR
  --dst-netns NAME     the same for the destination keelfsd; with
                       --rbd-pool, the lock holder after the migration must
                       have this namespace's IPv4 address
  --timeout SECS       give up after SECS (default: 300)
  --workdir DIR        work directory (default: a new directory in /dev/shm,
                       else in \$TMPDIR or /tmp, removed after a pass unless
                       --keep)
  --keep               keep the work directory (image, logs) after a pass
  --verbose            print the guest's whole console at the end (default:
                       only its PASS/FAIL lines, and the console on failure)
  --peer virtiofsd     developer check of the QEMU and QMP plumbing: run
                       virtiofsd (--virtiofsd PATH, default: virtiofsd on
                       PATH or ~/.cargo/bin/virtiofsd) on both sides instead
                       of keelfsd, sharing WORKDIR/shared (virtiofsd
                       --socket-path SOCK --shared-dir DIR --sandbox none
                       --allow-direct-io); no mkfs, no fsck
  --accel A            auto, kvm or tcg for the guests (run-guest.sh --accel;
                       default auto: KVM only when it boots the guest kernel)
  -h, --help           show this help

Logs in WORKDIR: source.log and dest.log (run-guest.sh and the guest's
console on each QEMU), console.log (the guest's console: the source's until
the switch-over, then the destination's), keelfsd-source.log,
keelfsd-dest.log, fsck.log, qmp.log (every QMP command and its answer),
rbd-lock.log (on RBD: each rbd lock ls the checks ran).
EOF
}

# shellcheck source=qemu-scripts/lib.sh
source "$script_dir/lib.sh"
log() { echo "$prog: $*" >&2; }

keelfsd_src=""
keelfsd_dest_src=""
workdir=""
during_io=0
timeout=300
keep=0
verbose=0
peer=keelfsd
virtiofsd_bin=""
rbd_pool=""
src_netns=""
dst_netns=""
while (($#)); do
  case "$1" in
    --keelfsd) need_arg "$1" $#; keelfsd_src=$2; shift 2 ;;
    --keelfsd-dest) need_arg "$1" $#; keelfsd_dest_src=$2; shift 2 ;;
    --workdir) need_arg "$1" $#; workdir=$2; shift 2 ;;
    --during-io) during_io=1; shift ;;
    --timeout) need_arg "$1" $#; timeout=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    --verbose) verbose=1; shift ;;
    --peer) need_arg "$1" $#; peer=$2; shift 2 ;;
    --virtiofsd) need_arg "$1" $#; virtiofsd_bin=$2; shift 2 ;;
    --rbd-pool) need_arg "$1" $#; rbd_pool=$2; shift 2 ;;
    --src-netns) need_arg "$1" $#; src_netns=$2; shift 2 ;;
    --dst-netns) need_arg "$1" $#; dst_netns=$2; shift 2 ;;
    --accel) need_arg "$1" $#; set_accel "$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

[[ $timeout =~ ^[1-9][0-9]*$ ]] || die "--timeout '$timeout' is not a positive number of seconds"
case "$peer" in
  keelfsd)
    [[ -z $virtiofsd_bin ]] || die "--virtiofsd needs --peer virtiofsd"
    [[ -n $keelfsd_src ]] || keelfsd_src=$(find_keelfsd)
    [[ -x $keelfsd_src ]] || die "--keelfsd $keelfsd_src: not an executable"
    [[ -n $keelfsd_dest_src ]] || keelfsd_dest_src=$keelfsd_src
    [[ -x $keelfsd_dest_src ]] || die "--keelfsd-dest $keelfsd_dest_src: not an executable"
    ;;
  virtiofsd)
    [[ -z $keelfsd_src && -z $keelfsd_dest_src ]] || die "--peer virtiofsd runs no keelfsd: drop --keelfsd/--keelfsd-dest"
    [[ -z $rbd_pool$src_netns$dst_netns ]] || die "--peer virtiofsd: no --rbd-pool, --src-netns or --dst-netns"
    if [[ -z $virtiofsd_bin ]]; then
      virtiofsd_bin=$(command -v virtiofsd || echo "$HOME/.cargo/bin/virtiofsd")
    fi
    [[ -x $virtiofsd_bin ]] || die "no virtiofsd at $virtiofsd_bin (cargo install virtiofsd, or --virtiofsd PATH)"
    ;;
  *) die "--peer must be keelfsd or virtiofsd" ;;
esac
if [[ -n $rbd_pool ]]; then
  [[ $rbd_pool =~ ^[A-Za-z0-9._-]{1,128}$ ]] || die "--rbd-pool '$rbd_pool': 1 to 128 of A-Z a-z 0-9 . _ -"
  command -v rbd >/dev/null || die "rbd not found (scripts/setup.sh installs ceph-common)"
fi
for ns in "$src_netns" "$dst_netns"; do
  [[ -z $ns ]] && continue
  [[ -e /run/netns/$ns ]] || die "no network namespace /run/netns/$ns (scripts/ceph-dev.sh host add NAME ADDR makes one)"
  command -v nsenter >/dev/null || die "nsenter not found (package util-linux)"
done
# netns_ip NAME: the namespace's (first) global IPv4 address.
netns_ip() {
  ip -n "$1" -4 -o addr show scope global | awk '{ sub("/.*", "", $4); print $4; exit }'
}
src_ip=""
dst_ip=""
[[ -z $src_netns ]] || src_ip=$(netns_ip "$src_netns")
[[ -z $dst_netns ]] || dst_ip=$(netns_ip "$dst_netns")
[[ -z $src_netns || -n $src_ip ]] || die "--src-netns $src_netns: the namespace has no IPv4 address"
[[ -z $dst_netns || -n $dst_ip ]] || die "--dst-netns $dst_netns: the namespace has no IPv4 address"
command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 not found (scripts/setup.sh installs it)"
command -v python3 >/dev/null || die "python3 not found (scripts/setup.sh installs it; qmp.py needs it)"
command -v cc >/dev/null || die "cc not found (scripts/setup.sh installs build-essential; dirloop.c needs it)"

make_workdir migrate
t_start=$SECONDS
deadline=$((SECONDS + timeout))
img=$workdir/keelfs.img
image_made=0
# An RBD image new for this run: one an earlier failed run kept is never
# formatted over.
[[ -z $rbd_pool ]] || img=rbd:$rbd_pool/migrate-$$-$(date +%s)
src_sock=$workdir/source.sock
dst_sock=$workdir/dest.sock
src_qmp=$workdir/source.qmp
dst_qmp=$workdir/dest.qmp
mig_uri=unix:$workdir/migrate.sock
migrated_flag=$workdir/migrated
src_log=$workdir/source.log
dst_log=$workdir/dest.log
qmp_log=$workdir/qmp.log
guest_script=$script_dir/guest-tests/migrate.sh
rm -f "$src_sock" "$dst_sock" "$src_qmp" "$dst_qmp" "$workdir/migrate.sock" "$migrated_flag" \
  "$src_log" "$dst_log" "$qmp_log" "$workdir/console.log"

# ------------------------------------------------------------ processes --
src_daemon=""
dst_daemon=""
src_guest=""
dst_guest=""
# shellcheck disable=SC2317  # invoked by traps
cleanup() {
  # run-guest.sh stops its QEMU on SIGTERM; daemons get 10 s, then SIGKILL.
  stop_guest_and_daemon "$src_guest" "$src_daemon" 50
  stop_guest_and_daemon "$dst_guest" "$dst_daemon" 50
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT TERM

# ------------------------------------------------------------ results --
nfail=0
npass=0
pass() { echo "PASS: $*"; npass=$((npass + 1)); }
fail() { echo "FAIL: $*"; nfail=$((nfail + 1)); }
# finish: the guest's console, the summary, the exit status; the guest
# script's status wins when it failed.
guest_status=""
finish() {
  if [[ -s $src_log || -s $dst_log ]]; then
    {
      cat "$src_log" 2>/dev/null || true
      [[ ! -s $dst_log ]] || echo "----- switch-over: the destination QEMU's console from here -----"
      cat "$dst_log" 2>/dev/null || true
    } | tr -d '\r' >"$workdir/console.log"
    if ((verbose || nfail > 0)) || [[ -n $guest_status && $guest_status != 0 ]]; then
      echo "----- the guest's console (source, then destination):"
      grep -av '^KEELFS-HEARTBEAT' "$workdir/console.log" | sed 's/^/  | /'
    fi
  fi
  local total=$((SECONDS - t_start)) mode="in a quiet period"
  ((!during_io)) || mode="during I/O"
  echo "migrate ($peer, $mode): $npass passed, $nfail failed, ${total}s"
  local rc=0
  if [[ -n $guest_status && $guest_status != 0 ]]; then
    rc=$guest_status
  elif ((nfail > 0)); then
    rc=1
  fi
  if [[ $img == rbd:* ]] && ((image_made)); then
    if ((rc != 0 || keep)); then
      echo "RBD image kept: $img (rbd rm ${img#rbd:} removes it)"
    else
      cleanup
      local out
      out=$(rbd rm --no-progress "${img#rbd:}" 2>&1) || echo "rbd rm ${img#rbd:} failed, image kept: $out"
    fi
  fi
  if ((rc != 0 || keep || !auto_workdir)); then
    echo "logs in $workdir"
  else
    cleanup
    rm -rf "$workdir"
  fi
  exit "$rc"
}
# left: the seconds until the deadline (at least 1; run-guest.sh's 0 means none).
left() { local l=$((deadline - SECONDS)); echo $((l > 0 ? l : 1)); }

# qmp SOCKET COMMAND [ARGS-JSON] [--get KEY]: one QMP command (qmp.py),
# logged to qmp.log with its answer.
qmp() {
  local out rc=0
  out=$(python3 "$script_dir/qmp.py" "$@" 2>&1) || rc=$?
  printf '%s %s -> %s%s\n' "$(basename "$1" .qmp)" "${*:2}" "$out" \
    "$( ((rc == 0)) || echo " (exit $rc)")" >>"$qmp_log"
  echo "$out"
  return "$rc"
}

# start_daemon VAR LABEL LOG SOCK COMMAND...: starts a back-end, waits for its
# socket; sets VAR to its pid.
start_daemon() {
  local var=$1 label=$2 dlog=$3 sock=$4 pid st=0
  shift 4
  "$@" >"$dlog" 2>&1 &
  pid=$!
  printf -v "$var" '%s' "$pid"
  for _ in $(seq 1 150); do
    [[ -S $sock ]] && { log "$label: $* (pid $pid)"; return 0; }
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.2
  done
  if kill -0 "$pid" 2>/dev/null; then
    fail "$label start: no socket $sock within 30 s"
  else
    wait "$pid" || st=$?
    fail "$label start: exited with status $st before creating $sock ($*)"
    printf -v "$var" '%s' ""
  fi
  tail_of "$label log" "$dlog"
  return 1
}

# check_sandboxed LABEL LOG PID: keelfsd says it entered its sandbox (it
# binds its socket first) within 30 s; on RBD too.
check_sandboxed() {
  local deadline=$((SECONDS + 30))
  if wait_log "$2" 'sandboxed: namespaces' "$3"; then
    pass "$1: sandboxed ($(grep -aom1 'sandboxed: .*' "$2"))"
  else
    fail "$1: did not say it was sandboxed within 30 s"
    tail_of "$1 log" "$2"
  fi
}

# stop_daemon VAR LABEL LOG: SIGTERM, wait up to 60 s; it must exit 0.
# (virtiofsd ends by itself when its QEMU goes away: then just its status.)
stop_daemon() {
  local var=$1 label=$2 dlog=$3 pid=${!1} st=0 t0=$SECONDS
  [[ -n $pid ]] || { fail "$label: was not running"; return 1; }
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  if kill -0 "$pid" 2>/dev/null; then
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    printf -v "$var" '%s' ""
    fail "$label: still running 60 s after SIGTERM (killed)"
    tail_of "$label log" "$dlog"
    return 1
  fi
  wait "$pid" || st=$?
  printf -v "$var" '%s' ""
  if ((st == 0)); then
    pass "$label: exited 0 after SIGTERM ($((SECONDS - t0))s)"
  else
    fail "$label: exit status $st after SIGTERM"
    tail_of "$label log" "$dlog"
    return 1
  fi
}

# rbd_lockers: "LOCKER ADDRESS" per holder of the image's lock (rbd lock ls),
# each also logged to rbd-lock.log.
rbd_lockers() {
  local out
  out=$(rbd lock ls --format json "${img#rbd:}" 2>&1) || { echo "rbd lock ls failed: $out" >&2; return 1; }
  echo "$(date +%T) rbd lock ls ${img#rbd:}: $out" >>"$workdir/rbd-lock.log"
  # A list in current releases; a map keyed by lock id in old ones.
  python3 -c '
import json, sys
v = json.loads(sys.argv[1])
for lock in (v if isinstance(v, list) else list(v.values())):
    print(lock["locker"], lock["address"])' "$out"
}

# check_lock WHEN SIDE IP NETNS: within 30 s, exactly one client holds the
# RBD image's lock, and when IP is given (the keelfsd of SIDE runs in
# namespace NETNS) at that address. Prints what it saw last.
check_lock() {
  local when=$1 side=$2 want=$3 netns=$4 seen="" n="?" ip="" end=$((SECONDS + 30))
  local whose=""
  [[ -z $want ]] || whose=": the $side's address (namespace $netns, $want)"
  while :; do
    if seen=$(rbd_lockers 2>&1); then
      n=$(grep -c . <<<"$seen" || true)
      ip=$(sed -E 's/^[^ ]+ (v[12]:)?([0-9.]+):.*/\2/' <<<"$seen")
      if ((n == 1)) && [[ -z $want || $ip == "$want" ]]; then
        pass "RBD lock $when: one holder, ${seen/ / at }$whose"
        return 0
      fi
    else
      n="?"
    fi
    ((SECONDS < end)) || break
    sleep 0.5
  done
  fail "RBD lock $when: want one holder${want:+ at $want (the $side, namespace $netns)}; saw $n: ${seen//$'\n'/; }"
  return 1
}

# ------------------------------------------------------------ set-up --
log "work directory: $workdir"
if [[ $peer == keelfsd ]]; then
  keelfsd=$workdir/keelfsd-source
  keelfsd_dest=$workdir/keelfsd-dest
  cp "$keelfsd_src" "$keelfsd"
  cp "$keelfsd_dest_src" "$keelfsd_dest"
  log "source keelfsd: $keelfsd_src; destination keelfsd: $keelfsd_dest_src"
else
  log "peer: $virtiofsd_bin ($("$virtiofsd_bin" --version 2>&1 | head -n1)) on both sides"
fi
cc -O2 -Wall -o "$workdir/dirloop" "$script_dir/dirloop.c" || die "cc dirloop.c failed"
cc -O2 -Wall -static -o "$workdir/fcntl-lock" "$script_dir/fcntl-lock.c" || die "cc fcntl-lock.c failed"
"$script_dir/build-guest.sh" --quiet || die "building the guest failed"
log "guest: kernel $(cat "$script_dir/.guest/kernel-version"), $(qemu-system-x86_64 --version | head -n1)"

if [[ $peer == keelfsd ]]; then
  [[ $img == rbd:* ]] || rm -f "$img"
  image_made=1
  if ! "$keelfsd" mkfs "$img" --size 1G >"$workdir/mkfs.log" 2>&1; then
    fail "keelfsd mkfs $img --size 1G (see $workdir/mkfs.log)"
    tail_of "mkfs" "$workdir/mkfs.log"
    finish
  fi
  # Sandboxed, as keelfsd serves by default (on RBD, in the host's
  # network namespace).
  # keelfs holds the guest's locks, so that they travel with its session.
  src_cmd=("$keelfsd" serve --device "$img" --socket "$src_sock" --tag keelfs --locks export)
  dst_cmd=("$keelfsd_dest" serve --device "$img" --socket "$dst_sock" --tag keelfs --incoming --locks export)
  [[ $img != rbd:* ]] || log "image: $img"
  # Another "host": only the network namespace changes.
  [[ -z $src_netns ]] || src_cmd=(nsenter "--net=/run/netns/$src_netns" "${src_cmd[@]}")
  [[ -z $dst_netns ]] || dst_cmd=(nsenter "--net=/run/netns/$dst_netns" "${dst_cmd[@]}")
else
  rm -rf "$workdir/shared"
  mkdir -p "$workdir/shared"
  src_cmd=("$virtiofsd_bin" --socket-path "$src_sock" --shared-dir "$workdir/shared" --sandbox none --allow-direct-io)
  dst_cmd=("$virtiofsd_bin" --socket-path "$dst_sock" --shared-dir "$workdir/shared" --sandbox none --allow-direct-io)
fi

start_daemon src_daemon "source $peer" "$workdir/$peer-source.log" "$src_sock" "${src_cmd[@]}" || finish
[[ $peer != keelfsd ]] || check_sandboxed "source keelfsd" "$workdir/$peer-source.log" "$src_daemon"
[[ $img != rbd:* ]] || check_lock "before the migration" source "$src_ip" "$src_netns" || true
guest_args=(--tag keelfs --script "$guest_script" --add-bin "$workdir/dirloop" --add-bin "$workdir/fcntl-lock")
if [[ $peer == virtiofsd ]]; then
  # virtiofsd re-finds files by path, so a file unlinked while open
  # cannot migrate: the guest is told not to check it.
  echo "virtiofsd" >"$workdir/peer-cannot-migrate-unlinked"
  guest_args+=(--add "$workdir/peer-cannot-migrate-unlinked")
fi
t_boot=$SECONDS
"$script_dir/run-guest.sh" --socket "$src_sock" "${guest_args[@]}" --qmp "$src_qmp" --migrated-flag "$migrated_flag" \
  --timeout "$(left)" >"$src_log" 2>&1 &
src_guest=$!
log "source QEMU: booting the guest (run-guest.sh, log $src_log)"

# The destination, while the source boots.
start_daemon dst_daemon "destination $peer" "$workdir/$peer-dest.log" "$dst_sock" "${dst_cmd[@]}" || finish
[[ $peer != keelfsd ]] || check_sandboxed "destination keelfsd" "$workdir/$peer-dest.log" "$dst_daemon"
"$script_dir/run-guest.sh" --socket "$dst_sock" "${guest_args[@]}" --qmp "$dst_qmp" --incoming defer \
  --timeout "$(left)" >"$dst_log" 2>&1 &
dst_guest=$!
log "destination QEMU: -incoming defer (run-guest.sh, log $dst_log)"
dst_ready=0
while ((SECONDS < deadline)) && kill -0 "$dst_guest" 2>/dev/null; do
  if [[ -S $dst_qmp ]] && [[ $(qmp "$dst_qmp" query-status --get status 2>/dev/null) == inmigrate ]]; then
    dst_ready=1
    break
  fi
  sleep 0.5
done
if ((!dst_ready)); then
  fail "destination QEMU: not waiting for a migration (query-status inmigrate)"
  tail_of "destination run-guest.sh" "$dst_log"
  finish
fi
# return-path: the destination reports back, so that a failed load fails
# the migration on the source (whose guest then goes on running there)
# instead of leaving no guest anywhere. Needed on both sides.
if ! qmp "$dst_qmp" migrate-set-capabilities \
  '{"capabilities": [{"capability": "return-path", "state": true}]}' >/dev/null ||
  ! qmp "$dst_qmp" migrate-incoming "{\"uri\": \"$mig_uri\"}" >/dev/null; then
  fail "destination QEMU: migrate-incoming (see $qmp_log)"
  finish
fi
pass "destination ready: $peer$([[ $peer == keelfsd ]] && echo " --incoming"), QEMU -incoming defer, migrate-incoming $mig_uri"

# ------------------------------------------------------------ migration --
if ! wait_log "$src_log" '^KEELFS-GUEST-START' "$src_guest"; then
  fail "source guest: did not start its script"
  tail_of "source run-guest.sh" "$src_log" 40
  finish
fi
boot_s=$((SECONDS - t_boot))
if ((during_io)); then
  marker='^KEELFS-IO-START'
  when="5 s after the guest started fio (KEELFS-IO-START)"
else
  marker='^KEELFS-MIGRATE-NOW'
  when="in the guest's quiet period (KEELFS-MIGRATE-NOW)"
fi
if ! wait_log "$src_log" "$marker" "$src_guest"; then
  fail "source guest: no ${marker#^} line (booted in ${boot_s}s)"
  tail_of "source run-guest.sh" "$src_log" 40
  finish
fi
((!during_io)) || sleep 5
if ! kill -0 "$src_guest" 2>/dev/null; then
  fail "source guest ended before the migration"
  tail_of "source run-guest.sh" "$src_log" 40
  finish
fi
log "guest booted in ${boot_s}s; migrating $when"
# Local migration: no bandwidth cap (the default is 128 MiB/s); auto-converge
# throttles vCPUs that dirty memory faster than it moves.
if ! qmp "$src_qmp" migrate-set-capabilities \
  '{"capabilities": [{"capability": "return-path", "state": true}, {"capability": "auto-converge", "state": true}]}' >/dev/null ||
  ! qmp "$src_qmp" migrate-set-parameters '{"max-bandwidth": 10737418240, "downtime-limit": 500}' >/dev/null; then
  fail "source QEMU: setting migration capabilities and parameters (see $qmp_log)"
  finish
fi
t_mig=$SECONDS
if ! out=$(qmp "$src_qmp" migrate "{\"uri\": \"$mig_uri\"}"); then
  fail "source QEMU: migrate: $out"
  finish
fi
status=""
while ((SECONDS < deadline)); do
  status=$(qmp "$src_qmp" query-migrate --get status 2>/dev/null || true)
  case "$status" in completed|failed|cancelled) break ;; esac
  sleep 0.5
done
info=$(qmp "$src_qmp" query-migrate 2>/dev/null || true)
# field NAME: a number from query-migrate's answer.
field() { python3 -c 'import json, sys; v = json.loads(sys.argv[1] or "{}"); print(v.get("ram", {}).get(sys.argv[2], v.get(sys.argv[2], "?")))' "$info" "$1" 2>/dev/null || echo "?"; }
if [[ $status != completed ]]; then
  why=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1]).get("error-desc", ""))' "$info" 2>/dev/null || true)
  fail "migration: status '${status:-none}' after $((SECONDS - t_mig))s${why:+: $why}"
  # With return-path the source resumes its guest after a failed migration.
  log "source QEMU now: $(qmp "$src_qmp" query-status 2>&1 || true)"
  # A destination that failed to load exits: give run-guest.sh time to
  # print QEMU's error.
  for _ in $(seq 1 50); do kill -0 "$dst_guest" 2>/dev/null || break; sleep 0.2; done
  tail_of "source $peer log" "$workdir/$peer-source.log"
  tail_of "destination $peer log" "$workdir/$peer-dest.log"
  tail_of "destination run-guest.sh" "$dst_log"
  finish
fi
moved=$(field transferred)
[[ ! $moved =~ ^[0-9]+$ ]] || moved=$((moved / 1048576))
pass "migration completed: total $(field total-time) ms, downtime $(field downtime) ms, setup $(field setup-time) ms, $moved MiB moved (guest booted in ${boot_s}s)"

# The source: paused after the switch-over; then gone, and its back-end too.
src_state=$(qmp "$src_qmp" query-status --get status 2>/dev/null || true)
if [[ $src_state == postmigrate ]]; then
  pass "source QEMU paused after the switch-over (query-status: postmigrate)"
else
  fail "source QEMU: query-status '$src_state' after the migration, want postmigrate"
fi
touch "$migrated_flag"
qmp "$src_qmp" quit >/dev/null || true
st=0
wait "$src_guest" || st=$?
src_guest=""
if ((st == 0)); then
  pass "source QEMU quit"
else
  fail "source run-guest.sh exited $st after quit"
  tail_of "source run-guest.sh" "$src_log"
fi
# The source keelfsd still runs: it gave the lock up at the switch-over,
# and the destination took it when the session arrived.
[[ $img != rbd:* ]] || check_lock "after the migration" destination "$dst_ip" "$dst_netns" || true
if [[ $peer == keelfsd ]]; then
  stop_daemon src_daemon "source keelfsd" "$workdir/keelfsd-source.log" || true
else
  # virtiofsd exits by itself once its front-end disconnects.
  for _ in $(seq 1 50); do kill -0 "$src_daemon" 2>/dev/null || break; sleep 0.2; done
  stop_daemon src_daemon "source virtiofsd" "$workdir/virtiofsd-source.log" || true
fi

dst_state=$(qmp "$dst_qmp" query-status --get status 2>/dev/null || true)
if [[ $dst_state == running ]]; then
  pass "destination QEMU running the guest"
else
  fail "destination QEMU: query-status '$dst_state', want running"
fi

# ------------------------------------------------------------ the end --
log "waiting for the guest to finish on the destination (log $dst_log)"
st=0
wait "$dst_guest" || st=$?
dst_guest=""
guest_status=$st
case $st in
  0) pass "guest script (guest-tests/migrate.sh) exited 0" ;;
  124) fail "destination guest: timed out (--timeout $timeout)" ;;
  125) fail "destination QEMU ended without the guest's exit status (crash or panic)" ;;
  126) fail "destination guest stalled" ;;
  *) fail "guest script exited $st: $(grep -a '^FAIL' "$dst_log" | head -n 3 | tr -d '\r' | paste -sd';' - || true)" ;;
esac
if [[ $peer == keelfsd ]]; then
  # The guest's two locks reached the destination in its session's state
  # (the guest's checks show they are in force there).
  if grep -aqE 'session restored.* locks=2' "$workdir/keelfsd-dest.log"; then
    pass "the destination keelfsd restored the session with the guest's 2 locks"
  else
    fail "the destination keelfsd's restored session has not the guest's 2 locks"
  fi
  stop_daemon dst_daemon "destination keelfsd" "$workdir/keelfsd-dest.log" || true
  st=0
  "$keelfsd_dest" fsck "$img" >"$workdir/fsck.log" 2>&1 || st=$?
  if ((st == 0)); then
    pass "keelfsd fsck: exit 0 ($(grep -m1 clean "$workdir/fsck.log" | sed 's/^[^:]*: //'))"
  else
    fail "keelfsd fsck exited $st"
    tail_of fsck "$workdir/fsck.log" 40
  fi
  if grep -aq panicked "$workdir"/keelfsd-*.log; then
    fail "a panic in $workdir/keelfsd-*.log"
  fi
else
  for _ in $(seq 1 50); do kill -0 "$dst_daemon" 2>/dev/null || break; sleep 0.2; done
  stop_daemon dst_daemon "destination virtiofsd" "$workdir/virtiofsd-dest.log" || true
fi
echo "----- the guest's checks:"
grep -aE '^(PASS|FAIL|SKIP):' "$src_log" "$dst_log" 2>/dev/null | tr -d '\r' | sed 's/^[^:]*\.log:/  /' || true
finish
