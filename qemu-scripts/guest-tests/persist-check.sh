#!/bin/sh
# Guest test (busybox sh): checks that the tree persist-write.sh left in
# /mnt/persist is intact: every regular file's md5 (MANIFEST), and every
# entry's type, mode, owner, size, link count, symlink target, mtime and
# ctime (META), the absence of the names it deleted or renamed away, that the
# sparse file is still sparse, and the xattrs. Both lists are kept on keelfs
# in /mnt/persist-manifest; their exact line counts are fixed here, and when
# the guest has /keelfs/files/persist-expected (run-guest.sh --add; it holds
# the "PERSIST-MANIFEST-MD5=..." line persist-write.sh printed), the lists'
# md5 must match it too.
#
# Usage: run-guest.sh --script persist-check.sh [--add persist-expected]:
#   mounts /mnt when it is not mounted, checks, unmounts. Exits 1 on failure.
# persist-write.sh also calls it as
#   sh persist-check.sh --record   writes MANIFEST and META (no checks)
#   sh persist-check.sh --mounted  checks and leaves /mnt mounted
set -u
tag=${KEELFS_TAG:-keelfs}
tree=/mnt/persist
lists=/mnt/persist-manifest
# What persist-write.sh creates: regular files (MANIFEST lines) and entries
# below $tree (META lines). Change them together with persist-write.sh.
want_files=212
want_entries=221
want_xattrs=2
failed=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; failed=$((failed + 1)); }

# meta: one line per entry below $tree, sorted.
meta() {
  cd "$tree" || return 1
  find . | LC_ALL=C sort | while IFS= read -r p; do
    case "$(stat -c %F "$p")" in
      directory) echo "$p dir $(stat -c '%a %u:%g %h %Y %Z' "$p")" ;;
      "symbolic link") echo "$p symlink $(stat -c '%u:%g %Y %Z' "$p") -> $(readlink "$p")" ;;
      regular*) echo "$p file $(stat -c '%a %u:%g %s %h %Y %Z' "$p")" ;;
      *) echo "$p other $(stat -c '%F %a %u:%g %h %Y %Z' "$p")" ;;
    esac
  done
  cd / || return 1
}
xattrs() {
  cd "$tree" || return 1
  getfattr -d -m '^user\.' -R . 2>/dev/null | grep -v '^$'
  cd / || return 1
}

mode=check
case "${1:-}" in
  --record) mode=record ;;
  --mounted) mode=mounted ;;
  "") ;;
  *) echo "persist-check.sh: unknown argument $1"; exit 2 ;;
esac
grep -q " /mnt virtiofs " /proc/mounts || mount -t virtiofs "$tag" /mnt ||
  { echo "FAIL: mount -t virtiofs $tag /mnt"; exit 1; }

command -v getfattr >/dev/null ||
  { echo "FAIL: no getfattr in the guest (apt-get install attr, then rebuild the guest)"; exit 1; }

if [ "$mode" = record ]; then
  mkdir -p "$lists"
  (cd "$tree" && find . -type f | LC_ALL=C sort | xargs md5sum) >"$lists/MANIFEST"
  meta >"$lists/META"
  xattrs >"$lists/XATTRS"
  sync
  echo "recorded: $(wc -l <"$lists/MANIFEST") files, $(wc -l <"$lists/META") entries"
  echo "PERSIST-MANIFEST-MD5=$(cat "$lists/MANIFEST" "$lists/META" "$lists/XATTRS" | md5sum | cut -d' ' -f1)"
  exit 0
fi

echo "=== persist-check: $tree"
for f in MANIFEST META XATTRS; do
  [ -f "$lists/$f" ] || { fail "$lists/$f missing"; }
done
[ "$failed" -eq 0 ] || exit 1
n=$(wc -l <"$lists/MANIFEST")
if [ "$n" -eq "$want_files" ]; then pass "MANIFEST has $n files"; else fail "MANIFEST has $n lines, want $want_files"; fi
n=$(wc -l <"$lists/META")
if [ "$n" -eq "$want_entries" ]; then pass "META has $n entries"; else fail "META has $n lines, want $want_entries"; fi
n=$(grep -c '^user\.' "$lists/XATTRS")
if [ "$n" -eq "$want_xattrs" ]; then pass "XATTRS has $n values"; else fail "XATTRS has $n values, want $want_xattrs"; fi
if [ -f /keelfs/files/persist-expected ]; then
  # run-e2e.sh always adds it; an empty one (persist-write.sh printed no
  # md5) fails here rather than comparing nothing.
  want=$(sed -n 's/^PERSIST-MANIFEST-MD5=//p' /keelfs/files/persist-expected)
  got=$(cat "$lists/MANIFEST" "$lists/META" "$lists/XATTRS" | md5sum | cut -d' ' -f1)
  if [ -n "$want" ] && [ "$got" = "$want" ]; then pass "lists match the md5 persist-write.sh printed"; else fail "lists md5 $got, persist-write.sh printed '$want'"; fi
fi
if (cd "$tree" && md5sum -c -s "$lists/MANIFEST"); then
  pass "all $(wc -l <"$lists/MANIFEST") files match their md5"
else
  fail "md5 mismatches:"
  (cd "$tree" && md5sum -c "$lists/MANIFEST" 2>&1 | grep -v ': OK$' | head -n 20)
fi
meta >/tmp/META.now
if cmp -s "$lists/META" /tmp/META.now; then
  pass "types, modes, owners, sizes, link counts, targets, mtimes, ctimes match"
else
  fail "metadata differs (- recorded, + now):"
  diff "$lists/META" /tmp/META.now | head -n 40
fi
xattrs >/tmp/XATTRS.now
if cmp -s "$lists/XATTRS" /tmp/XATTRS.now; then
  pass "xattrs match ($(grep -c '^user\.' /tmp/XATTRS.now) values)"
else
  fail "xattrs differ (- recorded, + now):"
  diff "$lists/XATTRS" /tmp/XATTRS.now | head -n 20
fi
for gone in deleted renamed-from a/b/deleted-dir; do
  if [ ! -e "$tree/$gone" ] && [ ! -L "$tree/$gone" ]; then pass "$gone stays gone"; else fail "$tree/$gone exists again"; fi
done
blocks=$(stat -c %b "$tree/sparse")
if [ "$blocks" -lt 2048 ]; then pass "sparse file still sparse ($blocks blocks of 512 for 64 MiB)"; else fail "sparse file has $blocks blocks of 512"; fi

[ "$mode" = mounted ] || umount /mnt || fail "umount /mnt"
if [ "$failed" -ne 0 ]; then
  echo "persist-check: $failed check(s) FAILED"
  exit 1
fi
echo "persist-check: all checks passed"
