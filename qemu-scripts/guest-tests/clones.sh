#!/bin/sh
# Guest test (busybox sh) for clones and snapshots (issue 37), driven
# from the host by qemu-scripts/clones.sh:
#
#   1. fio writes /mnt/a (128 MiB, crc32c verify headers); GNU cp (9.1,
#      /usr/bin/cp: its copy_file_range reaches keelfs as
#      FUSE_COPY_FILE_RANGE) copies it to /mnt/b, which must take under
#      4 MiB of the filesystem (df), and compare equal;
#   2. fio verifies both copies; random direct writes to b, then a's
#      original contents verify; random direct writes to a, then b's own
#      writes verify: neither copy's writes reach the other;
#   3. /mnt/s gets 20 files of random sizes; their md5 list is printed
#      ("KEELFS-MD5 SUM NAME") before "KEELFS-SNAP-READY", and the host
#      takes a snapshot meanwhile; after a pause every file is rewritten
#      and a third removed, synced, and "KEELFS-REWRITTEN" printed: the
#      host serves the snapshot and checks its md5 list against the first.
# Prints PASS:/FAIL: per check; exits 1 when any failed.
set -u
tag=${KEELFS_TAG:-keelfs}
failed=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; failed=1; }

mount -t virtiofs "$tag" /mnt || { echo "FAIL: mount -t virtiofs $tag /mnt"; exit 1; }
cd /root || exit 1 # fio keeps its verify state in the cwd
used_kib() { df -k /mnt | awk 'NR == 2 {print $3}'; }
# One job definition per file: verify_only replays it to check the data.
whole() {
  name=$1
  shift
  fio --eta=never --name="$name" --filename="/mnt/$name" --size=128m --bs=64k --rw=write --direct=1 \
    --verify=crc32c --verify_fatal=1 "$@" --output="/tmp/fio-$name.out"
}
scattered() {
  fio --eta=never --name="r$1" --filename="/mnt/$1" --size=128m --bs=4k --rw=randwrite --direct=1 \
    --number_ios=3000 --randseed="$2" --verify=crc32c --verify_fatal=1 "$3" --output="/tmp/fio-r$1.out"
}

if whole a --do_verify=1; then pass "fio wrote and verified /mnt/a"; else fail "fio writing /mnt/a: $(grep -i err /tmp/fio-a.out | head -n 2)"; fi
sync
before=$(used_kib)
if /usr/bin/cp /mnt/a /mnt/b; then
  sync
  added=$(($(used_kib) - before))
  if [ "$added" -lt 4096 ]; then
    pass "cp of a 128 MiB file took ${added} KiB of the filesystem (its blocks are shared)"
  else
    fail "cp of a 128 MiB file took ${added} KiB of the filesystem"
  fi
else
  fail "/usr/bin/cp /mnt/a /mnt/b"
fi
if cmp /mnt/a /mnt/b; then pass "the copy compares equal"; else fail "the copy differs"; fi
for f in a b; do
  if whole "$f" --verify_only >/dev/null 2>&1; then pass "fio verifies /mnt/$f"; else fail "fio verify of /mnt/$f"; fi
done
if scattered b 11 --do_verify=1; then pass "random writes to b verified"; else fail "random writes to b"; fi
if whole a --verify_only >/dev/null 2>&1; then pass "a is as written after b's writes"; else fail "b's writes reached a"; fi
if scattered a 22 --do_verify=1; then pass "random writes to a verified"; else fail "random writes to a"; fi
if scattered b 11 --verify_only >/dev/null 2>&1; then pass "b keeps its own writes after a's"; else fail "a's writes reached b"; fi
rm -f /mnt/a /mnt/b

mkdir -p /mnt/s
i=0
while [ $i -lt 20 ]; do
  dd if=/dev/urandom of=/mnt/s/f$i bs=1k count=$((i * 37 + 5)) 2>/dev/null
  i=$((i + 1))
done
sync
(cd /mnt/s && md5sum f*) | sed 's/^/KEELFS-MD5 /'
echo "KEELFS-SNAP-READY"
# The host takes the snapshot now (it needs a moment; TCG is slow).
sleep 20
i=0
while [ $i -lt 20 ]; do
  if [ $((i % 3)) -eq 0 ]; then
    rm -f /mnt/s/f$i
  else
    dd if=/dev/urandom of=/mnt/s/f$i bs=1k count=$((i * 41 + 7)) conv=notrunc 2>/dev/null
  fi
  i=$((i + 1))
done
sync
(cd /mnt/s && md5sum f*) | sed 's/^/KEELFS-NOW /'
echo "KEELFS-REWRITTEN"
# The host reads the snapshot meanwhile.
sleep 20
umount /mnt
exit $failed
