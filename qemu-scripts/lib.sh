# shellcheck shell=bash disable=SC2154  # prog and repo come from the caller
# Shared by the qemu-scripts drivers (sourced, not run). Callers set $prog
# and $repo first.

die() { echo "$prog: error: $*" >&2; exit 2; }

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
