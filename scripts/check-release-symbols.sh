#!/usr/bin/env bash
# Checks that keelfsd's release binary contains no test support: the
# vhost-user test frontend, the fault-injecting device and the test
# helpers sit behind each crate's `test-utils` feature, which only tests,
# keelfs-bench and the fuzzer turn on (issue 19).
#
# keelfsd is built alone: Cargo unifies features across the packages of
# one build, so building it together with keelfs-bench would switch the
# feature on. The linker drops functions that nothing calls, so what the
# check proves is that nothing in keelfsd reaches test support, whichever
# features a build turns on. keelfs-bench, which does call it, is the
# control: the same patterns must match its symbols. Run by .ci/run after
# the tests.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release -q -p keelfsd
bin=target/release/keelfsd
symbols=$(mktemp)
trap 'rm -f "$symbols"' EXIT
nm -C "$bin" >"$symbols"

# The check is only as good as the symbol names it sees: each layer crate
# must show up under its own path, or a change of naming (a stripped
# binary, another mangling) would let anything through.
for present in keelfs_bdev:: keelfs_reactor:: keelfs_fs:: keelfs_vhost:: keelfs_base::; do
  if ! grep -q "$present" "$symbols"; then
    echo "check-release-symbols: no $present symbol in $bin: cannot check it" >&2
    exit 1
  fi
done

forbidden='keelfs_vhost::frontend::|keelfs_bdev::fault::|keelfs_base::testing::|vhost::vhost_user::frontend::'
cargo build --release -q -p keelfs-bench
control=$(nm -C target/release/keelfs-bench | grep -cE "$forbidden" || true)
if ((control == 0)); then
  echo "check-release-symbols: the patterns match nothing in keelfs-bench either: they are stale" >&2
  exit 1
fi
if grep -E "$forbidden" "$symbols" >&2; then
  echo "check-release-symbols: FAILED: test support above is in $bin" >&2
  exit 1
fi
echo "check-release-symbols: $bin ($(wc -l <"$symbols") symbols) has no test support" \
  "(keelfs-bench, the control, has $control such symbols)"
