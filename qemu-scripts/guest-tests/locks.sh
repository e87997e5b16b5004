#!/bin/sh
# Guest test (busybox sh) for locks a guest and the host mount agree on
# (issue 36), driven from the host by qemu-scripts/locks.sh. The host
# mount and this guest serve one export; keelfsd holds its locks.
#
#   1. the host holds a POSIX lock on /mnt/posix and a flock lock on
#      /mnt/flk (markers /mnt/host-holds, /mnt/host-flock): the guest's
#      F_SETLK and flock -n fail, and F_GETLK reports the host's lock;
#   2. "KEELFS-GUEST-SAW-HOST": the host lets go (removes the markers);
#      the guest then takes both locks;
#   3. the guest holds a POSIX lock on /mnt/gposix and a flock lock on
#      /mnt/gflk (markers /mnt/guest-holds, /mnt/guest-flock) and says
#      "KEELFS-GUEST-HOLDS"; the host checks it is kept out, starts
#      blocking waits, and removes the markers, which ends the holders.
# Prints PASS:/FAIL: per check; exits 1 when any failed.
set -u
tag=${KEELFS_TAG:-keelfs}
failed=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; failed=1; }
# until TRIES CMD...: run CMD every 0.2 s until it succeeds, TRIES times
# at most. A change by the host shows here within the 1 s a guest beside a
# host mount keeps names and attributes.
until_ok() {
  n=$1
  shift
  while [ "$n" -gt 0 ]; do
    "$@" && return 0
    n=$((n - 1))
    sleep 0.2
  done
  return 1
}

mount -t virtiofs "$tag" /mnt || { echo "FAIL: mount -t virtiofs $tag /mnt"; exit 1; }
until_ok 300 test -e /mnt/host-holds -a -e /mnt/host-flock || fail "the host's locks never showed"

fcntl-lock try /mnt/posix
st=$?
if [ "$st" = 1 ]; then pass "the host's POSIX lock keeps the guest's F_SETLK out"; else fail "guest F_SETLK: exit $st"; fi
held=$(fcntl-lock getlk /mnt/posix)
if [ "$held" = "W 0 0" ]; then pass "the guest's F_GETLK reports the host's write lock"; else fail "guest F_GETLK: $held"; fi
fcntl-lock flock-try /mnt/flk
st=$?
if [ "$st" = 1 ]; then pass "the host's flock lock keeps the guest's out"; else fail "guest flock: exit $st"; fi

echo "KEELFS-GUEST-SAW-HOST"
if until_ok 300 fcntl-lock try /mnt/posix; then
  pass "the guest's F_SETLK succeeds once the host let go"
else
  fail "the host's POSIX lock was never released"
fi
if until_ok 300 fcntl-lock flock-try /mnt/flk; then
  pass "the guest's flock succeeds once the host let go"
else
  fail "the host's flock lock was never released"
fi

fcntl-lock hold /mnt/gposix /mnt/guest-holds &
posix_holder=$!
fcntl-lock flock-hold /mnt/gflk /mnt/guest-flock &
flock_holder=$!
until_ok 300 test -e /mnt/guest-holds -a -e /mnt/guest-flock || fail "the guest's holders did not start"
echo "KEELFS-GUEST-HOLDS"
if wait "$posix_holder"; then pass "the guest's POSIX holder ended when the host said"; else fail "the POSIX holder failed"; fi
if wait "$flock_holder"; then pass "the guest's flock holder ended when the host said"; else fail "the flock holder failed"; fi
# The host's waits were granted; its report says so. Wait for its word.
until_ok 600 test -e /mnt/host-done || fail "the host never finished"
cat /mnt/host-done
umount /mnt
exit "$failed"
