#!/usr/bin/env bash
# One-command demo: starts keelfsd with its embedded defaults in a temporary
# directory, boots a QEMU guest that mounts keelfs over vhost-user-fs and runs
# the three fio workloads of bench/workloads on it, prints IOPS and bandwidth per workload,
# then stops everything and removes the temporary directory.
set -euo pipefail

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$script_dir/.." && pwd)
prog=demo.sh

usage() {
  cat <<EOF
Usage: qemu-scripts/$prog [--keelfsd PATH] [--workloads DIR] [--full] [--keep] [--verbose]

Runs in a new temporary directory:
  keelfsd serve            (no arguments: the embedded defaults, which create
                            and format ./keelfs-data/keelfs.img, an 8G sparse
                            file, and listen on ./keelfs-data/keelfs.sock)
  qemu-scripts/run-guest.sh --socket ./keelfs-data/keelfs.sock --script ...
                           (the guest mounts keelfs at /mnt and runs the
                            fio jobs w1-dio-overwrite, w2-aio-append and
                            w3-buffered-randrw in /mnt/demo)
then prints a summary, sends keelfsd SIGTERM, waits for it, runs
keelfsd fsck on the image and removes the directory.

Options:
  --keelfsd PATH   keelfsd binary (default: target/release/keelfsd, built
                   or brought up to date with cargo first)
  --workloads DIR  the fio job files w1-dio-overwrite.fio, w2-aio-append.fio
                   and w3-buffered-randrw.fio (default: bench/workloads)
  --full           run the job files at their own sizes and run times
                   (default: scaled down for a TCG guest: sizes 1/8 to 1/4,
                   10 s runs)
  --keep           keep the temporary directory (image, logs)
  --verbose        show the guest's console (fio's full reports)
  --accel A        auto, kvm or tcg for the guests (run-guest.sh --accel;
                   default auto: KVM only when it boots the guest kernel)
  -h, --help       show this help
EOF
}

# shellcheck source=qemu-scripts/lib.sh
source "$script_dir/lib.sh"
say() { echo "$prog: $*" >&2; }

keelfsd_src=""
workloads=""
full=0
keep=0
verbose=0
while (($#)); do
  case "$1" in
    --keelfsd) (($# >= 2)) || die "--keelfsd needs a path"; keelfsd_src=$2; shift 2 ;;
    --workloads) (($# >= 2)) || die "--workloads needs a directory"; workloads=$2; shift 2 ;;
    --full) full=1; shift ;;
    --keep) keep=1; shift ;;
    --verbose) verbose=1; shift ;;
    --accel) need_arg "$1" $#; set_accel "$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

if [[ -z $keelfsd_src ]] && command -v cargo >/dev/null; then
  # Build (or bring up to date) the release binary: on a fresh machine,
  # scripts/setup.sh && qemu-scripts/demo.sh is all it takes.
  (cd "$repo" && cargo build --release -q -p keelfsd) || die "building keelfsd failed"
fi
[[ -n $keelfsd_src ]] || keelfsd_src=$(find_keelfsd)
[[ -x $keelfsd_src ]] || die "--keelfsd $keelfsd_src: not an executable"
command -v qemu-system-x86_64 >/dev/null ||
  die "qemu-system-x86_64 not found: apt-get install -t bookworm-backports qemu-system-x86 (scripts/setup.sh does it)"
[[ -n $workloads ]] || workloads=$repo/bench/workloads

tmp=$(mktemp -d "${TMPDIR:-/tmp}/keelfs-demo.XXXXXX")
daemon_pid=""
guest_pid=""
# shellcheck disable=SC2317  # invoked by traps
cleanup() {
  stop_guest_and_daemon "$guest_pid" "$daemon_pid" 100
  if ((keep)); then
    say "kept $tmp"
  else
    rm -rf "$tmp"
  fi
}
trap cleanup EXIT
trap 'say "interrupted"; exit 130' INT TERM

# ------------------------------------------------------------ job files --
mkdir -p "$tmp/jobs"
for w in w1-dio-overwrite w2-aio-append w3-buffered-randrw; do
  [[ -f $workloads/$w.fio ]] || die "--workloads $workloads has no $w.fio"
  cp "$workloads/$w.fio" "$tmp/jobs/"
done
say "fio workloads from $workloads"
if ((!full)); then
  # TCG runs the guest at a small fraction of native speed: smaller files,
  # fewer jobs, shorter runs. The access patterns stay the same.
  sed -i -e 's/^size=.*/size=32M/' -e 's/^numjobs=4$/numjobs=2/' \
    -e 's/^runtime=.*/runtime=10/' -e 's/^ramp_time=.*/ramp_time=1/' "$tmp/jobs/w1-dio-overwrite.fio"
  sed -i -e 's/^size=.*/size=32M/' "$tmp/jobs/w2-aio-append.fio"
  sed -i -e 's/^size=.*/size=64M/' -e 's/^runtime=.*/runtime=10/' "$tmp/jobs/w3-buffered-randrw.fio"
fi

cat >"$tmp/demo-guest.sh" <<'EOF'
#!/bin/sh
# keelfs demo, in the guest: the fio jobs in /mnt/demo.
mount -t virtiofs "$KEELFS_TAG" /mnt || { echo "demo: mount failed"; exit 1; }
echo "demo: keelfs mounted: $(df -h /mnt | tail -n1)"
mkdir -p /mnt/demo
cd /mnt/demo || exit 1
rc_all=0
for job in /keelfs/files/w*.fio; do
  name=$(basename "$job" .fio)
  echo "demo: running $name ($(grep -E '^(rw|readwrite|bs|ioengine|iodepth|numjobs|direct|size|runtime)=' "$job" | tr '\n' ' '))"
  rc=0
  fio --eta=never --output-format=normal,terse "$job" >/tmp/$name.out 2>&1 || rc=$?
  grep -v '^3;fio-' /tmp/$name.out
  # Terse v3: 5 error, 7 read KiB/s, 8 read IOPS, 48 write KiB/s, 49 write IOPS.
  awk -F';' -v n="$name" -v rc=$rc '/^3;fio-/ { e += $5; rb += $7; ri += $8; wb += $48; wi += $49; k++ }
    END { printf "DEMO-RESULT %s rc=%d err=%d jobs=%d riops=%d rbw=%d wiops=%d wbw=%d\n", n, rc, e, k, ri, rb, wi, wb }' /tmp/$name.out
  [ "$rc" -eq 0 ] || rc_all=1
  rm -rf /mnt/demo/*
done
cd /
rmdir /mnt/demo
umount /mnt
exit $rc_all
EOF

# --------------------------------------------------------------- keelfsd --
cp "$keelfsd_src" "$tmp/keelfsd"
say "keelfsd: $keelfsd_src; working directory $tmp"
say "starting 'keelfsd serve' (embedded defaults: ./keelfs-data/keelfs.img, 8G sparse, and ./keelfs-data/keelfs.sock)"
(cd "$tmp" && exec ./keelfsd serve) >"$tmp/keelfsd.log" 2>&1 &
daemon_pid=$!
sock=$tmp/keelfs-data/keelfs.sock
for _ in $(seq 1 300); do
  [[ -S $sock ]] && break
  kill -0 "$daemon_pid" 2>/dev/null || { cat "$tmp/keelfsd.log" >&2; die "keelfsd exited before creating $sock"; }
  sleep 0.2
done
[[ -S $sock ]] || { cat "$tmp/keelfsd.log" >&2; die "keelfsd did not create $sock within 60 s"; }
sed 's/^/  keelfsd| /' "$tmp/keelfsd.log" >&2

# ----------------------------------------------------------------- guest --
say "booting the guest (under TCG this takes about a minute in all)"
guest_rc=0
"$script_dir/run-guest.sh" --socket "$sock" --script "$tmp/demo-guest.sh" \
  --add "$tmp/jobs/w1-dio-overwrite.fio" --add "$tmp/jobs/w2-aio-append.fio" \
  --add "$tmp/jobs/w3-buffered-randrw.fio" --timeout 900 >"$tmp/guest.log" 2>&1 &
guest_pid=$!
if ((verbose)); then
  tail -n +1 -f --pid="$guest_pid" "$tmp/guest.log" &
else
  tail -n +1 -f --pid="$guest_pid" "$tmp/guest.log" | grep --line-buffered -E '^(demo:|run-guest.sh:)' &
fi
wait "$guest_pid" || guest_rc=$?
guest_pid=""
sleep 0.3
accel=$(grep -o 'accel=[a-z]*' "$tmp/guest.log" | tail -n1 | cut -d= -f2 || true)

# --------------------------------------------------------------- summary --
echo
echo "keelfs demo: fio workloads in a QEMU guest (accel=${accel:-?}) over vhost-user-fs"
printf '%-22s %10s %10s %10s %10s  %s\n' workload "read IOPS" "read MiB/s" "write IOPS" "write MiB/s" status
results=0
while read -r _ name rc err _ riops rbw wiops wbw; do
  results=$((results + 1))
  status=ok
  [[ ${rc#rc=} == 0 && ${err#err=} == 0 ]] || status="FAILED (fio ${rc}, ${err})"
  printf '%-22s %10s %10s %10s %10s  %s\n' "$name" "${riops#riops=}" \
    "$(awk -v k="${rbw#rbw=}" 'BEGIN { printf "%.1f", k / 1024 }')" "${wiops#wiops=}" \
    "$(awk -v k="${wbw#wbw=}" 'BEGIN { printf "%.1f", k / 1024 }')" "$status"
done < <(grep -a '^DEMO-RESULT ' "$tmp/guest.log" | tr -d '\r')
[[ $accel != tcg ]] || echo "(TCG emulates the guest CPU: these figures measure the emulator more than keelfs)"
if ((guest_rc != 0 || results != 3)); then
  echo "the guest run failed (run-guest.sh status $guest_rc, $results of 3 results); its log:"
  tail -n 60 "$tmp/guest.log"
fi

# -------------------------------------------------------------- teardown --
say "stopping keelfsd (SIGTERM)"
kill -TERM "$daemon_pid"
daemon_rc=0
wait "$daemon_pid" || daemon_rc=$?
daemon_pid=""
tail -n 2 "$tmp/keelfsd.log" | sed 's/^/  keelfsd| /' >&2
fsck_rc=0
"$tmp/keelfsd" fsck "$tmp/keelfs-data/keelfs.img" 2>/dev/null || fsck_rc=$?
if ((guest_rc != 0 || results != 3 || daemon_rc != 0 || fsck_rc != 0)); then
  keep=1
  say "something failed (guest $guest_rc, keelfsd exit $daemon_rc, fsck $fsck_rc); logs in $tmp"
  exit 1
fi
say "done"
