#!/usr/bin/env bash
# keelfs's userspace NVMe driver, tested in a QEMU guest: a sparse raw image
# becomes an emulated NVMe controller behind a vIOMMU (run-guest.sh --nvme),
# and the guest runs guest-tests/nvme.sh with keelfsd, keelfs-bench and
# scripts/nvme-setup.sh on its PATH: bind to vfio-pci, keelfs-bench
# bdev-check, mkfs/fsck, serve over /dev/fuse with fsx and a restart, and
# the bdev benches against the kernel's nvme driver. Prints a summary and
# exits with the guest script's status.
set -euo pipefail

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$script_dir/.." && pwd)
prog=run-nvme.sh

usage() {
  cat <<EOF
Usage: qemu-scripts/$prog [options]

Boots the keelfs test guest with an emulated NVMe controller (guest PCI
address 0000:00:05.0) on a sparse image and runs
qemu-scripts/guest-tests/nvme.sh in it (see that script for the checks).

Options:
  --keelfsd PATH     keelfsd binary (default: target/release/keelfsd, else
                     target/debug/keelfsd)
  --bench PATH       keelfs-bench binary (default: keelfs-bench next to
                     keelfsd)
  --workdir DIR      for the image and the logs (default: a new directory in
                     /dev/shm, else in \$TMPDIR or /tmp, removed after a
                     passing run unless --keep)
  --image-size SIZE  the NVMe image (default: 1G; sparse)
  --fsx-ops N        fsx operations per mode in the guest (default: 3000)
  --mem SIZE         guest memory (default: 1G)
  --smp N            guest CPUs (default: 1; see "One vCPU" below)
  --timeout SECS     for the guest (default: 600)
  --bench-out FILE   write the guest's bench results (its BENCH-JSON lines,
                     without the prefix: one JSON object a line) to FILE
  --log FILE         also keep the guest's console output in FILE
  --keep             keep the work directory after a pass
  --quiet            print only the summary (default: stream the console)
  --accel A          auto, kvm or tcg for the guests (run-guest.sh --accel;
                     default auto: KVM only when it boots the guest kernel)
  --guest-arg ARG    pass ARG on to run-guest.sh (repeatable), e.g.
                     --guest-arg --verbose for the kernel's boot messages,
                     or --guest-arg --qemu-arg --guest-arg -monitor ...
  -h, --help         show this help

One vCPU: under TCG every vCPU is a host thread, and the test changes
the guest's memory map all the time (vfio-pci resets the controller on
each open and close, bus mastering goes on and off, the vIOMMU switches
the device's address space). With two vCPU threads, QEMU 10's TCG races
such a change against the other vCPU's MMIO. On a busy host QEMU was
seen to abort in iotlb_to_section (exit 125), and an idle vCPU's local
APIC timer to never fire again ("rcu_preempt kthread timer wakeup didn't
happen", exit 126), also in a guest that only resets the controller. One
vCPU has nothing to race with; the guest's own scheduler shares it among
the polling driver and the rest of the test.

Exit status: the guest script's (0: every check passed), 124 when the guest
timed out, 125 when QEMU ended without the script's status, 126 when the
guest stalled (run-guest.sh: no heartbeat for a minute), 2 for usage
errors.
EOF
}

# shellcheck source=qemu-scripts/lib.sh
source "$script_dir/lib.sh"
log() { echo "$prog: $*" >&2; }

keelfsd=""
bench=""
workdir=""
image_size=1G
fsx_ops=3000
mem=1G
smp=1
timeout=600
bench_out=""
logfile=""
keep=0
quiet=0
guest_extra=()
while (($#)); do
  case "$1" in
    --keelfsd) need_arg "$1" $#; keelfsd=$2; shift 2 ;;
    --bench) need_arg "$1" $#; bench=$2; shift 2 ;;
    --workdir) need_arg "$1" $#; workdir=$2; shift 2 ;;
    --image-size) need_arg "$1" $#; image_size=$2; shift 2 ;;
    --fsx-ops) need_arg "$1" $#; fsx_ops=$2; shift 2 ;;
    --mem) need_arg "$1" $#; mem=$2; shift 2 ;;
    --smp) need_arg "$1" $#; smp=$2; shift 2 ;;
    --timeout) need_arg "$1" $#; timeout=$2; shift 2 ;;
    --bench-out) need_arg "$1" $#; bench_out=$2; shift 2 ;;
    --log) need_arg "$1" $#; logfile=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    --quiet) quiet=1; shift ;;
    --accel) need_arg "$1" $#; set_accel "$2"; shift 2 ;;
    --guest-arg) need_arg "$1" $#; guest_extra+=("$2"); shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

[[ -n $keelfsd ]] || keelfsd=$(find_keelfsd)
[[ -x $keelfsd ]] || die "--keelfsd $keelfsd: not an executable"
[[ -n $bench ]] || bench=$(dirname "$keelfsd")/keelfs-bench
[[ -x $bench ]] || die "keelfs-bench not found at $bench: build it (cargo build [--release] -p keelfs-bench) or pass --bench PATH"
[[ $fsx_ops =~ ^[1-9][0-9]*$ ]] || die "--fsx-ops '$fsx_ops' is not a positive integer"
[[ $smp =~ ^[1-9][0-9]*$ ]] || die "--smp '$smp' is not a positive integer"
[[ $timeout =~ ^[0-9]+$ ]] || die "--timeout '$timeout' is not a number of seconds"
[[ $image_size =~ ^[1-9][0-9]*[KMGT]?$ ]] || die "--image-size '$image_size': give a size like 512M or 1G"
command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 not found (scripts/setup.sh installs it)"
# Binaries from before the NVMe driver fail in the guest; say so up front.
"$bench" bdev-check --help >/dev/null 2>&1 ||
  log "warning: $bench has no bdev-check subcommand (an old build?); the guest's bdev-check will fail"

make_workdir nvme
img=$workdir/nvme.img
console=$workdir/guest.log
rm -f "$img"
truncate -s "$image_size" "$img" || die "cannot create $img"

guest_pid=""
# shellcheck disable=SC2317  # invoked by traps
cleanup() { stop_guest_and_daemon "$guest_pid" "" 0; }
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT TERM

log "keelfsd: $keelfsd"
log "keelfs-bench: $bench"
log "work directory: $workdir (image $img, $image_size sparse)"
t0=$SECONDS
# no_timer_check: with interrupt remapping on (the vIOMMU), a boot-time
# timer interrupt that TCG on a busy host delivers late is a panic ("timer
# doesn't work through Interrupt-remapped IO-APIC"), not a warning.
args=(--nvme "$img" --mem "$mem" --smp "$smp" --timeout "$timeout"
  --add-bin "$keelfsd" --add-bin "$bench" --add-bin "$repo/scripts/nvme-setup.sh"
  --append "keelfs.fsx_ops=$fsx_ops no_timer_check"
  --script "$script_dir/guest-tests/nvme.sh" "${guest_extra[@]}")
st=0
if ((quiet)); then
  "$script_dir/run-guest.sh" "${args[@]}" >"$console" 2>&1 &
else
  "$script_dir/run-guest.sh" "${args[@]}" > >(tee "$console") 2>&1 &
fi
guest_pid=$!
wait "$guest_pid" || st=$?
guest_pid=""
elapsed=$((SECONDS - t0))
# (tee may still be flushing.)
sleep 0.2
[[ -z $logfile ]] || tr -d '\r' <"$console" >"$logfile"

if [[ -n $bench_out ]]; then
  tr -d '\r' <"$console" | sed -n 's/^BENCH-JSON //p' >"$bench_out"
fi

checks=$(tr -d '\r' <"$console" | grep -aE '^(PASS|FAIL|SKIP): ' || true)
npass=$(grep -c '^PASS: ' <<<"$checks" || true)
nfail=$(grep -c '^FAIL: ' <<<"$checks" || true)
echo
echo "keelfs NVMe guest test summary ($keelfsd)"
grep -E '^(PASS|FAIL|SKIP): ' <<<"$checks" | sed 's/^/  /' || true
case $st in
  0) note="" ;;
  124) note=" (the guest timed out after ${timeout}s)" ;;
  126) note=" (the guest stalled: no heartbeat for a minute)" ;;
  125) note=" (QEMU ended without the guest's exit status: crash or panic)" ;;
  *) note="" ;;
esac
echo "nvme: $npass passed, $nfail failed; guest exit status $st$note; ${elapsed}s"
[[ -z $bench_out ]] || echo "bench results: $(wc -l <"$bench_out") line(s) in $bench_out"
if ((st != 0)); then
  if ((quiet)); then
    echo "----- guest log tail ($console):"
    tr -d '\r' <"$console" | grep -av '^PASS' | tail -n 60 | sed 's/^/  | /'
  fi
  echo "logs and image kept in $workdir"
  exit "$st"
fi
if ((keep)); then
  echo "logs and image in $workdir"
elif ((auto_workdir)); then
  rm -rf "$workdir"
else
  rm -f "$img"
  echo "logs in $workdir"
fi
