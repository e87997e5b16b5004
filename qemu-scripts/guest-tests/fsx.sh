#!/bin/sh
# Guest test (busybox sh): fsx (the Rust crate, `cargo install fsx`, put in
# the guest by build-guest.sh) on keelfs, in four modes:
#   buffered  pread/pwrite, truncate, fsync/fdatasync, close+reopen,
#             fallocate, punch hole, sendfile, fadvise, copy_file_range;
#             no mmap
#   mmap      mmap reads and writes (msync) mixed with pread/pwrite,
#             truncate and msync(MS_INVALIDATE)
#   odirect   the buffered mode's operations, 4 KiB aligned, on a file opened
#             with O_DIRECT. fsx has no O_DIRECT option: the LD_PRELOAD shim
#             /usr/lib/fsx-odirect.so (qemu-scripts/fsx-odirect.c) adds
#             O_DIRECT to fsx's opens of the test file. keelfs answers
#             O_DIRECT opens with FOPEN_DIRECT_IO, so no mmap in this mode;
#             no posix_fallocate either: fsx 0.3.2 aligns its length but not
#             its offset and then calls it with length 0 (EINVAL), which it
#             takes for a failure.
#   odirect-unaligned  the same with byte-aligned offsets and sizes (FUSE
#             allows unaligned O_DIRECT).
# Each run must print fsx's "All operations completed A-OK!" and exit 0.
# Fixed seeds (printed) make a failure replayable: the same seed, config and
# op count reproduce it. 8000 ops per mode (FSX_OPS overrides it when run by
# hand).
set -u
tag=${KEELFS_TAG:-keelfs}
ops=${FSX_OPS:-8000}
failed=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; failed=$((failed + 1)); }

command -v fsx >/dev/null || { echo "FAIL: no fsx in the guest (cargo install fsx, then rebuild the guest: qemu-scripts/build-guest.sh)"; exit 1; }
grep -q " /mnt virtiofs " /proc/mounts || mount -t virtiofs "$tag" /mnt ||
  { echo "FAIL: mount -t virtiofs $tag /mnt"; exit 1; }
d=/mnt/fsx
rm -rf "$d"
mkdir -p "$d" /tmp/fsx-artifacts

# The configs (qemu-scripts/guest-tests/fsx/*.toml) are baked into the guest
# by build-guest.sh.
cp /usr/share/keelfs/fsx/buffered.toml /usr/share/keelfs/fsx/mmap.toml \
  /usr/share/keelfs/fsx/odirect.toml /tmp/ ||
  { echo "FAIL: fsx configs missing from the guest (rebuild it: qemu-scripts/build-guest.sh)"; exit 1; }
sed -e 's/^align = 4096$/align = 1/' -e 's/^max = 131072$/min = 1\nmax = 131072/' \
  /tmp/odirect.toml >/tmp/odirect-unaligned.toml

# run_fsx MODE SEED [ENV=VALUE...]
run_fsx() {
  mode=$1 seed=$2
  shift 2
  f=$d/$mode.file
  echo "=== fsx $mode: fsx -f /tmp/$mode.toml -N $ops -S $seed -P /tmp/fsx-artifacts $f $*"
  sed 's/^/  /' "/tmp/$mode.toml"
  t0=$(date +%s)
  rc=0
  env "$@" fsx -f "/tmp/$mode.toml" -N "$ops" -S "$seed" -P /tmp/fsx-artifacts "$f" >/tmp/fsx.out 2>&1 || rc=$?
  t1=$(date +%s)
  # On failure fsx prints the error, then its last operations (up to
  # 1024, "[ERROR fsx] <step> <OP> ..."): show all but the older ones.
  grep -v '^\[ERROR fsx\] *[0-9][0-9]* [A-Z]' /tmp/fsx.out
  grep '^\[ERROR fsx\] *[0-9][0-9]* [A-Z]' /tmp/fsx.out | tail -n 40
  if [ "$rc" -eq 0 ] && grep -q "All operations completed A-OK!" /tmp/fsx.out; then
    pass "fsx $mode: $ops ops, seed $seed ($((t1 - t0)) s)"
    return 0
  fi
  fail "fsx $mode: exit status $rc, seed $seed (replay: same config, -N $ops -S $seed)"
  for a in /tmp/fsx-artifacts/*.fsxlog; do
    [ -f "$a" ] && { echo "--- $a (tail)"; tail -n 40 "$a"; }
  done
  echo "--- guest dmesg (tail)"; dmesg | tail -n 20
  return 1
}

run_fsx buffered 11
run_fsx mmap 22
for mode in odirect odirect-unaligned; do
  if [ ! -f /usr/lib/fsx-odirect.so ]; then
    fail "fsx $mode: /usr/lib/fsx-odirect.so missing from the guest (build-guest.sh builds it when cc is installed)"
    continue
  fi
  run_fsx $mode 33 FSX_ODIRECT_PATH=$d/$mode.file LD_PRELOAD=/usr/lib/fsx-odirect.so || continue
  n=$(sed -n 's/^fsx-odirect: \([0-9]*\) open.*/\1/p' /tmp/fsx.out)
  if [ "${n:-0}" -gt 0 ]; then
    pass "fsx $mode: $n opens of the test file had O_DIRECT"
  else
    fail "fsx $mode: the O_DIRECT shim changed no open (output: $(grep fsx-odirect /tmp/fsx.out))"
  fi
done

rm -rf "$d"
umount /mnt || fail "umount /mnt"
if [ "$failed" -ne 0 ]; then
  echo "fsx: $failed check(s) FAILED"
  exit 1
fi
echo "fsx: all modes passed"
