#!/bin/sh
# Guest test (busybox sh): fio with crc32c data verification on keelfs's three
# seed data paths, scaled for TCG:
#   w1  O_DIRECT 4k random overwrites of preallocated files (psync, and
#       libaio at iodepth 8), then a buffered re-verify after drop_caches;
#   w2  O_DIRECT appends with libaio at iodepth 32 onto a new file (it grows),
#       twice (from 0, then from the end of the first pass);
#   w3  buffered 8k random I/O from 2 jobs on one shared file: verified
#       random writes to each job's own range, a re-verify after drop_caches,
#       then the seed's concurrent randread + randwrite mix (checked for
#       errors; overlapping writers cannot be verified).
# Each fio run must exit 0, report err=0 for every job, print no verify
# error, and (for verified runs) have read back at least what it wrote.
# Prints PASS/FAIL per run; exits 1 when any failed.
# shellcheck disable=SC2086  # $v and $w3 hold several fio options
set -u
tag=${KEELFS_TAG:-keelfs}
failed=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; failed=$((failed + 1)); }
drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; }

# run_fio LABEL MIN_READ_KB MIN_WRITE_KB FIO-ARGS...: runs fio and checks it.
run_fio() {
  label=$1 min_r=$2 min_w=$3
  shift 3
  echo "=== $label"
  echo "fio $*"
  rc=0
  fio --eta=never --output-format=normal,terse "$@" >/tmp/fio.out 2>&1 || rc=$?
  grep -v '^3;fio-' /tmp/fio.out
  # Terse v3: 5 error, 6 read KiB, 8 read IOPS, 47 write KiB, 49 write IOPS.
  # shellcheck disable=SC2046  # six numbers, split on purpose
  set -- $(awk -F';' '/^3;fio-/ { if ($5 != 0) e++; r += $6; w += $47; ri += $8; wi += $49; n++ }
    END { printf "%d %d %d %d %d %d\n", n, e, r, w, ri, wi }' /tmp/fio.out)
  jobs=$1 errs=$2 rkb=$3 wkb=$4 riops=$5 wiops=$6
  why=""
  [ "$rc" -eq 0 ] || why="$why fio exited $rc;"
  [ "$jobs" -gt 0 ] || why="$why no job results;"
  [ "$errs" -eq 0 ] || why="$why $errs job(s) with a nonzero error;"
  if grep -qiE 'verify: bad|verify failed|bad magic|bad header|bad checksum|err= *[1-9]|fio: (io_u error|pid=)' /tmp/fio.out; then
    why="$why error lines in the output;"
    grep -iE 'verify|bad magic|bad header|err=|io_u error|fio: pid=' /tmp/fio.out | grep -v '^3;fio-' | head -n 20
  fi
  [ "$rkb" -ge "$min_r" ] || why="$why read ${rkb} KiB < ${min_r} KiB (verification did not run in full);"
  [ "$wkb" -ge "$min_w" ] || why="$why wrote ${wkb} KiB < ${min_w} KiB;"
  if [ -z "$why" ]; then
    pass "$label (read ${rkb} KiB at ${riops} IOPS, wrote ${wkb} KiB at ${wiops} IOPS)"
  else
    fail "$label:$why"
  fi
}

grep -q " /mnt virtiofs " /proc/mounts || mount -t virtiofs "$tag" /mnt ||
  { echo "FAIL: mount -t virtiofs $tag /mnt"; exit 1; }
d=/mnt/fio-seeds
rm -rf "$d"
mkdir -p "$d"
cd /tmp || exit 1 # fio keeps verify state files in the cwd
v="--verify=crc32c --verify_fatal=1"

# --------------------------------------------------------------------- w1 --
# Two preallocated 16 MiB files, written in full first (sequential 1 MiB).
for j in 0 1; do
  run_fio "w1 prefill file $j" 0 16384 --name=prefill --filename="$d/w1.$j" \
    --rw=write --bs=1m --size=16m --end_fsync=1
done
# 4k random overwrites, O_DIRECT, psync, 2 jobs (one file each), then the
# jobs read back and check every block they wrote.
run_fio "w1 O_DIRECT 4k randwrite psync x2 + verify" 32768 32768 \
  --name=w1 --filename_format="$d/w1.\$jobnum" --numjobs=2 --size=16m \
  --rw=randwrite --bs=4k --direct=1 --ioengine=psync $v --do_verify=1
# The same blocks, read back buffered after dropping the guest's caches
# (same seed, same offsets: verify_only replays the write pattern).
drop_caches
run_fio "w1 buffered re-verify of the O_DIRECT writes" 32768 0 \
  --name=w1 --filename_format="$d/w1.\$jobnum" --numjobs=2 --size=16m \
  --rw=randwrite --bs=4k --direct=0 --ioengine=psync $v --verify_only=1
run_fio "w1 O_DIRECT 4k randwrite libaio iodepth 8 + verify" 16384 16384 \
  --name=w1aio --filename="$d/w1.0" --size=16m \
  --rw=randwrite --bs=4k --direct=1 --ioengine=libaio --iodepth=8 $v --do_verify=1
# ... and the seed's mix as such: random 4k reads and writes over both files
# from 2 jobs (no verify: the jobs overwrite each other's blocks).
run_fio "w1 O_DIRECT 4k randrw psync x2, 2 files (seed mix)" 1 1 \
  --name=w1mix --filename="$d/w1.0:$d/w1.1" --file_service_type=random \
  --numjobs=2 --size=32m --io_size=8m --norandommap=1 \
  --rw=randrw --bs=4k --direct=1 --ioengine=psync --group_reporting=1

# --------------------------------------------------------------------- w2 --
# Appends with libaio at iodepth 32 onto a new file, O_DIRECT; the job reads
# back and verifies what it appended. A second pass appends after the first.
run_fio "w2 O_DIRECT libaio iodepth 32 append + verify (new file)" 16384 16384 \
  --name=w2 --filename="$d/w2" --size=16m --rw=write --bs=4k --ioengine=libaio \
  --iodepth=32 --direct=1 --fallocate=none --file_append=1 $v --do_verify=1
size=$(stat -c %s "$d/w2")
if [ "$size" -eq 16777216 ]; then pass "w2 file grew to 16 MiB"; else fail "w2 file size $size, want 16777216"; fi
run_fio "w2 O_DIRECT libaio iodepth 32 append + verify (second pass)" 16384 16384 \
  --name=w2 --filename="$d/w2" --size=16m --rw=write --bs=4k --ioengine=libaio \
  --iodepth=32 --direct=1 --fallocate=none --file_append=1 $v --do_verify=1
size=$(stat -c %s "$d/w2")
if [ "$size" -eq 33554432 ]; then pass "w2 file grew to 32 MiB"; else fail "w2 file size $size, want 33554432"; fi

# --------------------------------------------------------------------- w3 --
# Buffered 8k random writes from 2 jobs on one shared file, each job on its
# own 8 MiB range, verified by the jobs; then re-verified after drop_caches.
w3="--name=w3 --filename=$d/w3 --numjobs=2 --size=8m --offset_increment=8m \
  --rw=randwrite --bs=8k --ioengine=psync --direct=0 $v"
# A sparse 16 MiB file first, so that neither job lays the file out.
truncate -s 16m "$d/w3"
run_fio "w3 buffered 8k randwrite x2, shared file + verify" 16384 16384 \
  $w3 --do_verify=1 --fsync_on_close=1
drop_caches
run_fio "w3 re-verify after drop_caches" 16384 0 $w3 --verify_only=1
# The seed's concurrent mix on the same file: one randread job, one
# randwrite job, 8k buffered.
run_fio "w3 buffered 8k randread + randwrite jobs on one file (seed mix)" 1 1 \
  --filename="$d/w3" --size=16m --bs=8k --ioengine=psync --direct=0 \
  --norandommap=1 --randrepeat=0 --io_size=8m --group_reporting=1 \
  --name=read --rw=randread --name=write --rw=randwrite

cd / || exit 1
rm -rf "$d"
umount /mnt || fail "umount /mnt"
if [ "$failed" -ne 0 ]; then
  echo "fio-seeds: $failed run(s) FAILED"
  exit 1
fi
echo "fio-seeds: all runs passed"
