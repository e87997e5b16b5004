#!/bin/sh
# Guest test (busybox sh): namespace operations on keelfs at /mnt: mkdir and
# rmdir, create and unlink, rename (files and directories, over existing
# targets), hard links, symlinks, chmod/chown/utimes, a 500-entry readdir,
# xattrs (setfattr/getfattr must be in the guest), statfs, a large
# sparse file, and fstrim. Prints PASS/FAIL per check; exits 1 when any check failed.
# Usage: qemu-scripts/run-guest.sh --socket S --script qemu-scripts/guest-tests/namespace.sh
# shellcheck disable=SC2012  # readdir through ls is the point
set -u
tag=${KEELFS_TAG:-keelfs}
failed=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; failed=$((failed + 1)); }
# check DESC CMD...: runs CMD, PASS or FAIL by its status.
check() {
  _desc=$1; shift
  if "$@"; then pass "$_desc"; else fail "$_desc"; fi
}
# eq DESC GOT WANT
eq() {
  if [ "$2" = "$3" ]; then pass "$1"; else fail "$1: got '$2', want '$3'"; fi
}
drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; }
dd if=/dev/zero of=/tmp/zero4k bs=4096 count=1 2>/dev/null
# zero_block FILE N: the Nth 4 KiB block of FILE is all zeros.
zero_block() { dd if="$1" bs=4096 skip="$2" count=1 2>/dev/null | cmp -s - /tmp/zero4k; }

grep -q " /mnt virtiofs " /proc/mounts || mount -t virtiofs "$tag" /mnt ||
  { echo "FAIL: mount -t virtiofs $tag /mnt"; exit 1; }
d=/mnt/ns.$$
rm -rf "$d"
mkdir "$d" || { echo "FAIL: mkdir $d"; exit 1; }
cd "$d" || exit 1

echo "=== mkdir / rmdir"
check "mkdir -p a/b/c" mkdir -p a/b/c
check "a/b/c is a directory" test -d a/b/c
eq "new directory link count" "$(stat -c %h a/b/c)" 2
eq "parent link count with one subdirectory" "$(stat -c %h a/b)" 3
check "mkdir over an existing directory fails" sh -c '! mkdir a/b 2>/dev/null'
check "rmdir of a non-empty directory fails" sh -c '! rmdir a/b 2>/dev/null'
check "rmdir a/b/c" rmdir a/b/c
check "a/b/c is gone" test ! -e a/b/c
eq "parent link count after rmdir" "$(stat -c %h a/b)" 2

echo "=== create / unlink"
echo hello >f1
eq "create + read" "$(cat f1)" hello
check "file type" test -f f1
eq "size" "$(stat -c %s f1)" 6
: >empty
eq "empty file size" "$(stat -c %s empty)" 0
check "unlink f1" rm f1
check "f1 is gone" test ! -e f1
check "unlink of a missing file fails" sh -c '! rm f1 2>/dev/null'
# An open file that is unlinked stays readable (orphan).
echo orphan-data >orph
exec 3<orph
rm orph
eq "read of an unlinked, still open file" "$(cat <&3)" orphan-data
exec 3<&-

echo "=== rename"
echo one >r1
echo two >r2
check "rename file" mv r1 r3
check "old name gone" test ! -e r1
eq "renamed content" "$(cat r3)" one
check "rename over an existing file" mv r3 r2
eq "target replaced" "$(cat r2)" one
check "source gone after rename over" test ! -e r3
mkdir -p da/sub dx
echo in-da >da/sub/file
check "rename directory" mv da db
eq "content below a renamed directory" "$(cat db/sub/file)" in-da
mkdir de
check "rename directory over an empty directory" sh -c 'mv -T db de'
check "old directory name gone" test ! -e db
eq "content after rename over" "$(cat de/sub/file)" in-da
mkdir -p df/x
check "rename directory over a non-empty directory fails" sh -c '! mv -T de df 2>/dev/null'
check "rename a file into a subdirectory" mv r2 de/sub/r2
eq "moved file content" "$(cat de/sub/r2)" one
check "rename a directory into another" mv de/sub dx/sub2
eq "link count of a directory that lost a subdirectory" "$(stat -c %h de)" 2
eq "link count of a directory that gained one" "$(stat -c %h dx)" 3

echo "=== hard links"
echo linked >h1
check "link h1 h2" ln h1 h2
eq "link count 2" "$(stat -c %h h1)" 2
eq "same inode" "$(stat -c %i h2)" "$(stat -c %i h1)"
ln h1 a/h3
eq "link count 3 across directories" "$(stat -c %h h2)" 3
echo more >>h2
eq "write through one name is seen through another" "$(cat a/h3)" "$(printf 'linked\nmore')"
rm h1
eq "link count after unlinking one name" "$(stat -c %h h2)" 2
rm a/h3
eq "link count 1" "$(stat -c %h h2)" 1
check "hard link to a directory fails" sh -c '! ln a alink 2>/dev/null'

echo "=== symlinks"
check "symlink" ln -s de/../h2 s1
eq "readlink" "$(readlink s1)" de/../h2
eq "lstat type" "$(stat -c %F s1)" "symbolic link"
eq "read through symlink" "$(head -n1 s1)" linked
ln -s /nonexistent/target dangling
eq "dangling symlink readlink" "$(readlink dangling)" /nonexistent/target
check "dangling symlink does not resolve" test ! -e dangling
long=$(printf 'x%.0s' $(seq 1 1000))
check "1000-byte symlink target" ln -s "$long" slong
eq "1000-byte readlink" "$(readlink slong)" "$long"

echo "=== chmod / chown / utimes"
echo attrs >m
check "chmod 640" chmod 640 m
eq "mode" "$(stat -c %a m)" 640
chmod 4755 m
eq "setuid mode" "$(stat -c %a m)" 4755
check "chown 1234:5678" chown 1234:5678 m
eq "owner" "$(stat -c %u:%g m)" 1234:5678
check "touch -d" touch -d "2001-02-03 04:05:06" m
eq "mtime" "$(stat -c %Y m)" 981173106
eq "atime" "$(stat -c %X m)" 981173106
ctime_before=$(stat -c %Z m)
sleep 1
chmod 600 m
check "chmod updates ctime" test "$(stat -c %Z m)" -gt "$ctime_before"
mtime_before=$(stat -c %Y m)
echo more >>m
check "write updates mtime" test "$(stat -c %Y m)" -gt "$mtime_before"
drop_caches
eq "attributes after drop_caches" "$(stat -c '%a %u:%g' m)" "600 1234:5678"
mkdir tdir
touch -d "2002-03-04 05:06:07" tdir
eq "directory mtime" "$(stat -c %Y tdir)" 1015218367

echo "=== readdir, 500 entries"
mkdir big
i=0
while [ $i -lt 500 ]; do : >"big/entry-with-a-longer-name-$i"; i=$((i + 1)); done
eq "ls count" "$(ls big | wc -l)" 500
eq "ls -a count (with . and ..)" "$(ls -a big | wc -l)" 502
eq "find count" "$(find big -type f | wc -l)" 500
eq "distinct names" "$(ls big | sort -u | wc -l)" 500
drop_caches
eq "ls count after drop_caches" "$(ls big | wc -l)" 500
i=0
while [ $i -lt 500 ]; do rm "big/entry-with-a-longer-name-$i"; i=$((i + 2)); done
eq "count after deleting every second entry" "$(ls big | wc -l)" 250
check "entry-1 still there" test -e big/entry-with-a-longer-name-1
check "entry-0 gone" test ! -e big/entry-with-a-longer-name-0
rm -r big
check "rm -r of the directory" test ! -e big

echo "=== xattrs"
if ! command -v setfattr >/dev/null || ! command -v getfattr >/dev/null; then
  fail "xattrs: no setfattr/getfattr in the guest (apt-get install attr, then rebuild the guest)"
else
  echo x >xf
  check "setfattr user.keelfs" setfattr -n user.keelfs -v value1 xf
  eq "getfattr" "$(getfattr --only-values -n user.keelfs xf)" value1
  setfattr -n user.second -v 2 xf
  eq "listxattr" "$(getfattr -d -m '^user\.' xf | grep -c '^user\.')" 2
  check "replace value" setfattr -n user.keelfs -v value-two xf
  eq "replaced value" "$(getfattr --only-values -n user.keelfs xf)" value-two
  check "removexattr" setfattr -x user.keelfs xf
  check "removed xattr is gone" sh -c '! getfattr -n user.keelfs xf >/dev/null 2>&1'
  check "getfattr of a missing xattr fails" sh -c '! getfattr -n user.missing xf >/dev/null 2>&1'
  big=$(printf 'v%.0s' $(seq 1 2000))
  check "2000-byte xattr value" setfattr -n user.big -v "$big" xf
  drop_caches
  eq "2000-byte xattr value read back" "$(getfattr --only-values -n user.big xf)" "$big"
  check "xattr on a directory" setfattr -n user.d -v dirval tdir
  eq "directory xattr" "$(getfattr --only-values -n user.d tdir)" dirval
fi

echo "=== statfs"
df /mnt
df -i /mnt
# shellcheck disable=SC2046  # df's fields, split on purpose
set -- $(df -i /mnt | tail -n1)
check "statfs: free inodes ($4) <= total inodes ($2)" test "$4" -le "$2"
# shellcheck disable=SC2046  # df's fields, split on purpose
set -- $(df -k /mnt | tail -n1)
total_kb=$2 avail_before=$4
check "statfs: total > 0" test "$total_kb" -gt 0
check "statfs: available <= total" test "$avail_before" -le "$total_kb"
dd if=/dev/zero of=space bs=1M count=16 2>/dev/null
sync
# shellcheck disable=SC2046  # df's fields, split on purpose
set -- $(df -k /mnt | tail -n1)
avail_after=$4
used=$((avail_before - avail_after))
check "statfs: 16 MiB written lowers free space by >= 15 MiB (by ${used} KiB)" test "$used" -ge 15360
rm space
sync
i=0
while :; do
  # shellcheck disable=SC2046  # df's fields, split on purpose
  set -- $(df -k /mnt | tail -n1)
  [ "$4" -ge $((avail_after + 15360)) ] || [ $i -ge 5 ] || { sleep 1; i=$((i + 1)); continue; }
  break
done
check "statfs: deleting it gives the space back (free $avail_after -> $4 KiB)" test "$4" -ge $((avail_after + 15360))

echo "=== large sparse file"
check "truncate -s 10G" truncate -s 10G sparse
eq "size" "$(stat -c %s sparse)" 10737418240
check "few blocks allocated (st_blocks $(stat -c %b sparse))" test "$(stat -c %b sparse)" -lt 64
check "read in a hole is zeros" zero_block sparse 1000000
printf 'middle-marker' | dd of=sparse bs=1 seek=5368709120 conv=notrunc 2>/dev/null
printf 'tail-marker' | dd of=sparse bs=4096 seek=2621439 conv=notrunc 2>/dev/null
eq "size unchanged by writes inside" "$(stat -c %s sparse)" 10737418240
drop_caches
eq "data at 5 GiB" "$(dd if=sparse bs=1 skip=5368709120 count=13 2>/dev/null)" middle-marker
eq "data in the last block" "$(dd if=sparse bs=4096 skip=2621439 count=1 2>/dev/null | head -c 11)" tail-marker
check "zeros before the 5 GiB marker" zero_block sparse 1310719
check "still sparse (st_blocks $(stat -c %b sparse))" test "$(stat -c %b sparse)" -lt 256
printf 'past-end' | dd of=sparse bs=1 seek=12884901888 2>/dev/null
eq "write past the end extends to 12 GiB + 8" "$(stat -c %s sparse)" 12884901896
check "truncate down to 1 MiB" truncate -s 1M sparse
eq "size after shrink" "$(stat -c %s sparse)" 1048576
truncate -s 6G sparse
check "truncate up again: the old data at 5 GiB reads as zeros" zero_block sparse 1310720
drop_caches
check "... also after drop_caches" zero_block sparse 1310720
rm sparse

echo "=== cleanup"
cd /
check "rm -r test directory" rm -r "$d"
check "test directory gone" test ! -e "$d"

echo "=== fstrim"
# A guest's fstrim reaches keelfs as FUSE_IOCTL(FITRIM): it trims the free
# space and says how much (ENOTTY here would mean the ioctl is unserved).
trimmed=$(fstrim -v /mnt 2>&1)
echo "$trimmed"
# shellcheck disable=SC2046  # "/mnt: N bytes trimmed", split on purpose
set -- $(echo "$trimmed" | tail -n1)
check "fstrim -v /mnt trims free space ($trimmed)" test "${4:-}" = trimmed -a "${2:-0}" -gt 0
umount /mnt || fail "umount /mnt"

if [ "$failed" -ne 0 ]; then
  echo "namespace: $failed check(s) FAILED"
  exit 1
fi
echo "namespace: all checks passed"
