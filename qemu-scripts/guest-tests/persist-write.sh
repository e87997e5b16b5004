#!/bin/sh
# Guest test (busybox sh): writes a known tree to /mnt/persist (files of
# edge sizes, a 3 MiB random file and a hard link to it, a 64 MiB sparse
# file, overwritten / appended / truncated / renamed / deleted files,
# 200 small files, symlinks, a fifo, modes, owners, an mtime, xattrs),
# records its md5 and metadata lists in /mnt/persist-manifest
# (persist-check.sh --record), syncs, and checks it three times: at once,
# after drop_caches, and after umount + mount. It prints the lists' md5 as
# "PERSIST-MANIFEST-MD5=..." for a later persist-check.sh (after a daemon
# restart) to compare with.
# Needs persist-check.sh in the guest:
#   run-guest.sh --script persist-write.sh --add persist-check.sh
set -u
tag=${KEELFS_TAG:-keelfs}
check=/keelfs/files/persist-check.sh
failed=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; failed=$((failed + 1)); }
[ -f $check ] || { echo "FAIL: $check missing (run-guest.sh --add qemu-scripts/guest-tests/persist-check.sh)"; exit 1; }
command -v setfattr >/dev/null || { echo "FAIL: no setfattr in the guest (apt-get install attr, then rebuild the guest)"; exit 1; }

grep -q " /mnt virtiofs " /proc/mounts || mount -t virtiofs "$tag" /mnt ||
  { echo "FAIL: mount -t virtiofs $tag /mnt"; exit 1; }
t=/mnt/persist
rm -rf "$t" /mnt/persist-manifest
echo "=== writing $t"
trap 'echo "FAIL: writing the tree: the command above failed"' EXIT
set -e
mkdir -p "$t/a/b/c" "$t/empty" "$t/many"
dd if=/dev/urandom of=/tmp/rand bs=1M count=3 2>/dev/null
: >"$t/zero"
printf 'x' >"$t/one"
for n in 4095 4096 4097; do head -c $n /tmp/rand >"$t/f$n"; done
cp /tmp/rand "$t/big"
ln "$t/big" "$t/a/b/c/hl"
truncate -s 64M "$t/sparse"
dd if=/tmp/rand of="$t/sparse" bs=4096 count=3 seek=5000 conv=notrunc 2>/dev/null
printf 'end' | dd of="$t/sparse" bs=1 seek=67108861 conv=notrunc 2>/dev/null
head -c 1048576 /tmp/rand >"$t/overwritten"
dd if=/dev/urandom of="$t/overwritten" bs=1000 count=70 seek=333 conv=notrunc 2>/dev/null
i=0
while [ $i -lt 20 ]; do head -c $((i * 997 + 1)) /tmp/rand >>"$t/appended"; i=$((i + 1)); done
head -c 1048576 /tmp/rand >"$t/truncated"
truncate -s 300001 "$t/truncated"
echo "renamed" >"$t/renamed-from"
mv "$t/renamed-from" "$t/renamed-to"
echo "deleted" >"$t/deleted"
rm "$t/deleted"
mkdir "$t/a/b/deleted-dir"
rmdir "$t/a/b/deleted-dir"
i=0
while [ $i -lt 200 ]; do echo "entry $i" >"$t/many/n.$i"; i=$((i + 1)); done
ln -s ../big "$t/a/sym"
ln -s /nowhere/at/all "$t/dangling"
mkfifo "$t/a/fifo"
chmod 751 "$t/f4097"
chmod 700 "$t/a/b"
chown 1000:1000 "$t/one"
chown 1234:5678 "$t/a/b/c"
touch -d "2010-10-10 10:10:10" "$t/f4096"
setfattr -n user.persist -v hello "$t/one"
setfattr -n user.dir -v "a directory" "$t/a"
set +e
trap - EXIT
sync
sh $check --record

echo "=== check 1: right after writing (page cache)"
sh $check --mounted || fail "check right after writing"
echo "=== check 2: after drop_caches"
sync
echo 3 >/proc/sys/vm/drop_caches
sh $check --mounted || fail "check after drop_caches"
echo "=== check 3: after umount + mount"
umount /mnt || fail "umount /mnt"
mount -t virtiofs "$tag" /mnt || { echo "FAIL: mount again"; exit 1; }
sh $check --mounted || fail "check after umount + mount"
umount /mnt || fail "umount /mnt"
if [ "$failed" -ne 0 ]; then
  echo "persist-write: $failed stage(s) FAILED"
  exit 1
fi
echo "persist-write: tree written and checked 3 times"
