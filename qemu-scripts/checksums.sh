#!/usr/bin/env bash
# Data checksums under a running guest (issue 38): the guest writes a file
# by direct writes (guest-tests/checksums.sh); the host flips a byte of
# one of its blocks in the image, behind keelfs's back, as a device could;
# the guest's direct read of that block fails with EIO and the others read
# as written; then a scrub (scrub_start) finds that one block, with the
# file's inode and the block's offset; fsck names it from the daemon's
# record of it, and fsck --data by reading every block.
# Exits 0 when every check passed, 1 otherwise, 2 on a usage error.
set -euo pipefail

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
prog=checksums.sh

usage() {
  cat <<EOF
Usage: qemu-scripts/$prog [options]

  1. keelfsd mkfs WORKDIR/guest.img --size 256M --data-checksums
  2. keelfsd serve --config WORKDIR/keelfsd.toml (rpc_socket); QEMU
     (run-guest.sh) boots the guest running guest-tests/checksums.sh
  3. KEELFS-CSUM-WRITTEN: flip a byte of the file's block 100 in
     guest.img (found by its contents)
  4. KEELFS-CSUM-READ: scrub_start, scrub_status until done: one bad
     block, at offset 409600
  5. the guest's checks pass; SIGTERM to keelfsd (exit 0); fsck of
     guest.img exits 1 naming the block recorded as bad, and so does
     fsck --data

Options:
  --keelfsd PATH   keelfsd (default: target/release/keelfsd, else
                   target/debug/keelfsd); copied into the work directory
  --timeout SECS   give up after SECS (default: 600)
  --workdir DIR    work directory (default: a new directory in \$TMPDIR or /tmp)
  --keep           keep the work directory after a pass
  --accel A        auto, kvm or tcg for the guests (run-guest.sh --accel)
  -h, --help       show this help
EOF
}

# shellcheck source=qemu-scripts/lib.sh
source "$script_dir/lib.sh"
log() { echo "$prog: $*" >&2; }

keelfsd_src=""
workdir=""
timeout=600
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
  workdir=$(mktemp -d "${TMPDIR:-/tmp}/keelfs-checksums.XXXXXX")
  auto_workdir=1
else
  mkdir -p "$workdir" || die "cannot create --workdir $workdir"
  workdir=$(cd "$workdir" && pwd)
  auto_workdir=0
fi
deadline=$((SECONDS + timeout))
keelfsd=$workdir/keelfsd
img=$workdir/guest.img
sock=$workdir/guest.sock
rpc=$workdir/rpc.sock
guest_log=$workdir/guest.log
daemon_log=$workdir/keelfsd.log

daemon=""
guest=""
# shellcheck disable=SC2317  # invoked by traps
cleanup() {
  stop_guest_and_daemon "$guest" "$daemon" 50
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT TERM

nfail=0
npass=0
pass() { echo "PASS: $*"; npass=$((npass + 1)); }
fail() { echo "FAIL: $*"; nfail=$((nfail + 1)); }
finish() {
  echo "checksums: $npass passed, $nfail failed"
  if ((nfail > 0 || keep || !auto_workdir)); then
    echo "logs in $workdir"
  else
    cleanup
    rm -rf "$workdir"
  fi
  exit $((nfail > 0))
}
rpc_call() { "$keelfsd" rpc "$1" "$2" --rpc "$rpc"; }

# ------------------------------------------------------------ set-up --
log "work directory: $workdir"
cp "$keelfsd_src" "$keelfsd"
"$script_dir/build-guest.sh" --quiet || die "building the guest failed"
"$keelfsd" mkfs "$img" --size 256M --data-checksums >/dev/null
cat >"$workdir/keelfsd.toml" <<EOF
[daemon]
rpc_socket = "$rpc"
log_format = "json"

[[device]]
name = "guest"
path = "$img"

[[export]]
tag = "keelfs"
device = "guest"
socket = "$sock"
EOF
"$keelfsd" serve --config "$workdir/keelfsd.toml" >"$daemon_log" 2>&1 &
daemon=$!
for _ in $(seq 1 150); do [[ -S $sock ]] && break; sleep 0.2; done
[[ -S $sock ]] || { fail "keelfsd did not create $sock"; tail_of keelfsd "$daemon_log"; finish; }
"$script_dir/run-guest.sh" --socket "$sock" --script "$script_dir/guest-tests/checksums.sh" \
  --timeout "$((deadline - SECONDS))" >"$guest_log" 2>&1 &
guest=$!

# ------------------------------------------------------------ the damage --
if ! wait_log "$guest_log" '^KEELFS-CSUM-WRITTEN' "$guest"; then
  fail "the guest did not write its file"
  tail_of guest "$guest_log"
  finish
fi
if out=$(python3 - "$img" <<'KEELFS_SCRIPT_END' 2>&1
import mmap, sys
want = (b"keelfs-csum-block-100\n" * 200)[:4096]
with open(sys.argv[1], "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
    at = 0
    while True:
        at = m.find(want, at)
        if at < 0:
            sys.exit("block 100 is not in the image")
        if at % 4096 == 0:
            break
        at += 1
    m[at + 1000] ^= 0x20
    m.flush()
    print(at // 4096)
KEELFS_SCRIPT_END
); then
  pass "block 100 of the guest's file damaged in the image (device block $out)"
else
  fail "damaging block 100: $out"
fi

# ------------------------------------------------------------ the scrub --
if wait_log "$guest_log" '^KEELFS-CSUM-READ' "$guest"; then
  if out=$(rpc_call scrub_start '{"export": "keelfs", "mib_per_sec": 200}' 2>&1); then
    status=""
    for _ in $(seq 1 300); do
      status=$(rpc_call scrub_status '{"export": "keelfs"}' 2>&1) || break
      state=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["state"])' "$status" 2>/dev/null) || break
      [[ $state == running ]] || break
      sleep 0.1
    done
    if python3 -c '
import json, sys
s = json.loads(sys.argv[1])
assert s["state"] == "done" and s["errors"] == 1, s
assert s["bad_blocks"][0]["offset"] == 100 * 4096, s
' "$status" 2>/dev/null; then
      pass "scrub found the one damaged block, at offset 409600: $(tr -d '\n ' <<<"$status" | cut -c1-160)"
    else
      fail "scrub_status: $status"
    fi
  else
    fail "scrub_start: $out"
  fi
else
  fail "the guest did not read its file back"
fi

# ------------------------------------------------------------ the end --
st=0
wait "$guest" || st=$?
guest=""
if ((st == 0)); then
  pass "guest script (guest-tests/checksums.sh) exited 0"
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
# Without --data, fsck reads only the blocks the daemon recorded as bad
# when the guest's read (and the scrub) found them.
st=0
out=$("$keelfsd" fsck "$img" 2>&1) || st=$?
if ((st == 1)) && [[ $out == *"data-checksum-recorded"*"offset 409600"* ]]; then
  pass "fsck exits 1 and names the block the daemon recorded"
else
  fail "fsck (without --data) exited $st: $(tail -n 3 <<<"$out" | paste -sd';' -)"
fi
st=0
out=$("$keelfsd" fsck "$img" --data 2>&1) || st=$?
if ((st == 1)) && [[ $out == *"data-checksum"*"offset 409600"* ]]; then
  pass "fsck --data exits 1 and names the block"
else
  fail "fsck --data exited $st: $(tail -n 3 <<<"$out" | paste -sd';' -)"
fi
if grep -aq panicked "$daemon_log"; then fail "a panic in $daemon_log"; fi
echo "----- the guest's checks:"
grep -aE '^(PASS|FAIL):' "$guest_log" | tr -d '\r' | sed 's/^/  /' || true
finish
