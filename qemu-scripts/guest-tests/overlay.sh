#!/bin/sh
# Guest test (busybox sh): keelfs as overlayfs's upper layer, as container
# runtimes use it. Creates, deletes and renames through an overlay whose
# lower layer is the guest's tmpfs and whose upper and work directories are
# on keelfs at /mnt, then checks the upper layer itself: copied-up data,
# whiteouts (0:0 character devices, from RENAME_WHITEOUT), opaque
# directories (trusted.overlay.opaque), and the merged view after the
# overlay is mounted again. Also checks that overlayfs found no feature it
# wants missing in the upper layer (RENAME_WHITEOUT, O_TMPFILE, xattrs),
# and POSIX ACLs set and inherited in the guest. Prints PASS/FAIL per check; exits 1
# when any check failed.
# shellcheck disable=SC2012  # the merged listing through ls is the point
set -u
tag=${KEELFS_TAG:-keelfs}
failed=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; failed=$((failed + 1)); }
check() {
  _desc=$1; shift
  if "$@"; then pass "$_desc"; else fail "$_desc"; fi
}
eq() {
  if [ "$2" = "$3" ]; then pass "$1"; else fail "$1: got '$2', want '$3'"; fi
}
# whiteout PATH: PATH is a 0:0 character device, overlayfs's whiteout.
whiteout() { [ -c "$1" ] && [ "$(stat -c '%t:%T' "$1")" = "0:0" ]; }

grep -q " /mnt virtiofs " /proc/mounts || mount -t virtiofs "$tag" /mnt ||
  { echo "FAIL: mount -t virtiofs $tag /mnt"; exit 1; }
d=/mnt/ovl.$$
lower=/tmp/lower merged=/tmp/merged
rm -rf "$d" "$lower" "$merged"
mkdir -p "$d/upper" "$d/work" "$lower/dir" "$lower/gone-dir" "$merged"
echo lower-a >"$lower/a"
echo lower-b >"$lower/b"
echo lower-c >"$lower/dir/c"
echo lower-x >"$lower/gone-dir/x"
overlay_mount() {
  mount -t overlay overlay -o "lowerdir=$lower,upperdir=$d/upper,workdir=$d/work" "$merged"
}

echo "=== mount"
# The feature check below reads the kernel log: it must be readable.
check "the kernel log is readable" test -n "$(dmesg | head -n 1)"
dmesg -c >/dev/null 2>&1
check "mount overlay with keelfs as the upper layer" overlay_mount
missing=$(dmesg | grep -i "overlayfs" | grep -Eci "not support (tmpfile|RENAME_WHITEOUT|xattr)|missing")
eq "overlayfs finds RENAME_WHITEOUT, tmpfile and xattrs in keelfs" "$missing" 0
dmesg | grep -i overlayfs

echo "=== create, modify, delete, rename"
echo new >"$merged/new"
eq "a new file lands in the upper layer" "$(cat "$d/upper/new")" new
echo more >>"$merged/dir/c"
eq "a modified lower file is copied up" "$(cat "$d/upper/dir/c")" "lower-c
more"
check "the lower file is untouched" test "$(cat "$lower/dir/c")" = lower-c
rm "$merged/a"
check "a deleted lower file is gone from the merged view" test ! -e "$merged/a"
check "and is a whiteout in the upper layer" whiteout "$d/upper/a"
mv "$merged/b" "$merged/b2"
eq "a renamed lower file keeps its data" "$(cat "$merged/b2")" lower-b
check "its old name is a whiteout (RENAME_WHITEOUT)" whiteout "$d/upper/b"
check "its new name is in the upper layer" test -f "$d/upper/b2"
rm -rf "$merged/gone-dir"
mkdir "$merged/gone-dir"
check "a directory made over a deleted lower one is empty" test -z "$(ls -A "$merged/gone-dir")"
eq "and is opaque in the upper layer" \
  "$(getfattr --only-values -n trusted.overlay.opaque "$d/upper/gone-dir" 2>/dev/null)" y

echo "=== mounted again"
check "umount the overlay" umount "$merged"
check "mount it again" overlay_mount
eq "merged view after remount" "$(cd "$merged" && ls | tr '\n' ' ')" "b2 dir gone-dir new "
eq "copied-up data after remount" "$(tail -n1 "$merged/dir/c")" more
check "the deleted directory's contents stay hidden" test ! -e "$merged/gone-dir/x"
check "umount the overlay" umount "$merged"

echo "=== POSIX ACLs"
mkdir "$d/acl"
check "setfacl on a directory" setfacl -m u:1234:rwx -d -m u:1234:r-x "$d/acl"
echo x >"$d/acl/f"
eq "a new file inherits the default ACL" "$(getfacl -cn "$d/acl/f" | grep '^user:1234' | cut -f1)" "user:1234:r-x"
eq "the mode follows the ACL mask" "$(stat -c %A "$d/acl/f")" "-rw-r--r--"
check "chmod rewrites the mask" chmod 640 "$d/acl/f"
eq "mask after chmod" "$(getfacl -cn "$d/acl/f" | grep '^mask')" "mask::r--"

cd / && rm -rf "$d" "$lower"
umount /mnt
if [ "$failed" -ne 0 ]; then echo "overlay.sh: $failed check(s) failed"; exit 1; fi
echo "overlay.sh: all checks passed"
