#!/bin/sh
# Guest test (busybox sh) for keelfs's operations, driven from the host by
# qemu-scripts/ops.sh:
#
#   1. "KEELFS-IO-START": fio runs 4k random O_DIRECT writes with crc32c
#      verification for $runtime s while the host adds and removes other
#      exports of the same keelfsd; fio must finish with no error;
#   2. the space check: a 64 MiB file is written and synced
#      ("KEELFS-WRITTEN": the host notes the image's allocated size within
#      5 s), deleted, then `fstrim -v /mnt` must report at least 32 MiB
#      trimmed; "KEELFS-TRIMMED" tells the host to check that the image's
#      allocated size shrank;
#   3. the quota check (when the host set one, /keelfs/files/quota-mib):
#      df reports the quota as the size, and writing past it fails with
#      EDQUOT ("Disk quota exceeded").
# Prints PASS:/FAIL: per check; exits 1 when any failed.
set -u
tag=${KEELFS_TAG:-keelfs}
runtime=40
failed=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; failed=1; }

mount -t virtiofs "$tag" /mnt || { echo "FAIL: mount -t virtiofs $tag /mnt"; exit 1; }
cd /root || exit 1 # fio keeps its verify state in the cwd

echo "KEELFS-IO-START"
if fio --eta=never --name=steady --filename=/mnt/steady --size=32m --bs=4k --rw=randwrite --direct=1 \
  --ioengine=psync --verify=crc32c --do_verify=1 --verify_fatal=1 --time_based --runtime="$runtime" \
  --output=/tmp/fio.out; then
  pass "fio: ${runtime}s of verified O_DIRECT writes while the host added and removed exports"
else
  fail "fio: $(grep -i err /tmp/fio.out | head -n 3)"
fi
rm -f /mnt/steady

dd if=/dev/urandom of=/mnt/big bs=1M count=64 2>/dev/null && sync
echo "KEELFS-WRITTEN"
# The host notes the image's allocated size meanwhile.
sleep 5
rm -f /mnt/big
# The file's blocks are freed once the kernel forgets its inode (FUSE
# FORGET, sent when the inode leaves the cache) and the free is committed
# (keelfsd's commit timer: 5 s). Only then can fstrim give them back.
echo 2 >/proc/sys/vm/drop_caches
sync
sleep 6
if out=$(fstrim -v /mnt 2>&1); then
  trimmed=$(echo "$out" | sed -n 's/.*(\([0-9]*\) bytes).*/\1/p')
  [ -n "$trimmed" ] || trimmed=$(echo "$out" | sed -n 's/.*: \([0-9]*\) bytes.*/\1/p')
  if [ "${trimmed:-0}" -ge $((32 << 20)) ]; then
    pass "fstrim -v /mnt: $out"
  else
    fail "fstrim -v /mnt trimmed too little: $out"
  fi
else
  fail "fstrim -v /mnt: $out"
fi
echo "KEELFS-TRIMMED"

if [ -e /keelfs/files/quota-mib ]; then
  quota=$(cat /keelfs/files/quota-mib)
  size_kib=$(df -k /mnt | awk 'NR == 2 { print $2 }')
  if [ "$size_kib" -le $((quota * 1024)) ] && [ "$size_kib" -ge $((quota * 1024 * 9 / 10)) ]; then
    pass "df shows the ${quota} MiB quota as the size (${size_kib} KiB)"
  else
    fail "df: size ${size_kib} KiB, the quota is ${quota} MiB"
  fi
  if out=$(dd if=/dev/zero of=/mnt/over bs=1M count=$((quota * 2)) oflag=direct 2>&1); then
    fail "writing $((quota * 2)) MiB past a ${quota} MiB quota succeeded"
  elif echo "$out" | grep -qi "quota"; then
    pass "writing past the quota: $(echo "$out" | grep -i quota | head -n 1)"
  else
    fail "writing past the quota failed, but not with EDQUOT: $out"
  fi
  rm -f /mnt/over
fi

umount /mnt || fail "umount /mnt"
exit "$failed"
