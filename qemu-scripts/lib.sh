# shellcheck shell=bash disable=SC2154,SC2034  # prog and repo come from the caller; auto_workdir goes back to it
# Shared by the qemu-scripts drivers (sourced, not run). Callers set $prog
# (and $repo, for find_keelfsd) first.

die() { echo "$prog: error: $*" >&2; exit 2; }

# need_arg FLAG ARGC: an option that takes a value must have one.
need_arg() { (($2 >= 2)) || die "$1 needs a value (see --help)"; }

# set_accel A: every guest this driver boots uses accelerator A (auto, kvm
# or tcg), through run-guest.sh's KEELFS_ACCEL.
set_accel() {
  case "$1" in auto|kvm|tcg) export KEELFS_ACCEL=$1 ;; *) die "--accel must be auto, kvm or tcg" ;; esac
}

# make_workdir NAME: use $workdir (created, made absolute) or, when empty,
# a fresh keelfs-NAME.XXXXXX in /dev/shm (else $TMPDIR or /tmp); sets
# auto_workdir=1 in the second case, so the caller may remove it.
make_workdir() {
  auto_workdir=0
  if [[ -z $workdir ]]; then
    local parent=${TMPDIR:-/tmp}
    [[ -d /dev/shm && -w /dev/shm ]] && parent=/dev/shm
    workdir=$(mktemp -d "$parent/keelfs-$1.XXXXXX")
    auto_workdir=1
  else
    mkdir -p "$workdir" || die "cannot create --workdir $workdir"
    workdir=$(cd "$workdir" && pwd)
  fi
}

# find_keelfsd: print target/release/keelfsd, else target/debug/keelfsd.
find_keelfsd() {
  local c
  for c in "$repo/target/release/keelfsd" "$repo/target/debug/keelfsd"; do
    [[ -x $c ]] && { echo "$c"; return 0; }
  done
  die "no keelfsd in target/release or target/debug: build it (cargo build --release) or pass --keelfsd PATH"
}

# stop_guest_and_daemon GUEST_PID DAEMON_PID TENTHS: end a guest at once,
# then give the daemon TENTHS x 0.2 s to shut down cleanly before SIGKILL.
stop_guest_and_daemon() {
  local guest=$1 daemon=$2 tries=$3
  if [[ -n $guest ]] && kill -0 "$guest" 2>/dev/null; then
    kill -TERM "$guest" 2>/dev/null || true
    wait "$guest" 2>/dev/null || true
  fi
  if [[ -n $daemon ]] && kill -0 "$daemon" 2>/dev/null; then
    kill -TERM "$daemon" 2>/dev/null || true
    for _ in $(seq 1 "$tries"); do kill -0 "$daemon" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$daemon" 2>/dev/null || true
    wait "$daemon" 2>/dev/null || true
  fi
}

# tail_of LABEL FILE [N]: the last N (30) lines of FILE, indented, under a
# heading.
tail_of() {
  echo "----- $1 (tail of $2):"
  tail -n "${3:-30}" "$2" 2>/dev/null | tr -d '\r' | sed 's/^/  | /'
}

# wait_log FILE REGEX PID: until FILE has a line matching REGEX; false when
# PID ended or the caller's $deadline (in SECONDS) passed first.
wait_log() {
  while ((SECONDS < deadline)); do
    grep -aqE "$2" "$1" 2>/dev/null && return 0
    kill -0 "$3" 2>/dev/null || { grep -aqE "$2" "$1" 2>/dev/null; return; }
    sleep 0.2
  done
  return 1
}
