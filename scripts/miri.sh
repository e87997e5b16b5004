#!/usr/bin/env bash
# Runs the pure parts of keelfs under Miri, which fails on undefined
# behaviour (an out-of-bounds or misaligned access, a use after free, a
# data race, a read of uninitialised memory) that a normal test run can
# pass over: the FUSE parsers and encoders, the on-disk codecs, the shared
# page cache's word copies, the QoS buckets, base's helpers, and the
# reactor's queues (calls between two reactor threads through the inbox,
# the wake marks and eventfd wakeups, which Miri's epoll and eventfd
# support). Code that reaches io_uring, vhost-user or the FUSE devices
# cannot run under Miri. The cross-thread handshakes are also
# model-checked by loom in the ordinary test run (reactor/tests/loom.rs,
# fs-core/tests/loom.rs), in every interleaving rather than the ones a
# run happens to take.
#
# Needs the nightly toolchain with the miri and rust-src components, which
# scripts/setup.sh installs. .ci/run calls this after the test command.
set -euo pipefail
cd "$(dirname "$0")/.."
# Miri ignores optimisation; the test profile's opt-level would only make
# it say so for every crate.
export CARGO_PROFILE_TEST_OPT_LEVEL=0

usage() {
  cat <<USAGE
Usage: scripts/miri.sh

Runs the chosen unit tests of keelfs-base, keelfs-reactor, keelfs-fs and
keelfs-vhost under Miri (cargo +nightly miri test). Exits non-zero on the
first failure.
USAGE
}
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  "") ;;
  *) echo "miri.sh: error: unknown argument '$1' (see --help)" >&2; exit 2 ;;
esac

# run CRATE [FILTER...]: one crate's unit tests, or those whose names
# contain a FILTER. --exact is not used: a filter is a module path.
run() {
  local crate=$1
  shift
  echo "miri: $crate ${*:-(all unit tests)}"
  rustup run nightly cargo miri test --quiet -p "$crate" --lib -- "$@"
}

run keelfs-base
# The reactor's idle policy, and calls between reactors (two reactor
# threads, the inbox, wakers and eventfds). Left out: the two tests that
# read /proc files (Miri's isolation refuses open), and the fair shares'
# four simulations of 10,000 to 40,000 steps (safe code, and together
# six minutes interpreted); the short ones kept run the same code.
run keelfs-reactor --skip probe::tests::reads_this_machine \
  --skip probe::tests::a_file_that_is_not_loadavg_is_refused \
  --skip shares::tests::a_share_alone_is_never_held \
  --skip shares::tests::a_flood_gets_about_half \
  --skip shares::tests::a_shallow_neighbour \
  --skip shares::tests::shares_are_of_time
# The on-disk codecs, and the shared page cache's word copies at every
# alignment. Left out, as too slow interpreted (minutes each) for what
# they add: the directory's long model walks and 5,000-entry tests, and
# the page cache's exhaustive-length and 65,536-page ones; the tests kept
# run the same encoders, decoders and copies.
run keelfs-fs record:: blocks:: extent:: dir::tests::varints dir::tests::hostile_entries \
  dir::tests::removal_keeps_wide dir::tests::a_full_directory \
  shared::tests::stores_and_loads_at_any_alignment shared::tests::hints_find
# The FUSE ABI and request parsers, and the QoS buckets and gate. Left
# out: the two QoS simulations of seconds in 10 µs ticks (hundreds of
# thousands of steps, each minutes interpreted); the shorter ones kept
# run the same buckets and gate.
run keelfs-vhost fuse::abi:: fuse::request:: qos:: \
  --skip qos::tests::held_requests_pass_at_the_rate_with_many_in_flight \
  --skip qos::tests::requests_served_dearer_than_charged_still_pass_at_the_rate
echo "miri: clean"
