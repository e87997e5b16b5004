#!/bin/sh
# Guest test (busybox sh): keelfs's userspace NVMe driver (devices named
# nvme:PCI) on the emulated controller that run-guest.sh --nvme adds behind
# a vIOMMU. Run by qemu-scripts/run-nvme.sh, which puts keelfsd,
# keelfs-bench and scripts/nvme-setup.sh on the guest's PATH (/keelfs/bin).
#   bind           nvme-setup.sh bind PCI --hugepages 32: vfio-pci, /dev/vfio/N
#   bdev-check     keelfs-bench bdev-check --path nvme:PCI --json exits 0
#   mkfs, fsck-new keelfsd mkfs / fsck nvme:PCI exit 0
#   serve          keelfsd serve --device nvme:PCI --fuse-mount /mnt/k
#                  --socket /tmp/k.sock --rpc /tmp/k.rpc mounts /mnt/k
#   fsx-buffered, fsx-odirect  fsx on /mnt/k (O_DIRECT through the
#                  LD_PRELOAD shim /usr/lib/fsx-odirect.so)
#   pattern-write  an 8 MiB + 12345 byte random file, read back after
#                  drop_caches
#   serve-stop     SIGTERM: keelfsd exits 0 within 60 s and /mnt/k is gone
#   fsck-served    keelfsd fsck nvme:PCI exits 0
#   serve-again, pattern-survived, serve-stop-again, fsck-final: the file's
#                  md5 after a restart, then SIGTERM and fsck again
#   bench-nvme-randread, bench-nvme-randwrite  keelfs-bench bdev --backend
#                  nvme (5 s, 4k, iodepth 32, 256M) exits 0 with JSON
#   unbind         nvme-setup.sh unbind PCI: the kernel's nvme driver has it
#                  back (/dev/nvme0n1)
#   bench-uring-randread, bench-uring-randwrite  the same benches with
#                  --backend uring on that block device
# Each check prints "PASS: NAME: ..." or "FAIL: NAME: ..." (NAME as above);
# bench results are printed as "BENCH-JSON {...}" lines. No speed
# thresholds. Exits 1 when any check failed.
# The PCI address comes from $KEELFS_NVME (kernel command line
# keelfs.nvme=), else /keelfs/nvme-pci, else 0000:00:05.0; fsx's op count
# from keelfs.fsx_ops= (default 3000).
# shellcheck disable=SC2013,SC2012  # words of /proc/cmdline; ls for people
set -u

pci=${KEELFS_NVME:-}
[ -n "$pci" ] || pci=$(cat /keelfs/nvme-pci 2>/dev/null) || true
[ -n "$pci" ] || pci=0000:00:05.0
dev=nvme:$pci
mnt=/mnt/k
ops=3000
for arg in $(cat /proc/cmdline); do
  case "$arg" in keelfs.fsx_ops=*) ops=${arg#keelfs.fsx_ops=} ;; esac
done
passed=0
failed=0
serve_pid=""
serve_log=""
dmesg_at=$(dmesg | wc -l)

pass() { echo "PASS: $*"; passed=$((passed + 1)); }
# fail MSG [LOG]: a FAIL line, LOG's tail and the kernel's last words.
fail() {
  echo "FAIL: $1"
  failed=$((failed + 1))
  if [ -n "${2:-}" ] && [ -s "$2" ]; then
    echo "--- $2 (tail)"
    tail -n 40 "$2" | sed 's/^/  | /'
  fi
  echo "--- guest dmesg since the test started (tail)"
  dmesg | tail -n +$((dmesg_at + 1)) | tail -n 25 >/tmp/dmesg.new
  if [ -s /tmp/dmesg.new ]; then sed 's/^/  | /' /tmp/dmesg.new; else echo "  | (none)"; fi
}
finish() {
  if [ -n "$serve_pid" ] && alive "$serve_pid"; then
    kill -KILL "$serve_pid" 2>/dev/null
  fi
  echo "=== nvme: $passed passed, $failed failed"
  if [ "$failed" -ne 0 ] || [ "$passed" -eq 0 ]; then
    echo "nvme: $failed check(s) FAILED"
    exit 1
  fi
  echo "nvme: all checks passed"
  exit 0
}
# alive PID: running, not a zombie (ash reaps children only in wait).
alive() {
  _st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1)
  [ -n "$_st" ] && [ "$_st" != Z ]
}
# run SECS LOG CMD...: CMD with its output in LOG (and on the console, each
# line indented), killed with SIGTERM after SECS; its exit status
# (143: timed out).
run() {
  _secs=$1 _log=$2
  shift 2
  echo "\$ $*"
  _rc=0
  timeout "$_secs" "$@" >"$_log" 2>&1 || _rc=$?
  sed 's/^/  /' "$_log"
  [ "$_rc" -ne 143 ] || echo "  (killed after ${_secs} s)"
  return "$_rc"
}
mounted() { grep -q " $mnt fuse" /proc/mounts; }

# start_serve NAME: keelfsd serve in the background; waits for the mount.
start_serve() {
  name=$1
  serve_log=/tmp/serve-$name.log
  rm -f /tmp/k.sock /tmp/k.rpc
  mkdir -p "$mnt"
  echo "\$ keelfsd serve --device $dev --fuse-mount $mnt --socket /tmp/k.sock --rpc /tmp/k.rpc &"
  keelfsd serve --device "$dev" --fuse-mount "$mnt" --socket /tmp/k.sock --rpc /tmp/k.rpc \
    >"$serve_log" 2>&1 </dev/null &
  serve_pid=$!
  t0=$(date +%s)
  while [ $(($(date +%s) - t0)) -lt 120 ]; do
    if mounted; then
      pass "$name: keelfsd (pid $serve_pid) mounted $dev on $mnt in $(($(date +%s) - t0)) s"
      grep " $mnt " /proc/mounts | sed 's/^/  /'
      return 0
    fi
    alive "$serve_pid" || break
    sleep 0.2
  done
  if alive "$serve_pid"; then
    kill -KILL "$serve_pid" 2>/dev/null
    wait "$serve_pid" 2>/dev/null
    fail "$name: keelfsd did not mount $mnt within 120 s (killed)" "$serve_log"
  else
    st=0
    wait "$serve_pid" || st=$?
    fail "$name: keelfsd exited with status $st before mounting $mnt" "$serve_log"
  fi
  serve_pid=""
  return 1
}

# stop_serve NAME: SIGTERM; keelfsd must exit 0 within 60 s and unmount.
stop_serve() {
  name=$1
  cd / || exit 1
  if [ -z "$serve_pid" ]; then
    fail "$name: keelfsd was not running"
    return 1
  fi
  t0=$(date +%s)
  kill -TERM "$serve_pid"
  # A watchdog, since wait has no timeout.
  (sleep 60 && kill -KILL "$serve_pid" 2>/dev/null) &
  dog=$!
  st=0
  wait "$serve_pid" || st=$?
  kill "$dog" 2>/dev/null
  serve_pid=""
  dt=$(($(date +%s) - t0))
  if mounted; then
    umount -l "$mnt" 2>/dev/null
    fail "$name: $mnt still mounted after keelfsd exited (status $st)" "$serve_log"
    return 1
  fi
  if [ "$st" -eq 0 ]; then
    pass "$name: keelfsd exited 0 after SIGTERM in $dt s"
    sed 's/^/  | /' "$serve_log" | tail -n 5
  elif [ "$st" -eq 137 ]; then
    fail "$name: keelfsd still running 60 s after SIGTERM (killed)" "$serve_log"
  else
    fail "$name: keelfsd exited $st after SIGTERM" "$serve_log"
  fi
}

# fsck NAME
fsck_dev() {
  if run 300 "/tmp/$1.log" keelfsd fsck "$dev"; then
    pass "$1: keelfsd fsck $dev exited 0"
  else
    fail "$1: keelfsd fsck $dev exited $_rc" "/tmp/$1.log"
  fi
}

# run_fsx NAME CONFIG SEED [ENV=VALUE...]
run_fsx() {
  name=$1 conf=$2 seed=$3
  shift 3
  f=$mnt/fsx/$name.file
  mkdir -p "$mnt/fsx" /tmp/fsx-artifacts
  echo "\$ $* fsx -f $conf -N $ops -S $seed -P /tmp/fsx-artifacts $f"
  t0=$(date +%s)
  rc=0
  timeout 600 env "$@" fsx -f "$conf" -N "$ops" -S "$seed" -P /tmp/fsx-artifacts "$f" >/tmp/fsx.out 2>&1 || rc=$?
  # On failure fsx prints its last operations: show the newest ones.
  grep -v '^\[ERROR fsx\] *[0-9][0-9]* [A-Z]' /tmp/fsx.out | sed 's/^/  /'
  grep '^\[ERROR fsx\] *[0-9][0-9]* [A-Z]' /tmp/fsx.out | tail -n 30
  if [ "$rc" -eq 0 ] && grep -q "All operations completed A-OK!" /tmp/fsx.out; then
    pass "$name: $ops ops, seed $seed ($(($(date +%s) - t0)) s)"
    return 0
  fi
  for a in /tmp/fsx-artifacts/*.fsxlog; do
    [ -f "$a" ] && { echo "--- $a (tail)"; tail -n 30 "$a"; }
  done
  fail "$name: fsx exited $rc, seed $seed (replay: same config, -N $ops -S $seed)" "$serve_log"
  return 1
}

# bench NAME ARGS...: keelfs-bench bdev ARGS --json; its JSON lines are
# printed as "BENCH-JSON <line>".
bench() {
  name=$1
  shift
  rc=0
  run 180 "/tmp/$name.log" keelfs-bench bdev "$@" --json || rc=$?
  n=0
  while IFS= read -r line; do
    case "$line" in
      "{"*) echo "BENCH-JSON $line"; n=$((n + 1)) ;;
    esac
  done <"/tmp/$name.log"
  if [ "$rc" -eq 0 ] && [ "$n" -gt 0 ]; then
    pass "$name: $n JSON line(s)"
  elif [ "$rc" -eq 0 ]; then
    fail "$name: exit 0 but no JSON line" "/tmp/$name.log"
  else
    fail "$name: keelfs-bench bdev exited $rc" "/tmp/$name.log"
  fi
}

echo "=== keelfs NVMe guest test: controller $pci ($dev), fsx $ops ops"
for t in keelfsd keelfs-bench nvme-setup.sh; do
  command -v "$t" >/dev/null || { fail "setup: $t is not on PATH ($PATH)"; finish; }
done
nvme-setup.sh status "$pci"

# ------------------------------------------------------------------ a --
echo "=== a. bind $pci to vfio-pci"
grp=$(nvme-setup.sh bind "$pci" --hugepages 32 2>/tmp/bind.err)
rc=$?
sed 's/^/  /' /tmp/bind.err
if [ "$rc" -eq 0 ] && [ -c "$grp" ]; then
  pass "bind: $pci on vfio-pci, group $grp"
  ls -l /dev/vfio | sed 's/^/  /'
else
  fail "bind: nvme-setup.sh bind $pci --hugepages 32 exited $rc (group '${grp:-}')"
  nvme-setup.sh status "$pci"
  finish
fi

# ------------------------------------------------------------------ b --
echo "=== b. keelfs-bench bdev-check"
if run 300 /tmp/bdev-check.log keelfs-bench bdev-check --path "$dev" --json; then
  pass "bdev-check: keelfs-bench bdev-check --path $dev --json exited 0"
else
  fail "bdev-check: keelfs-bench bdev-check --path $dev --json exited $_rc"
fi

# ------------------------------------------------------------------ c --
echo "=== c. mkfs + fsck"
if run 300 /tmp/mkfs.log keelfsd mkfs "$dev"; then
  pass "mkfs: keelfsd mkfs $dev exited 0"
else
  fail "mkfs: keelfsd mkfs $dev exited $_rc"
fi
fsck_dev fsck-new

# ------------------------------------------------------------------ d --
echo "=== d. serve on $mnt: fsx, a file across a restart"
if start_serve serve; then
  # fsx.sh's buffered and O_DIRECT configs, baked into the guest.
  cp /usr/share/keelfs/fsx/buffered.toml /usr/share/keelfs/fsx/odirect.toml /tmp/
  if ! command -v fsx >/dev/null; then
    fail "fsx-buffered: no fsx in the guest (cargo install fsx, then qemu-scripts/build-guest.sh)"
    fail "fsx-odirect: no fsx in the guest"
  else
    run_fsx fsx-buffered /tmp/buffered.toml 11
    if [ -f /usr/lib/fsx-odirect.so ]; then
      if run_fsx fsx-odirect /tmp/odirect.toml 33 \
        FSX_ODIRECT_PATH="$mnt/fsx/fsx-odirect.file" LD_PRELOAD=/usr/lib/fsx-odirect.so; then
        n=$(sed -n 's/^fsx-odirect: \([0-9]*\) open.*/\1/p' /tmp/fsx.out)
        [ "${n:-0}" -gt 0 ] || fail "fsx-odirect: the O_DIRECT shim changed no open"
      fi
    else
      echo "SKIP: fsx-odirect: /usr/lib/fsx-odirect.so missing (build-guest.sh builds it when cc is installed)"
    fi
    rm -rf "$mnt/fsx"
  fi

  dd if=/dev/urandom of=/tmp/pattern bs=1M count=8 2>/dev/null
  head -c 12345 /dev/urandom >>/tmp/pattern
  want=$(md5sum </tmp/pattern | cut -d' ' -f1)
  if cp /tmp/pattern "$mnt/pattern" && sync && echo 3 >/proc/sys/vm/drop_caches &&
    cmp -s /tmp/pattern "$mnt/pattern"; then
    pass "pattern-write: $mnt/pattern, $(stat -c %s "$mnt/pattern") bytes, md5 $want"
  else
    fail "pattern-write: writing or reading back $mnt/pattern failed" "$serve_log"
  fi
  stop_serve serve-stop
  fsck_dev fsck-served

  if start_serve serve-again; then
    got=$(md5sum <"$mnt/pattern" 2>/tmp/md5.err | cut -d' ' -f1)
    if [ "$got" = "$want" ]; then
      pass "pattern-survived: md5 $got after the restart"
    else
      fail "pattern-survived: md5 '$got', want $want ($(cat /tmp/md5.err))" "$serve_log"
    fi
    # Guest memory straight to the controller: keelfs-bench acts as a VMM on
    # keelfsd's vhost-user socket; keelfsd maps that memory into the IOMMU
    # and direct I/O moves between it and the device with no copy.
    if run 120 /tmp/vhost-dma.out keelfs-bench vhost --socket /tmp/k.sock --workload dio-randrw \
      --seconds 3 --file-size 64M --json; then
      if grep -q "NVMe: [1-9][0-9]* guest memory region(s), .* mapped for DMA" "$serve_log"; then
        grep "guest memory region(s)" "$serve_log" | head -n 3 | sed 's/^/  /'
        pass "vhost-dma: direct I/O from vhost-user guest memory, mapped into the IOMMU"
      else
        fail "vhost-dma: keelfsd never mapped the frontend's memory for DMA" "$serve_log"
      fi
    else
      fail "vhost-dma: keelfs-bench vhost failed" "$serve_log"
    fi
    stop_serve serve-stop-again
    # The queue's counters, printed when it closed: direct I/O from the
    # frontend's memory went by DMA, not through the bounce buffers.
    if grep -q "closed: [1-9][0-9]* requests by DMA to caller memory" "$serve_log"; then
      grep "NVMe I/O queue .* closed" "$serve_log" | sed 's/^/  /'
      pass "vhost-dma-zero-copy: guest memory reached the controller without a copy"
    else
      fail "vhost-dma-zero-copy: no request went by DMA to guest memory" "$serve_log"
    fi
    fsck_dev fsck-final
  fi
fi

# expect_usage_error NAME WANT CMD...: CMD must exit 2 (a usage error) and
# say WANT, the way to fix it.
expect_usage_error() {
  name=$1 want=$2
  shift 2
  rc=0
  run 60 /tmp/usage.out "$@" || rc=$?
  if [ "$rc" -eq 2 ] && grep -q "$want" /tmp/usage.out; then
    pass "$name: exit 2, says \"$want\""
  else
    fail "$name: exit $rc; wanted 2 and \"$want\"" /tmp/usage.out
  fi
}
expect_usage_error error-no-namespace "namespace 9 does not exist" keelfsd fsck "nvme:$pci/9"

# ------------------------------------------------------------------ e --
echo "=== e. benches (no thresholds)"
bench bench-nvme-randread --backend nvme --path "$dev" --rw randread --bs 4k --iodepth 32 --seconds 5 --size 256M
bench bench-nvme-randwrite --backend nvme --path "$dev" --rw randwrite --bs 4k --iodepth 32 --seconds 5 --size 256M
blk=$(nvme-setup.sh unbind "$pci" 2>/tmp/unbind.err)
rc=$?
sed 's/^/  /' /tmp/unbind.err
blk=$(echo "$blk" | head -n 1)
if [ "$rc" -eq 0 ] && [ -b "$blk" ]; then
  pass "unbind: $pci back on nvme, $blk"
else
  fail "unbind: nvme-setup.sh unbind $pci exited $rc (block device '$blk')"
fi
expect_usage_error error-not-bound "nvme-setup.sh bind $pci" keelfsd fsck "$dev"
if [ -b "$blk" ]; then
  bench bench-uring-randread --backend uring --path "$blk" --rw randread --bs 4k --iodepth 32 --seconds 5 --size 256M
  bench bench-uring-randwrite --backend uring --path "$blk" --rw randwrite --bs 4k --iodepth 32 --seconds 5 --size 256M
else
  fail "bench-uring-randread: no block device"
  fail "bench-uring-randwrite: no block device"
fi
finish
