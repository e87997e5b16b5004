#!/bin/sh
# Guest test (busybox sh): multi-process namespace and data stress on keelfs.
# 4 background workers, each for 120 iterations: create a file under a
# temporary name, rename it into place, read it back (cmp); hard-link it into
# a shared directory and rename the link there; append a record to a shared
# O_APPEND log; replace a shared file that all workers race on (rename over);
# create/rename/remove a subdirectory; mkdir/rmdir directories that other
# workers use too; delete older files; re-read older files by md5.
# Then: every worker's exit status, a re-read of every surviving file after
# drop_caches (md5), the exact file counts, and the log's records.
# Prints PASS/FAIL lines; exits 1 when anything failed.
# shellcheck disable=SC2012,SC2010  # readdir through ls is the point
set -u
tag=${KEELFS_TAG:-keelfs}
workers=4
iters=${STRESS_ITERS:-120}
failed=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; failed=$((failed + 1)); }

grep -q " /mnt virtiofs " /proc/mounts || mount -t virtiofs "$tag" /mnt ||
  { echo "FAIL: mount -t virtiofs $tag /mnt"; exit 1; }
base=/mnt/stress
shared=$base/shared
rm -rf "$base"
mkdir -p "$shared" || { echo "FAIL: mkdir $shared"; exit 1; }
: >"$shared/log"
# 4 MiB of random data in the guest's RAM; file contents are slices of it.
dd if=/dev/urandom of=/tmp/pool bs=1M count=4 2>/dev/null

# deleted J: worker files of iteration J are deleted (at iteration J + 2).
deleted() { [ $(($1 % 3)) -eq 0 ] && [ $(($1 + 2)) -lt "$iters" ]; }

# worker K: runs the iterations; exit status = number of errors seen.
worker() {
  k=$1
  own=$base/w$k
  errs=0
  err() { echo "worker $k iteration $i: $*"; errs=$((errs + 1)); }
  mkdir "$own" || { echo "worker $k: mkdir $own failed"; exit 1; }
  : >"/tmp/w$k.sums"
  i=0
  while [ "$i" -lt "$iters" ]; do
    # Content: a slice of the pool, 1 byte to ~200 KiB, different per (k, i).
    size=$(((i * 7919 + k * 104729) % 200000 + 1))
    blk=$(((i * 31 + k * 17) % 900))
    src=/tmp/w$k.src
    dd if=/tmp/pool bs=4096 skip="$blk" count=50 2>/dev/null | head -c "$size" >"$src"
    sum=$(md5sum <"$src" | cut -d' ' -f1)
    echo "$sum  $own/f.$i" >>"/tmp/w$k.sums"
    echo "$sum  $shared/k$k.$i" >>"/tmp/w$k.sums"

    # create + rename into place + read back
    cp "$src" "$own/.tmp.$i" || err "cp to $own/.tmp.$i"
    mv "$own/.tmp.$i" "$own/f.$i" || err "rename .tmp.$i -> f.$i"
    cmp -s "$src" "$own/f.$i" || err "content of $own/f.$i differs right after writing"
    # hard link into the shared directory, then rename the link there
    ln "$own/f.$i" "$shared/k$k.$i.new" || err "link into $shared"
    [ "$(stat -c %h "$own/f.$i")" = 2 ] || err "link count of $own/f.$i: $(stat -c %h "$own/f.$i")"
    mv "$shared/k$k.$i.new" "$shared/k$k.$i" || err "rename in $shared"
    # O_APPEND record in the shared log
    echo "rec $k $i" >>"$shared/log" || err "append to log"
    # rename over a shared name that all workers replace
    # shellcheck disable=SC2015  # err when either step fails
    cp "$src" "$shared/.latest.$k" && mv "$shared/.latest.$k" "$shared/latest" || err "replace $shared/latest"
    echo "$sum" >>"/tmp/latest.sums.$k"
    # a subdirectory: create, fill, rename, read, remove
    # shellcheck disable=SC2015  # any step failing is one error: the || covers the whole chain
    mkdir "$own/sub.$i" && echo "$k $i" >"$own/sub.$i/x" &&
      mv "$own/sub.$i" "$own/subr.$i" || err "subdirectory create/rename"
    [ "$(cat "$own/subr.$i/x" 2>/dev/null)" = "$k $i" ] || err "file in renamed subdirectory"
    rm -r "$own/subr.$i" || err "rm -r subdirectory"
    # directories shared with the other workers: mkdir may race (EEXIST)
    # and rmdir may find other workers' files (ENOTEMPTY)
    sd=$shared/d.$((i % 3))
    mkdir "$sd" 2>/dev/null
    # (the create fails when another worker removed the directory after
    # the mkdir; the file, once created, is only removed here)
    if echo "$k" 2>/dev/null >"$sd/k$k"; then
      rm "$sd/k$k" || err "rm $sd/k$k"
    fi
    rmdir "$sd" 2>/dev/null
    # delete the files of iteration i - 2 when it is a multiple of 3
    j=$((i - 2))
    if [ $j -ge 0 ] && deleted $j; then
      rm "$own/f.$j" "$shared/k$k.$j" || err "rm of iteration $j files"
    fi
    # re-read the file of iteration i - 1 (when it survives)
    j=$((i - 1))
    if [ $j -ge 0 ] && ! deleted $j; then
      want=$(grep " $own/f.$j\$" "/tmp/w$k.sums" | cut -d' ' -f1)
      got=$(md5sum <"$own/f.$j" | cut -d' ' -f1)
      [ "$got" = "$want" ] || err "re-read of $own/f.$j: md5 $got, want $want"
    fi
    i=$((i + 1))
  done
  exit $((errs > 100 ? 100 : errs))
}

echo "=== $workers workers x $iters iterations"
t0=$(date +%s)
pids=""
k=1
while [ $k -le $workers ]; do
  worker $k >"/tmp/w$k.log" 2>&1 &
  pids="$pids $!"
  k=$((k + 1))
done
k=1
for p in $pids; do
  st=0
  wait "$p" || st=$?
  cat /tmp/w$k.log
  if [ "$st" -eq 0 ]; then pass "worker $k exited 0"; else fail "worker $k exited $st"; fi
  k=$((k + 1))
done
echo "workers took $(($(date +%s) - t0)) s"

echo "=== consistency after drop_caches"
sync
echo 3 >/proc/sys/vm/drop_caches
survivors=0
j=0
while [ $j -lt "$iters" ]; do deleted $j || survivors=$((survivors + 1)); j=$((j + 1)); done
k=1
while [ $k -le $workers ]; do
  n=$(ls "$base/w$k" | wc -l)
  if [ "$n" -eq "$survivors" ]; then pass "w$k holds $n files"; else fail "w$k holds $n files, want $survivors: $(ls "$base/w$k" | tr '\n' ' ')"; fi
  # only the surviving files' sums
  j=0
  while [ $j -lt "$iters" ]; do
    deleted $j || grep -E " ($base/w$k/f|$shared/k$k)\\.$j\$" /tmp/w$k.sums
    j=$((j + 1))
  done >/tmp/w$k.alive
  if md5sum -c -s /tmp/w$k.alive; then
    pass "worker $k: $(wc -l </tmp/w$k.alive) surviving files (own + shared) match their md5"
  else
    fail "worker $k: md5 mismatches:"; md5sum -c /tmp/w$k.alive 2>&1 | grep -v ': OK$' | head -n 20
  fi
  k=$((k + 1))
done
n=$(ls "$shared" | grep -c '^k[0-9]*\.[0-9]*$')
want=$((workers * survivors))
if [ "$n" -eq "$want" ]; then pass "shared holds $n linked files"; else fail "shared holds $n linked files, want $want"; fi
left=$(ls -a "$shared" | grep -vE '^(\.|\.\.|log|latest|k[0-9]+\.[0-9]+|d\.[0-2])$' | tr '\n' ' ')
if [ -z "$left" ]; then pass "no stray names in shared"; else fail "stray names in shared: $left"; fi
for sd in "$shared"/d.*; do
  [ -d "$sd" ] || continue
  if [ "$(ls -A "$sd" | wc -l)" -eq 0 ] && rmdir "$sd"; then pass "leftover $sd is empty and removable"; else fail "leftover $sd: $(ls -A "$sd")"; fi
done
got=$(md5sum <"$shared/latest" | cut -d' ' -f1)
if cat /tmp/latest.sums.* | grep -qx "$got"; then pass "shared/latest is one worker's complete file"; else fail "shared/latest (md5 $got) matches no file a worker wrote"; fi
lines=$(wc -l <"$shared/log")
recs=$(grep -c '^rec [0-9]* [0-9]*$' "$shared/log")
dups=$(sort "$shared/log" | uniq -d | wc -l)
if [ "$lines" -eq $((workers * iters)) ] && [ "$recs" -eq "$lines" ] && [ "$dups" -eq 0 ]; then
  pass "O_APPEND log: $lines whole, distinct records"
else
  fail "O_APPEND log: $lines lines, $recs well-formed, $dups duplicated; want $((workers * iters)) distinct records"
  grep -v '^rec [0-9]* [0-9]*$' "$shared/log" | head -n 5 | od -c | head -n 10
fi

echo "=== virtio-fs request queues (interrupts per CPU)"
grep -E 'hiprio|requests' /proc/interrupts
# With several request queues (run-guest.sh --queues N) the workers on
# different CPUs use different queues: each must have completed requests.
# shellcheck disable=SC2013  # one queue per line
for q in $(grep -oE 'requests\.[0-9]+' /proc/interrupts); do
  n=$(grep -E "$q\$" /proc/interrupts | awk '{ s = 0; for (i = 2; i <= NF; i++) if ($i ~ /^[0-9]+$/) s += $i; print s }')
  if [ "${n:-0}" -gt 0 ]; then pass "queue $q: $n interrupts"; else fail "queue $q: no interrupts"; fi
done

echo "=== cleanup"
if rm -r "$base" && [ ! -e "$base" ]; then pass "rm -r $base"; else fail "rm -r $base"; fi
umount /mnt || fail "umount /mnt"
if [ "$failed" -ne 0 ]; then
  echo "stress: $failed check(s) FAILED"
  exit 1
fi
echo "stress: all checks passed"
