#!/bin/sh
# Guest test (busybox sh) for data checksums (issue 38), driven from the
# host by qemu-scripts/checksums.sh:
#
#   1. /mnt/f gets 256 blocks of 4 KiB by direct writes, block i holding
#      the line "keelfs-csum-block-i" over and over; "KEELFS-CSUM-WRITTEN"
#      is printed once they are on the device (fsync), and the host then
#      flips a byte of block 100 in the image behind keelfs's back;
#   2. after a pause, every block is read back by direct reads (so that
#      each goes to the device): block 100 must fail with EIO, the others
#      must read as written; "KEELFS-CSUM-READ" then lets the host scrub.
# Prints PASS:/FAIL: per check; exits 1 when any failed.
set -u
tag=${KEELFS_TAG:-keelfs}
failed=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; failed=1; }

mount -t virtiofs "$tag" /mnt || { echo "FAIL: mount -t virtiofs $tag /mnt"; exit 1; }
block() { yes "keelfs-csum-block-$1" | head -c 4096; }
i=0
: >/tmp/f
while [ $i -lt 256 ]; do
  block $i >>/tmp/f
  i=$((i + 1))
done
if dd if=/tmp/f of=/mnt/f bs=4096 oflag=direct conv=fsync 2>/tmp/dd.err; then
  pass "256 blocks written by direct writes"
else
  fail "direct writes of /mnt/f: $(cat /tmp/dd.err)"
fi
echo "KEELFS-CSUM-WRITTEN"
# The host damages block 100 meanwhile.
sleep 15
bad_ok=0 good_ok=0
i=0
while [ $i -lt 256 ]; do
  if dd if=/mnt/f of=/tmp/got bs=4096 skip=$i count=1 iflag=direct 2>/tmp/dd.err; then
    if [ $i -eq 100 ]; then
      fail "block 100, damaged on the host, read without an error"
    elif block $i | cmp -s - /tmp/got; then
      good_ok=$((good_ok + 1))
    else
      fail "block $i reads back different"
    fi
  elif [ $i -eq 100 ] && grep -qi "input/output error" /tmp/dd.err; then
    bad_ok=1
  else
    fail "block $i: $(cat /tmp/dd.err)"
  fi
  i=$((i + 1))
done
[ $bad_ok -eq 1 ] && pass "the damaged block reads as EIO (Input/output error)"
[ $good_ok -eq 255 ] && pass "the other 255 blocks read back as written"
echo "KEELFS-CSUM-READ"
# The host scrubs meanwhile.
sleep 10
exit $failed
