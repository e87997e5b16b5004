#!/usr/bin/env bash
# Run xfstests against keelfs through its mount helper (FSTYP=fuse).
#
#   scripts/xfstests.sh --xfstests DIR [--keelfsd BIN] [--tests quick|ci|LIST]
#                       [--results DIR] [--image-size SIZE] [--locks MODE]
#
# DIR is an xfstests tree already built by its own instructions (this
# project ships no copy of xfstests and no recipe for building it).
# --tests quick runs the generic group's quick tests; ci runs the subset in
# scripts/xfstests/ci-tests; anything else is passed to ./check as test
# names. Tests in scripts/xfstests/expunge are excluded, each with its
# reason there. --locks export makes keelfs hold the file locks of the
# mounts (mount option locks=, see README "Locks"), so that the lock
# tests exercise keelfs's lock table rather than the host kernel's; the
# tests in scripts/xfstests/expunge-locks-export are then excluded too.
# Prints the counts (passed, failed, not run, expunged) and exits 1 if any
# test failed.
#
# Needs root. It links /sbin/mount.fuse.keelfs to BIN (default: the
# release build, else the debug build), makes two images in /dev/shm and
# mounts them under /tmp/keelfs-xfstests.PID; its xfstests configuration is
# there too (HOST_OPTIONS), so runs can share one xfstests tree.
set -euo pipefail

prog=${0##*/}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
xfstests=""
keelfsd=""
tests=quick
results=""
image_size=4G
locks=""

usage() {
  sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
}

while (($#)); do
  case $1 in
    --xfstests) xfstests=${2:?}; shift 2 ;;
    --keelfsd) keelfsd=${2:?}; shift 2 ;;
    --tests) tests=${2:?}; shift 2 ;;
    --results) results=${2:?}; shift 2 ;;
    --image-size) image_size=${2:?}; shift 2 ;;
    --locks) locks=${2:?}; shift 2 ;;
    -h|--help) usage ;;
    *) echo "$prog: unknown argument $1" >&2; usage ;;
  esac
done

fail() { echo "$prog: $*" >&2; exit 2; }
[[ -n $xfstests ]] || fail "--xfstests DIR is required (a built xfstests tree)"
[[ -x $xfstests/check && -x $xfstests/ltp/fsstress ]] || fail "$xfstests is not a built xfstests tree"
((EUID == 0)) || fail "needs root (mounts, and the helper in /sbin)"
if [[ -z $keelfsd ]]; then
  for candidate in "$repo/target/release/keelfsd" "$repo/target/debug/keelfsd"; do
    [[ -x $candidate ]] && { keelfsd=$candidate; break; }
  done
fi
[[ -x $keelfsd ]] || fail "no keelfsd binary: build it, or pass --keelfsd BIN"
keelfsd=$(readlink -f "$keelfsd")
results=${results:-$repo/target/xfstests-results}
expunge=$here/xfstests/expunge
mount_options="subtype=,dev,suid"
if [[ -n $locks ]]; then
  mount_options+=",locks=$locks"
  if [[ $locks == export ]]; then
    cat "$expunge" "$here/xfstests/expunge-locks-export" >"/tmp/keelfs-xfstests.$$.expunge"
    expunge=/tmp/keelfs-xfstests.$$.expunge
  fi
fi

# Paths of this run only, so that two runs never share a mount or image.
base=/tmp/keelfs-xfstests.$$
test_img=/dev/shm/keelfs-xfstests.$$-test.img
scratch_img=/dev/shm/keelfs-xfstests.$$-scratch.img
config=$base/local.config

cleanup() {
  for dir in "$base/test" "$base/scratch"; do
    mountpoint -q "$dir" && umount "$dir"
  done
  rm -f "$test_img" "$scratch_img" "/tmp/keelfs-xfstests.$$.expunge"
  rm -rf "$base"
}
trap cleanup EXIT

ln -sfn "$keelfsd" /sbin/mount.fuse.keelfs
mkdir -p "$base/test" "$base/scratch" "$results"
for img in "$test_img" "$scratch_img"; do
  rm -f "$img"
  fallocate -l "$image_size" "$img"
  "$keelfsd" mkfs "$img" >/dev/null
done

# subtype= makes the mounts' type plain "fuse", which xfstests' FSTYP=fuse
# checks with df; the source is the image's path, which it finds them by.
# The tests use device nodes and set-id files: the helper's mounts honour
# them (mount(8)'s defaults); dev,suid say so explicitly.
cat >"$config" <<EOF
export FSTYP=fuse
export FUSE_SUBTYP=.keelfs
export TEST_DEV=$test_img
export TEST_DIR=$base/test
export SCRATCH_DEV=$scratch_img
export SCRATCH_MNT=$base/scratch
export TEST_FS_MOUNT_OPTS="-o $mount_options"
export MOUNT_OPTIONS="-o $mount_options"
export RESULT_BASE=$results
EOF

case $tests in
  quick) selection=(-g generic/quick) ;;
  ci) mapfile -t selection < <(grep -v '^#' "$here/xfstests/ci-tests" | awk 'NF { print $1 }') ;;
  *) read -r -a selection <<<"$tests" ;;
esac

mount -t fuse.keelfs -o "$mount_options" "$test_img" "$base/test"
umount "$base/test"

log=$results/check.log
set +e
(cd "$xfstests" && HOST_OPTIONS=$config ./check -E "$expunge" "${selection[@]}") 2>&1 | tee "$log"
set -e

# ./check's summary: "Ran: ...", "Not run: ...", "Failures: ...".
count() { { grep -E "^$1:" "$log" || true; } | tail -1 | cut -d: -f2 | wc -w; }
ran=$(count Ran)
notrun=$(count "Not run")
failed=$(count Failures)
expunged=$(grep -cvE '^(#|$)' "$expunge" || true)
# ./check's "Ran" lists every test started, those found not runnable too.
echo "$prog: $ran started: passed $((ran - notrun - failed)), failed $failed, not run $notrun;" \
  "expunged $expunged (list: $expunge)"
((failed == 0))
