#!/usr/bin/env bash
# Clones and snapshots under a running guest (issue 37): the guest's GNU cp
# of a 128 MiB file takes no new blocks, fio verifies both copies after
# writes to each (guest-tests/clones.sh), and a snapshot the host takes
# while the guest works keeps the guest's files as they were: served
# read-only beside the live export (export_add with "snapshot", mounted
# on the host), their md5 list is the one the guest printed before it
# rewrote them.
# Exits 0 when every check passed, 1 otherwise, 2 on a usage error.
set -euo pipefail

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
prog=clones.sh

usage() {
  cat <<EOF
Usage: qemu-scripts/$prog [options]

  1. keelfsd mkfs WORKDIR/guest.img --size 1G
  2. keelfsd serve --config WORKDIR/keelfsd.toml (rpc_socket, sandbox
     "none": a snapshot export beside the live one shares its device,
     which a sandboxed daemon cannot add at runtime yet); QEMU
     (run-guest.sh) boots the guest running guest-tests/clones.sh
  3. KEELFS-SNAP-READY: keelfsd rpc snapshot_create (export keelfs,
     name before-rewrite)
  4. KEELFS-REWRITTEN: export_add of the snapshot as a read-only host
     mount at WORKDIR/snap; md5sum of its files against the guest's
     KEELFS-MD5 lines; snapshot_list; export_remove; snapshot_delete
  5. the guest's checks pass; SIGTERM to keelfsd (exit 0); fsck guest.img

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
  workdir=$(mktemp -d "${TMPDIR:-/tmp}/keelfs-clones.XXXXXX")
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
snap=$workdir/snap
guest_log=$workdir/guest.log
daemon_log=$workdir/keelfsd.log

daemon=""
guest=""
# shellcheck disable=SC2317  # invoked by traps
cleanup() {
  umount "$snap" 2>/dev/null || true
  stop_guest_and_daemon "$guest" "$daemon" 50
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT TERM

nfail=0
npass=0
pass() { echo "PASS: $*"; npass=$((npass + 1)); }
fail() { echo "FAIL: $*"; nfail=$((nfail + 1)); }
finish() {
  echo "clones: $npass passed, $nfail failed"
  if ((nfail > 0 || keep || !auto_workdir)); then
    echo "logs in $workdir"
  else
    cleanup
    rm -rf "$workdir"
  fi
  exit $((nfail > 0))
}
rpc_call() { "$keelfsd" rpc "$1" "$2" --rpc "$rpc"; }
# The guest's "PREFIX SUM NAME" lines as "SUM NAME", sorted.
md5_lines() { grep -a "^$1 " "$guest_log" | tr -d '\r' | sed "s/^$1 //" | sort; }

# ------------------------------------------------------------ set-up --
log "work directory: $workdir"
cp "$keelfsd_src" "$keelfsd"
"$script_dir/build-guest.sh" --quiet || die "building the guest failed"
"$keelfsd" mkfs "$img" --size 1G >/dev/null
mkdir -p "$snap"
cat >"$workdir/keelfsd.toml" <<EOF
[daemon]
rpc_socket = "$rpc"
sandbox = "none"
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
"$script_dir/run-guest.sh" --socket "$sock" --script "$script_dir/guest-tests/clones.sh" \
  --timeout "$((deadline - SECONDS))" >"$guest_log" 2>&1 &
guest=$!

# ------------------------------------------------------------ the snapshot --
if ! wait_log "$guest_log" '^KEELFS-SNAP-READY' "$guest"; then
  fail "the guest did not write its files to snapshot"
  tail_of guest "$guest_log"
  finish
fi
if out=$(rpc_call snapshot_create '{"export": "keelfs", "name": "before-rewrite"}' 2>&1); then
  pass "snapshot_create while the guest runs: $(tr -d '\n ' <<<"$out")"
else
  fail "snapshot_create: $out"
fi
if wait_log "$guest_log" '^KEELFS-REWRITTEN' "$guest"; then
  export_json="{\"tag\": \"snap\", \"device\": \"$img\", \"read_only\": true, \"snapshot\": \"before-rewrite\", \"fuse_mount\": \"$snap\"}"
  if out=$(rpc_call export_add "{\"export\": $export_json}" 2>&1); then
    want=$(md5_lines KEELFS-MD5)
    now=$(md5_lines KEELFS-NOW)
    got=$(cd "$snap/s" && md5sum f* | sort)
    if [[ -n $want && $got == "$want" ]]; then
      pass "the snapshot's md5 list is the one the guest printed before rewriting ($(wc -l <<<"$got") files)"
    else
      fail "the snapshot's md5 list differs from the guest's before: $(diff <(echo "$want") <(echo "$got") | head -n 4 | paste -sd';' -)"
    fi
    [[ $now != "$want" ]] || fail "the guest's rewrite changed nothing: the check above proves nothing"
    list=$(rpc_call snapshot_list '{"export": "keelfs"}' 2>&1) || true
    held=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])[0]["exclusive_bytes"])' "$list" 2>/dev/null || echo 0)
    if ((held > 0)); then
      pass "snapshot_list: $held bytes only the snapshot holds (the blocks the guest rewrote)"
    else
      fail "snapshot_list: $list"
    fi
    if busy=$(rpc_call snapshot_delete '{"export": "keelfs", "name": "before-rewrite"}' 2>&1); then
      fail "a served snapshot was deleted"
    elif [[ $busy == *-32003* ]]; then
      pass "snapshot_delete refuses a served snapshot"
    else
      fail "snapshot_delete of a served snapshot: $busy"
    fi
    if ! out=$(rpc_call export_remove '{"tag": "snap"}' 2>&1); then fail "export_remove of the snapshot: $out"; fi
    if out=$(rpc_call snapshot_delete '{"export": "keelfs", "name": "before-rewrite"}' 2>&1); then
      pass "snapshot_delete once no export serves it"
    else
      fail "snapshot_delete: $out"
    fi
  else
    fail "export_add of the snapshot: $out"
  fi
else
  fail "the guest did not rewrite its files"
fi

# ------------------------------------------------------------ the end --
st=0
wait "$guest" || st=$?
guest=""
if ((st == 0)); then
  pass "guest script (guest-tests/clones.sh) exited 0"
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
