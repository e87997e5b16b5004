#!/bin/sh
# Guest test (busybox sh) for a live migration to another QEMU and keelfsd,
# driven from the host by qemu-scripts/migrate.sh. The guest does not know
# when the migration happens; it sets up state that must survive it, prints
# markers the host times the migration by, and checks everything afterwards:
#
#   1. /mnt/migrate/dir with 200 files; two listing loops over it that run
#      until the end: `ls .` from a subshell whose cwd is the directory (an
#      inode the guest holds), and dirloop (qemu-scripts/dirloop.c, in
#      /keelfs/bin) rewinding and reading one directory descriptor the
#      shell holds open (exec 4<dir: one FUSE directory handle); each pass
#      must list 200 entries;
#   2. /mnt/migrate/held: text A written through fd 3 (exec 3<>), and a
#      second descriptor fd 5 (exec 5<) opened at offset 0; and
#      /mnt/migrate/ghost, open as fd 6 and unlinked: only the handle
#      keeps it; a POSIX lock on /mnt/migrate/locked and a flock lock on
#      /mnt/migrate/flocked, each held by a process of its own
#      (fcntl-lock, in /keelfs/bin) until the end;
#   3. two fio files prefilled with crc32c verify headers;
#   4. "KEELFS-MIGRATE-NOW": the host starts the migration here (default),
#      in a quiet period of $quiet s (only the listing loops run);
#   5. "KEELFS-IO-START": fio runs for $runtime s, time_based, 4k random
#      writes with --verify=crc32c (--verify_backlog: written blocks are read
#      back and checked while it runs, and overwrites are tracked): a psync
#      buffered job and a libaio iodepth 8 O_DIRECT job (--serialize_overlap).
#      migrate.sh --during-io starts the migration 5 s after this marker;
#   6. afterwards: fio exited 0 with no error and verified blocks; after
#      drop_caches every block of both files reads back with a valid crc32c
#      header for its offset (a read-verify pass, O_DIRECT and buffered);
#      fd 5 reads text A; text B written through fd 3 is in the file at
#      /mnt/migrate/held (A then B, also after drop_caches), and fd 5 reads B
#      next; fd 6 reads the unlinked file; both locks still keep another
#      process out, and are free once their holders let go (with keelfs,
#      which migrate.sh runs with --locks export, the locks travel in the
#      session's state); both listing loops are still running, stop cleanly and never
#      listed anything but 200 entries; ls lists 200 entries.
# Prints PASS:/FAIL: per check; exits 1 when any failed.
set -u
tag=${KEELFS_TAG:-keelfs}
# Quiet period after KEELFS-MIGRATE-NOW and fio's running time: together
# long enough for a migration under TCG to land inside either.
quiet=15
runtime=45
failed=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; failed=$((failed + 1)); }
drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; }
up() { cut -d' ' -f1 /proc/uptime; }

# check_fio LABEL RC MIN_READ_KB MIN_WRITE_KB OUTPUT: fio exited 0, every job
# reported error 0, no verify error was printed, and it read and wrote at
# least that much (terse v3: field 5 error, 6 read KiB, 47 write KiB).
# Prints fio's per-job summary lines, or its whole output on failure.
check_fio() {
  label=$1 rc=$2 min_r=$3 min_w=$4 out=$5
  # shellcheck disable=SC2046  # four numbers, split on purpose
  set -- $(awk -F';' '/^3;fio-/ { if ($5 != 0) e++; r += $6; w += $47; n++ }
    END { printf "%d %d %d %d\n", n, e, r, w }' "$out")
  why=""
  [ "$rc" -eq 0 ] || why="$why fio exited $rc;"
  [ "$1" -gt 0 ] || why="$why no job results;"
  [ "$2" -eq 0 ] || why="$why $2 job(s) with a nonzero error;"
  if grep -qiE 'verify: bad|verify failed|bad magic|bad header|bad checksum|err= *[1-9]|fio: (io_u error|pid=)' "$out"; then
    why="$why error lines in the output;"
  fi
  [ "$3" -ge "$min_r" ] || why="$why read $3 KiB < $min_r KiB;"
  [ "$4" -ge "$min_w" ] || why="$why wrote $4 KiB < $min_w KiB;"
  if [ -z "$why" ]; then
    grep -E 'err=|^ +(read|write): IOPS' "$out"
    pass "$label (read $3 KiB, wrote $4 KiB)"
  else
    grep -v '^3;fio-' "$out"
    fail "$label:$why"
  fi
}

grep -q " /mnt virtiofs " /proc/mounts || mount -t virtiofs "$tag" /mnt ||
  { echo "FAIL: mount -t virtiofs $tag /mnt"; exit 1; }
command -v dirloop >/dev/null ||
  { echo "FAIL: no dirloop in the guest (migrate.sh adds it: run-guest.sh --add-bin dirloop)"; exit 1; }
d=/mnt/migrate
rm -rf "$d"
mkdir -p "$d/dir" || { echo "FAIL: mkdir $d/dir"; exit 1; }
i=1
while [ $i -le 200 ]; do echo "file $i" >"$d/dir/f$i"; i=$((i + 1)); done
# shellcheck disable=SC2012  # readdir through ls is the point
n=$(ls "$d/dir" | wc -l)
[ "$n" -eq 200 ] || { echo "FAIL: $d/dir lists $n entries after creating 200"; exit 1; }

# The held file: text A through fd 3 (read-write), fd 5 read-only at 0.
text_a="keelfs held file: text A, written through fd 3 before the migration"
text_b="keelfs held file: text B, written through fd 3 after the migration"
exec 3<>"$d/held"
echo "$text_a" >&3
exec 5<"$d/held"
# A file unlinked while open: only the open descriptor keeps it, and the
# migration must carry it (keelfs moves the handle; a peer that re-finds
# files by path cannot, and migrate.sh --peer says so with a file).
text_ghost="keelfs unlinked file, kept only by fd 6 across the migration"
orphan_check=1
[ -e /keelfs/files/peer-cannot-migrate-unlinked ] && orphan_check=0
if [ "$orphan_check" -eq 1 ]; then
  echo "$text_ghost" >"$d/ghost"
  exec 6<"$d/ghost"
  rm "$d/ghost"
fi

# Locks held across the migration, each by a process that lets go when
# its marker is removed.
rm -f "$d/lock-held" "$d/flock-held"
fcntl-lock hold "$d/locked" "$d/lock-held" &
lock_pid=$!
fcntl-lock flock-hold "$d/flocked" "$d/flock-held" &
flock_pid=$!
while [ ! -e "$d/lock-held" ] || [ ! -e "$d/flock-held" ]; do sleep 0.1; done

# Listing loop 1: ls through the cwd (no path lookup of the directory).
rm -f /tmp/stop-ls /tmp/stop-dirloop
(
  cd "$d/dir" || exit 1
  passes=0
  while [ ! -e /tmp/stop-ls ]; do
    # shellcheck disable=SC2012  # readdir through ls is the point (names f1..f200)
    c=$(ls . | wc -l)
    if [ "$c" -ne 200 ]; then
      echo "ls loop: pass $passes listed $c entries, want 200 (uptime $(up))"
      exit 1
    fi
    passes=$((passes + 1))
  done
  echo "ls loop: $passes passes"
) &
ls_pid=$!
# Listing loop 2: one directory descriptor, rewound and read again and again.
exec 4<"$d/dir"
dirloop 4 200 /tmp/stop-dirloop &
dirloop_pid=$!

# fio files with a valid verify header in every 4k block, so that the
# read-verify pass at the end can check all of them.
cd /tmp || exit 1 # fio keeps verify state files in the cwd
fb=$d/fio-buffered fd=$d/fio-direct
rc=0
fio --eta=never --output-format=normal,terse --rw=write --bs=4k --size=16m \
  --verify=crc32c --do_verify=0 --end_fsync=1 --ioengine=psync \
  --name=prefill-buffered --filename="$fb" --name=prefill-direct --filename="$fd" \
  >/tmp/fio-prefill.out 2>&1 || rc=$?
check_fio "prefill 2 x 16 MiB with verify headers" "$rc" 0 32768 /tmp/fio-prefill.out

echo "KEELFS-MIGRATE-NOW (uptime $(up)); quiet for ${quiet}s"
sleep "$quiet"
echo "KEELFS-IO-START (uptime $(up)); fio for ${runtime}s"
rc=0
fio --eta=never --output-format=normal,terse --time_based --runtime="$runtime" \
  --rw=randwrite --bs=4k --size=16m --norandommap=1 --randrepeat=0 \
  --verify=crc32c --verify_fatal=1 --do_verify=1 --verify_backlog=256 \
  --name=psync-buffered --filename="$fb" --ioengine=psync --direct=0 \
  --name=libaio-direct --filename="$fd" --ioengine=libaio --direct=1 --iodepth=8 \
  --serialize_overlap=1 \
  >/tmp/fio-main.out 2>&1 || rc=$?
echo "fio ended (uptime $(up))"
# --verify_backlog reads back written blocks as it goes, not every one.
check_fio "fio ${runtime}s randwrite psync buffered + libaio O_DIRECT, crc32c verify_backlog" \
  "$rc" 1 1 /tmp/fio-main.out

drop_caches
rc=0
fio --eta=never --output-format=normal,terse --rw=read --bs=4k --size=16m \
  --verify=crc32c --verify_fatal=1 --ioengine=psync \
  --name=reverify-buffered --filename="$fb" --direct=0 \
  --name=reverify-direct --filename="$fd" --direct=1 \
  >/tmp/fio-reverify.out 2>&1 || rc=$?
check_fio "read-verify of every block after drop_caches" "$rc" 32768 0 /tmp/fio-reverify.out
cd / || exit 1

# The held descriptors.
drop_caches
got=$(head -n 1 <&5)
if [ "$got" = "$text_a" ]; then
  pass "fd 5 (opened before the migration) reads text A"
else
  fail "fd 5 read '$got', want '$text_a'"
fi
if echo "$text_b" >&3; then
  pass "write through fd 3 (opened before the migration)"
else
  fail "write through fd 3 failed"
fi
want=$(printf '%s\n%s' "$text_a" "$text_b")
got=$(cat "$d/held")
if [ "$got" = "$want" ]; then
  pass "$d/held holds text A then text B (written through fd 3)"
else
  fail "$d/held holds '$got', want '$want'"
fi
drop_caches
got=$(cat "$d/held")
if [ "$got" = "$want" ]; then
  pass "$d/held unchanged after drop_caches"
else
  fail "$d/held holds '$got' after drop_caches, want '$want'"
fi
got=$(head -n 1 <&5)
if [ "$got" = "$text_b" ]; then
  pass "fd 5 reads text B next"
else
  fail "fd 5 read '$got' next, want '$text_b'"
fi

if [ "$orphan_check" -eq 1 ]; then
  drop_caches
  got=$(head -n 1 <&6)
  if [ "$got" = "$text_ghost" ]; then
    pass "fd 6 reads the file unlinked before the migration"
  else
    fail "fd 6 (unlinked before the migration) read '$got', want '$text_ghost'"
  fi
  exec 6<&-
else
  echo "NOTE: --peer $(cat /keelfs/files/peer-cannot-migrate-unlinked) cannot migrate an unlinked open file: not checked"
fi

# The locks taken before the migration: still in force, then free.
st=0
fcntl-lock try "$d/locked" || st=$?
if [ "$st" -eq 1 ]; then pass "the POSIX lock taken before the migration keeps another process out"; else fail "F_SETLK after the migration: exit $st"; fi
st=0
fcntl-lock flock-try "$d/flocked" || st=$?
if [ "$st" -eq 1 ]; then pass "the flock lock taken before the migration keeps another process out"; else fail "flock after the migration: exit $st"; fi
rm -f "$d/lock-held" "$d/flock-held"
if wait "$lock_pid" && wait "$flock_pid"; then pass "the lock holders let go"; else fail "a lock holder failed"; fi
if fcntl-lock try "$d/locked" && fcntl-lock flock-try "$d/flocked"; then
  pass "both locks are free once their holders let go"
else
  fail "a lock outlived its holder"
fi

# The listing loops: still running, then stopped; they fail on a bad pass.
for l in "ls:$ls_pid:/tmp/stop-ls" "dirloop:$dirloop_pid:/tmp/stop-dirloop"; do
  name=${l%%:*} rest=${l#*:}
  pid=${rest%%:*} stop=${rest#*:}
  if kill -0 "$pid" 2>/dev/null; then
    pass "$name loop still running after the migration"
  else
    fail "$name loop ended early"
  fi
  touch "$stop"
  st=0
  wait "$pid" || st=$?
  if [ "$st" -eq 0 ]; then
    pass "$name loop listed 200 entries on every pass"
  else
    fail "$name loop exited $st (see its message above)"
  fi
done
# shellcheck disable=SC2012  # readdir through ls is the point (names f1..f200)
n=$(ls "$d/dir" | wc -l)
if [ "$n" -eq 200 ]; then
  pass "ls $d/dir: 200 entries"
else
  fail "ls $d/dir: $n entries, want 200"
fi

exec 3>&- 4<&- 5<&-
rm -f "$fb" "$fd" || fail "rm of the fio files"
if umount /mnt; then pass "umount /mnt"; else fail "umount /mnt"; fi
if [ "$failed" -eq 0 ]; then
  echo "migrate: all checks passed"
  exit 0
fi
echo "migrate: $failed check(s) failed"
exit 1
