#!/usr/bin/env bash
# Locks that a Linux guest and the host mount of one export agree on
# (issue 36): one keelfsd serves the export over vhost-user-fs and as a
# host mount, and holds its POSIX and flock locks (locks = auto).
set -euo pipefail

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$script_dir/.." && pwd)
prog=locks.sh

usage() {
  cat <<EOF
Usage: qemu-scripts/$prog [options]

  1. keelfsd mkfs WORKDIR/guest.img; keelfsd serve --socket WORKDIR/guest.sock
     --fuse-mount WORKDIR/mnt (locks auto: keelfsd holds the locks)
  2. the host takes a POSIX lock (fcntl-lock.c) and a flock lock on the
     mount; QEMU (run-guest.sh) boots the guest running
     guest-tests/locks.sh, which must find itself kept out, and F_GETLK
     naming the host's lock
  3. KEELFS-GUEST-SAW-HOST: the host lets go; the guest takes both locks
  4. KEELFS-GUEST-HOLDS: the host's F_SETLK and flock -n must fail; its
     F_SETLKW and blocking flock must be granted once the guest lets go
  5. the guest's checks pass; SIGTERM to keelfsd (exit 0); fsck

Options:
  --keelfsd PATH   keelfsd (default: target/release/keelfsd, else
                   target/debug/keelfsd)
  --timeout SECS   give up after SECS (default: 400)
  --workdir DIR    work directory (default: a new directory in \$TMPDIR or /tmp)
  --keep           keep the work directory after a pass
  --accel A        auto, kvm or tcg for the guest (run-guest.sh --accel)
  -h, --help       show this help
EOF
}

# shellcheck source=qemu-scripts/lib.sh
source "$script_dir/lib.sh"
log() { echo "$prog: $*" >&2; }

keelfsd=""
workdir=""
timeout=400
keep=0
while (($#)); do
  case "$1" in
    --keelfsd) need_arg "$1" $#; keelfsd=$2; shift 2 ;;
    --workdir) need_arg "$1" $#; workdir=$2; shift 2 ;;
    --timeout) need_arg "$1" $#; timeout=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    --accel) need_arg "$1" $#; set_accel "$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ $timeout =~ ^[1-9][0-9]*$ ]] || die "--timeout '$timeout' is not a positive number of seconds"
[[ -n $keelfsd ]] || keelfsd=$(find_keelfsd)
[[ -x $keelfsd ]] || die "--keelfsd $keelfsd: not an executable"
command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 not found (scripts/setup.sh installs it)"
command -v cc >/dev/null || die "no C compiler for fcntl-lock.c (scripts/setup.sh installs build-essential)"

if [[ -z $workdir ]]; then
  workdir=$(mktemp -d "${TMPDIR:-/tmp}/keelfs-locks.XXXXXX")
  auto_workdir=1
else
  mkdir -p "$workdir" || die "cannot create --workdir $workdir"
  workdir=$(cd "$workdir" && pwd)
  auto_workdir=0
fi
deadline=$((SECONDS + timeout))
img=$workdir/guest.img
sock=$workdir/guest.sock
mnt=$workdir/mnt
guest_log=$workdir/guest.log
daemon_log=$workdir/keelfsd.log
tool=$workdir/fcntl-lock

daemon=""
guest=""
holders=()
# shellcheck disable=SC2317  # invoked by traps
cleanup() {
  if mountpoint -q "$mnt"; then
    rm -f "$mnt/host-holds" "$mnt/host-flock" "$mnt/guest-holds" "$mnt/guest-flock"
  fi
  for pid in "${holders[@]}"; do kill "$pid" 2>/dev/null || true; done
  stop_guest_and_daemon "$guest" "$daemon" 50
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT TERM

nfail=0
npass=0
pass() { echo "PASS: $*"; npass=$((npass + 1)); }
fail() { echo "FAIL: $*"; nfail=$((nfail + 1)); }
finish() {
  echo "locks: $npass passed, $nfail failed"
  if ((nfail > 0 || keep || !auto_workdir)); then
    echo "logs in $workdir"
  else
    cleanup
    rm -rf "$workdir"
  fi
  exit $((nfail > 0))
}
# until_ok CMD...: CMD every 0.2 s until it succeeds or the deadline.
until_ok() {
  while ((SECONDS < deadline)); do
    "$@" && return 0
    sleep 0.2
  done
  return 1
}
# exit_of CMD...: CMD's exit status, whatever it is (set -e stays on).
# Not for wait, which must run in this shell, not a command substitution.
exit_of() {
  local st=0
  "$@" || st=$?
  echo "$st"
}

log "work directory: $workdir"
cc -O2 -Wall -static -o "$tool" "$script_dir/fcntl-lock.c" || die "building fcntl-lock.c failed"
"$script_dir/build-guest.sh" --quiet || die "building the guest failed"
"$keelfsd" mkfs "$img" --size 1G >/dev/null
mkdir -p "$mnt"
"$keelfsd" serve --device "$img" --socket "$sock" --fuse-mount "$mnt" >"$daemon_log" 2>&1 &
daemon=$!
until_ok test -S "$sock" || { fail "keelfsd did not create $sock"; tail_of keelfsd "$daemon_log"; finish; }
until_ok mountpoint -q "$mnt" || { fail "keelfsd did not mount $mnt"; tail_of keelfsd "$daemon_log"; finish; }

# The host's locks, held until their markers are removed.
"$tool" hold "$mnt/posix" "$mnt/host-holds" &
holders+=($!)
"$tool" flock-hold "$mnt/flk" "$mnt/host-flock" &
holders+=($!)
until_ok test -e "$mnt/host-holds" -a -e "$mnt/host-flock" || { fail "the host's holders did not start"; finish; }

"$script_dir/run-guest.sh" --socket "$sock" --script "$script_dir/guest-tests/locks.sh" \
  --add-bin "$tool" --timeout "$((deadline - SECONDS))" >"$guest_log" 2>&1 &
guest=$!

if ! wait_log "$guest_log" '^KEELFS-GUEST-SAW-HOST' "$guest"; then
  fail "the guest did not get past the host's locks"
  tail_of guest "$guest_log"
  finish
fi
rm -f "$mnt/host-holds" "$mnt/host-flock"
for pid in "${holders[@]}"; do
  st=0
  wait "$pid" || st=$?
  ((st == 0)) || fail "a host holder exited $st"
done
holders=()

if ! wait_log "$guest_log" '^KEELFS-GUEST-HOLDS' "$guest"; then
  fail "the guest did not take its locks"
  tail_of guest "$guest_log"
  finish
fi
st=$(exit_of "$tool" try "$mnt/gposix")
if ((st == 1)); then pass "the guest's POSIX lock keeps the host's F_SETLK out"; else fail "host F_SETLK: exit $st"; fi
held=$("$tool" getlk "$mnt/gposix")
if [[ $held == "W 0 0" ]]; then pass "the host's F_GETLK reports the guest's write lock"; else fail "host F_GETLK: $held"; fi
st=$(exit_of "$tool" flock-try "$mnt/gflk")
if ((st == 1)); then pass "the guest's flock lock keeps the host's out"; else fail "host flock: exit $st"; fi
# Blocking waits on the host, granted when the guest lets go.
"$tool" wait "$mnt/gposix" &
posix_waiter=$!
flock -x -w "$((deadline - SECONDS))" "$mnt/gflk" true &
flock_waiter=$!
sleep 1
if kill -0 "$posix_waiter" 2>/dev/null && kill -0 "$flock_waiter" 2>/dev/null; then
  pass "the host's F_SETLKW and flock wait while the guest holds"
else
  fail "a host wait ended while the guest held its locks"
fi
rm -f "$mnt/guest-holds" "$mnt/guest-flock"
st=0
wait "$posix_waiter" || st=$?
if ((st == 0)); then pass "the host's F_SETLKW is granted when the guest lets go"; else fail "host F_SETLKW: exit $st"; fi
st=0
wait "$flock_waiter" || st=$?
if ((st == 0)); then pass "the host's blocking flock is granted when the guest lets go"; else fail "host flock: exit $st"; fi
echo "host: $npass passed, $nfail failed" >"$mnt/host-done"

st=0
wait "$guest" || st=$?
guest=""
if ((st == 0)); then
  pass "guest script (guest-tests/locks.sh) exited 0"
else
  fail "guest script exited $st: $(grep -a '^FAIL' "$guest_log" | head -n 3 | tr -d '\r' | paste -sd';' - || true)"
  tail_of guest "$guest_log"
fi
kill -TERM "$daemon"
st=0
wait "$daemon" || st=$?
daemon=""
if ((st == 0)); then pass "keelfsd exited 0 after SIGTERM"; else fail "keelfsd exited $st"; tail_of keelfsd "$daemon_log"; fi
if out=$("$keelfsd" fsck "$img" 2>&1); then pass "fsck of the image: clean"; else fail "fsck: $out"; fi
if grep -aq panicked "$daemon_log"; then fail "a panic in $daemon_log"; fi
echo "----- the guest's checks:"
grep -aE '^(PASS|FAIL):' "$guest_log" | tr -d '\r' | sed 's/^/  /' || true
finish
