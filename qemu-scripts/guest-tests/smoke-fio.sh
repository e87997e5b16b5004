#!/bin/sh
# Runs inside the keelfs test guest (busybox sh): mount keelfs, a few
# namespace operations, then fio data-path jobs with verification.
# Usage: qemu-scripts/run-guest.sh --socket S [--queues N] --script qemu-scripts/guest-tests/smoke-fio.sh
set -eu
tag=${KEELFS_TAG:-keelfs}
step() { echo "=== $*"; }
fail() {
  echo "FAIL: $*"
  echo "--- guest dmesg (tail)"; dmesg | tail -n 20
  exit 1
}
# same_prefix N A B: the first N bytes of A equal all of B; on mismatch print
# where and how much differs.
same_prefix() {
  head -c "$1" "$2" >/tmp/prefix
  cmp -s /tmp/prefix "$3" && return 0
  echo "mismatch between the first $1 bytes of $2 and $3 (size $(stat -c %s "$3")):"
  cmp /tmp/prefix "$3" 2>&1 | head -n 3
  echo "differing bytes: $(cmp -l /tmp/prefix "$3" 2>/dev/null | wc -l)"
  i=0
  while [ $((i * 4096)) -lt "$1" ]; do
    a=$(dd if=/tmp/prefix bs=4096 skip=$i count=1 2>/dev/null | md5sum | cut -c1-8)
    b=$(dd if="$3" bs=4096 skip=$i count=1 2>/tmp/dd.err | md5sum | cut -c1-8)
    [ "$a" = "$b" ] || echo "  4k block $i differs (want $a got $b) $(grep -iv records /tmp/dd.err)"
    i=$((i + 1))
  done
  return 1
}

step "mount -t virtiofs $tag /mnt"
mount -t virtiofs "$tag" /mnt
grep " /mnt " /proc/mounts
df -h /mnt || true
echo "cpus: $(grep -c ^processor /proc/cpuinfo); virtio-fs queues (interrupts):"
grep -E 'hiprio|requests' /proc/interrupts | awk '{print "  " $NF}'

step "namespace ops"
d=/mnt/smoke.$(date +%s).$$
mkdir "$d"
mkdir -p "$d/a/b/c"
echo hello >"$d/a/f1"
echo world >>"$d/a/f1"
[ "$(cat "$d/a/f1")" = "$(printf 'hello\nworld')" ] || fail "content of $d/a/f1: $(cat "$d/a/f1")"
for i in $(seq 1 50); do echo "file $i" >"$d/a/b/n$i"; done
# shellcheck disable=SC2012  # readdir through ls is the point
[ "$(ls "$d/a/b" | wc -l)" -eq 51 ] || fail "ls $d/a/b: $(ls "$d/a/b" | wc -l) entries, want 51"
mv "$d/a/f1" "$d/a/b/c/moved"
[ ! -e "$d/a/f1" ] || fail "$d/a/f1 still there after mv"
[ "$(head -n1 "$d/a/b/c/moved")" = hello ] || fail "moved file content"
mv "$d/a/b/c" "$d/c2"
ln -s ../c2/moved "$d/a/link"
[ "$(readlink "$d/a/link")" = ../c2/moved ] || fail "readlink"
[ "$(tail -n1 "$d/a/link")" = world ] || fail "read through symlink"
ln "$d/c2/moved" "$d/hard"
[ "$(stat -c %h "$d/hard")" -eq 2 ] || fail "hard link count $(stat -c %h "$d/hard")"
dd if=/dev/urandom of=/tmp/rand bs=64k count=16 2>/dev/null
cp /tmp/rand "$d/rand"
sync
echo 3 >/proc/sys/vm/drop_caches
same_prefix 1048576 /tmp/rand "$d/rand" || fail "1 MiB copy differs after drop_caches"
truncate -s 100000 "$d/rand"
[ "$(stat -c %s "$d/rand")" -eq 100000 ] || fail "truncate size"
same_prefix 100000 /tmp/rand "$d/rand" || fail "truncated copy differs"
sync
echo 3 >/proc/sys/vm/drop_caches
same_prefix 100000 /tmp/rand "$d/rand" || fail "truncated copy differs after drop_caches"
ls -la "$d" "$d/a"
rm "$d/a/b/n"*
rm -r "$d/a" "$d/c2"
rm "$d/hard" "$d/rand"
rmdir "$d"
[ ! -e "$d" ] || fail "$d still exists"
echo "namespace ops ok"

cd /root  # fio keeps its verify state files in the cwd
step "fio: O_DIRECT 4k randwrite + crc32c verify (psync)"
fio --eta=never --name=dio --filename=/mnt/fio-dio --size=32m --bs=4k --rw=randwrite \
  --direct=1 --ioengine=psync --verify=crc32c --do_verify=1 --verify_fatal=1 \
  --runtime=60 --time_based=0
step "fio: libaio append, iodepth 32, O_DIRECT + crc32c verify"
fio --eta=never --name=aio --filename=/mnt/fio-aio --size=32m --bs=64k --rw=write \
  --direct=1 --ioengine=libaio --iodepth=32 --verify=crc32c --do_verify=1 \
  --verify_fatal=1
step "fio: buffered 4k randrw, 2 jobs"
fio --eta=never --name=brw --directory=/mnt --size=16m --bs=4k --rw=randrw --rwmixread=50 \
  --ioengine=psync --numjobs=2 --fsync=64 --runtime=20 --time_based=0 \
  --group_reporting
step "fio: buffered write + crc32c verify after drop_caches"
fio --eta=never --name=bwv --filename=/mnt/fio-bwv --size=16m --bs=4k --rw=randwrite \
  --ioengine=psync --verify=crc32c --do_verify=0 --end_fsync=1
sync; echo 3 >/proc/sys/vm/drop_caches
fio --eta=never --name=bwv --filename=/mnt/fio-bwv --size=16m --bs=4k --rw=randwrite \
  --ioengine=psync --verify=crc32c --verify_only=1 --verify_fatal=1
rm -f /mnt/fio-dio /mnt/fio-aio /mnt/fio-bwv /mnt/brw.*
ls -la /mnt
cd /
step "virtio-fs queue interrupts per CPU"
grep -E 'hiprio|requests' /proc/interrupts
step "umount /mnt"
umount /mnt
echo "smoke-fio: all ok"
