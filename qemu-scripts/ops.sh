#!/usr/bin/env bash
# keelfs's operations under a running guest: one sandboxed keelfsd serves a
# guest's export while the host adds and removes another export over the
# JSON-RPC API (its supervisor opens it: export_dirs); the guest's fio
# must not notice. Then the guest deletes 64 MiB and runs fstrim: the
# image's allocated size must shrink. With a quota on the guest's export,
# the guest's df shows it and writes past it fail with EDQUOT.
# Exits 0 when every check passed, 1 otherwise, 2 on a usage error.
set -euo pipefail

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$script_dir/.." && pwd)
prog=ops.sh

usage() {
  cat <<EOF
Usage: qemu-scripts/$prog [options]

  1. keelfsd mkfs WORKDIR/guest.img --size 1G; WORKDIR/other.img --size 256M
  2. keelfsd serve --config WORKDIR/keelfsd.toml (sandboxed; rpc_socket,
     export_dirs = [WORKDIR], export "keelfs" on WORKDIR/guest.sock with
     quota_bytes = 256 MiB); QEMU (run-guest.sh) boots the guest running
     guest-tests/ops.sh
  3. while the guest's fio runs (KEELFS-IO-START): 3 rounds of
     keelfsd rpc export_add (WORKDIR/other.img on WORKDIR/other.sock),
     export_list, export_remove, keelfsd fsck WORKDIR/other.img
  4. KEELFS-WRITTEN: note guest.img's allocated size; KEELFS-TRIMMED: it
     must have shrunk by 32 MiB or more
  5. the guest's checks pass; SIGTERM to keelfsd (exit 0); fsck guest.img

Options:
  --keelfsd PATH   keelfsd (default: target/release/keelfsd, else
                   target/debug/keelfsd); copied into the work directory
  --timeout SECS   give up after SECS (default: 400)
  --workdir DIR    work directory (default: a new directory in \$TMPDIR or
                   /tmp, not /dev/shm: tmpfs would not show the image's
                   allocated size as a disk filesystem does)
  --keep           keep the work directory after a pass
  --accel A        auto, kvm or tcg for the guests (run-guest.sh --accel;
                   default auto: KVM only when it boots the guest kernel)
  -h, --help       show this help
EOF
}

# shellcheck source=qemu-scripts/lib.sh
source "$script_dir/lib.sh"
log() { echo "$prog: $*" >&2; }

keelfsd_src=""
workdir=""
timeout=400
keep=0
while (($#)); do
  case "$1" in
    --keelfsd) need_arg "$1" $#; keelfsd_src=$2; shift 2 ;;
    --workdir) need_arg "$1" $#; workdir=$2; shift 2 ;;
    --timeout) need_arg "$1" $#; timeout=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    --accel) need_arg "$1" $#; set_accel "$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ $timeout =~ ^[1-9][0-9]*$ ]] || die "--timeout '$timeout' is not a positive number of seconds"
[[ -n $keelfsd_src ]] || keelfsd_src=$(find_keelfsd)
[[ -x $keelfsd_src ]] || die "--keelfsd $keelfsd_src: not an executable"
command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 not found (scripts/setup.sh installs it)"

if [[ -z $workdir ]]; then
  workdir=$(mktemp -d "${TMPDIR:-/tmp}/keelfs-ops.XXXXXX")
  auto_workdir=1
else
  mkdir -p "$workdir" || die "cannot create --workdir $workdir"
  workdir=$(cd "$workdir" && pwd)
  auto_workdir=0
fi
deadline=$((SECONDS + timeout))
keelfsd=$workdir/keelfsd
img=$workdir/guest.img
other=$workdir/other.img
sock=$workdir/guest.sock
rpc=$workdir/rpc.sock
guest_log=$workdir/guest.log
daemon_log=$workdir/keelfsd.log
quota_mib=256

daemon=""
guest=""
# shellcheck disable=SC2317  # invoked by traps
cleanup() { stop_guest_and_daemon "$guest" "$daemon" 50; }
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT TERM

nfail=0
npass=0
pass() { echo "PASS: $*"; npass=$((npass + 1)); }
fail() { echo "FAIL: $*"; nfail=$((nfail + 1)); }
finish() {
  echo "ops: $npass passed, $nfail failed"
  if ((nfail > 0 || keep || !auto_workdir)); then
    echo "logs in $workdir"
  else
    cleanup
    rm -rf "$workdir"
  fi
  exit $((nfail > 0))
}
allocated_mib() { echo $(($(stat -c '%b * %B' "$img") >> 20)); }
rpc_call() { "$keelfsd" rpc "$1" "$2" --rpc "$rpc"; }

# ------------------------------------------------------------ set-up --
log "work directory: $workdir"
cp "$keelfsd_src" "$keelfsd"
"$script_dir/build-guest.sh" --quiet || die "building the guest failed"
"$keelfsd" mkfs "$img" --size 1G >/dev/null
"$keelfsd" mkfs "$other" --size 256M >/dev/null
echo "$quota_mib" >"$workdir/quota-mib"
cat >"$workdir/keelfsd.toml" <<EOF
[daemon]
rpc_socket = "$rpc"
export_dirs = ["$workdir"]
log_format = "json"

[[device]]
name = "guest"
path = "$img"

[[export]]
tag = "keelfs"
device = "guest"
socket = "$sock"
quota_bytes = "${quota_mib}M"
EOF
"$keelfsd" serve --config "$workdir/keelfsd.toml" >"$daemon_log" 2>&1 &
daemon=$!
for _ in $(seq 1 150); do [[ -S $sock ]] && break; sleep 0.2; done
[[ -S $sock ]] || { fail "keelfsd did not create $sock"; tail_of keelfsd "$daemon_log"; finish; }
"$script_dir/run-guest.sh" --socket "$sock" --script "$script_dir/guest-tests/ops.sh" \
  --add "$workdir/quota-mib" --timeout "$((deadline - SECONDS))" >"$guest_log" 2>&1 &
guest=$!

# ------------------------------------------------------------ exports come and go --
if ! wait_log "$guest_log" '^KEELFS-IO-START' "$guest"; then
  fail "the guest did not start fio"
  tail_of guest "$guest_log"
  finish
fi
sleep 3
for round in 1 2 3; do
  if ! out=$(rpc_call export_add "{\"export\": {\"tag\": \"other\", \"device\": \"$other\", \"socket\": \"$workdir/other.sock\"}}" 2>&1); then
    fail "round $round: export_add: $out"
    break
  fi
  listed=$(rpc_call export_list '{}' | grep -c '"tag"' || true)
  [[ $listed == 2 ]] || fail "round $round: export_list shows $listed exports, want 2"
  if ! out=$(rpc_call export_remove '{"tag": "other"}' 2>&1); then
    fail "round $round: export_remove: $out"
    break
  fi
  if ! out=$("$keelfsd" fsck "$other" 2>&1); then
    fail "round $round: fsck of the removed export: $out"
    break
  fi
  pass "round $round: export_add, export_list, export_remove (fsck clean) under the guest's fio"
  sleep 2
done

# ------------------------------------------------------------ space given back --
if wait_log "$guest_log" '^KEELFS-WRITTEN' "$guest"; then
  before=$(allocated_mib)
  if wait_log "$guest_log" '^KEELFS-TRIMMED' "$guest"; then
    after=$(allocated_mib)
    if ((before - after >= 32)); then
      pass "the image's allocated size: ${before} MiB with the guest's 64 MiB file, ${after} MiB after rm and fstrim"
    else
      fail "the image's allocated size: ${before} MiB before rm and fstrim, ${after} MiB after"
    fi
  else
    fail "the guest did not run fstrim"
  fi
else
  fail "the guest did not write its 64 MiB file"
fi

# ------------------------------------------------------------ the end --
st=0
wait "$guest" || st=$?
guest=""
if ((st == 0)); then
  pass "guest script (guest-tests/ops.sh) exited 0"
else
  fail "guest script exited $st: $(grep -a '^FAIL' "$guest_log" | head -n 3 | tr -d '\r' | paste -sd';' - || true)"
  tail_of guest "$guest_log"
fi
kill -TERM "$daemon"
st=0
wait "$daemon" || st=$?
daemon=""
if ((st == 0)); then
  pass "keelfsd exited 0 after SIGTERM"
else
  fail "keelfsd exited $st"
  tail_of keelfsd "$daemon_log"
fi
if out=$("$keelfsd" fsck "$img" 2>&1); then pass "fsck of the guest's image: clean"; else fail "fsck: $out"; fi
if grep -aq panicked "$daemon_log"; then fail "a panic in $daemon_log"; fi
echo "----- the guest's checks:"
grep -aE '^(PASS|FAIL):' "$guest_log" | tr -d '\r' | sed 's/^/  /' || true
finish
