#!/bin/sh
# Guest test (busybox sh): after keelfsd was killed (SIGKILL) in the middle
# of a workload and restarted, the filesystem must be usable: every entry
# can be stat'ed, every regular file read to its end without an error, the
# whole tree removed, and a new file written and read back.
# (What the killed workload wrote last may be lost; only consistency is
# checked here. run-e2e.sh --with-crash runs it after stress.sh.)
# shellcheck disable=SC2012  # readdir through ls is the point
set -u
tag=${KEELFS_TAG:-keelfs}
failed=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; failed=$((failed + 1)); }

mount -t virtiofs "$tag" /mnt || { echo "FAIL: mount -t virtiofs $tag /mnt"; exit 1; }
df /mnt
find /mnt >/tmp/entries 2>/tmp/find.err || fail "find /mnt: $(head -n 3 /tmp/find.err)"
pass "find: $(wc -l </tmp/entries) entries"
bad=0
files=0
while IFS= read -r p; do
  stat "$p" >/dev/null 2>&1 || { echo "stat $p failed"; bad=$((bad + 1)); continue; }
  if [ ! -f "$p" ] || [ -L "$p" ]; then continue; fi
  files=$((files + 1))
  size=$(stat -c %s "$p")
  got=$(wc -c <"$p" 2>/tmp/read.err) || { echo "read $p: $(cat /tmp/read.err)"; bad=$((bad + 1)); continue; }
  [ "$got" -eq "$size" ] || { echo "read $p: $got bytes, size $size"; bad=$((bad + 1)); }
done </tmp/entries
if [ "$bad" -eq 0 ]; then pass "stat of every entry, read of all $files files to their size"; else fail "$bad entries failed stat or read"; fi
(cd /mnt && rm -rf ./* ./.[!.]*) 2>/tmp/rm.err
left=$(ls -A /mnt | wc -l)
if [ "$left" -eq 0 ]; then pass "removed everything"; else fail "$left entries left after rm -rf: $(ls -A /mnt | head -n 5 | tr '\n' ' ') $(head -n 3 /tmp/rm.err)"; fi
dd if=/dev/urandom of=/tmp/new bs=64k count=16 2>/dev/null
cp /tmp/new /mnt/new && sync && echo 3 >/proc/sys/vm/drop_caches
if cmp -s /tmp/new /mnt/new; then pass "a new 1 MiB file reads back"; else fail "a new 1 MiB file differs"; fi
rm -f /mnt/new
umount /mnt || fail "umount /mnt"
if [ "$failed" -ne 0 ]; then
  echo "crash-check: $failed check(s) FAILED"
  exit 1
fi
echo "crash-check: all checks passed"
