#!/usr/bin/env bash
# Builds the QEMU guest for keelfs's end-to-end tests from Debian packages:
# the Linux 6.12 kernel of bookworm-backports, and an initramfs holding
# busybox-static, the virtio / virtio-fs, VFIO and NVMe kernel modules
# (decompressed; the ones Debian builds into the kernel are skipped), fio with its shared
# libraries, fsx (cargo install fsx), an O_DIRECT shim for it (fsx-odirect.c,
# compiled with cc) and setfattr/getfattr (package attr), and an /init that
# runs a test script passed in by run-guest.sh. Each of these is required:
# a guest without one would let its tests pass by not running.
# The guest needs no network at runtime.
#
# The result is cached in the output directory and rebuilt only when its
# inputs change (kernel version, package versions, this script).
set -euo pipefail

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
self="$script_dir/$(basename "${BASH_SOURCE[0]}")"
prog=build-guest.sh

usage() {
  cat <<EOF
Usage: qemu-scripts/$prog [--out DIR] [--kernel VERSION] [--force] [--quiet]

Builds (or reuses) a guest kernel + initramfs for qemu-scripts/run-guest.sh.

Options:
  --out DIR         Output directory (default: qemu-scripts/.guest)
  --kernel VERSION  Kernel release to use, e.g. 6.12.95+deb12-amd64
                    (default: the newest installed /boot/vmlinuz-6.12.*;
                    when none is installed, linux-image-amd64 is installed
                    from bookworm-backports, which needs root and network)
  --force           Rebuild even when the cached guest is up to date
  --quiet           Print nothing when the cached guest is up to date
  -h, --help        Show this help

Output files in DIR:
  vmlinuz           the kernel
  initramfs.cpio.gz the initramfs (busybox, modules, fio, /init, fsx,
                    /usr/lib/fsx-odirect.so, setfattr and getfattr)
  kernel-version    the kernel release
  inputs            what the cache key was computed from
  inputs.sha256     the cache key

Guest /init: mounts proc, sysfs, devtmpfs, tmpfs; loads the modules
(virtio-fs, fuse, vfio-pci with its IOMMU backend, nvme); then, when an
initramfs layer added /keelfs/script, runs it (with /keelfs/bin first on
PATH, KEELFS_TAG from the kernel command line option keelfs.tag=, default
keelfs, KEELFS_NVME from keelfs.nvme=, the NVMe controller's PCI
address, empty without one, and FSX_OPS and STRESS_ITERS from
keelfs.fsx_ops= and keelfs.stress_iters= when given), prints
"KEELFS-GUEST-EXIT=<status>" on the console and powers off; without a
script it starts an interactive shell on the console.
EOF
}

die() { echo "$prog: error: $*" >&2; exit 1; }
log() { echo "$prog: $*" >&2; }

out="$script_dir/.guest"
kver=""
force=0
quiet=0
while (($#)); do
  case "$1" in
    --out) (($# >= 2)) || die "--out needs a directory"; out=$2; shift 2 ;;
    --out=*) out=${1#*=}; shift ;;
    --kernel) (($# >= 2)) || die "--kernel needs a version"; kver=$2; shift 2 ;;
    --kernel=*) kver=${1#*=}; shift ;;
    --force) force=1; shift ;;
    --quiet) quiet=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

# Modules the guest needs, in load order. Debian's 6.12 kernel builds most of
# them in (modules.builtin); those are skipped.
# After virtio-fs: VFIO (vfio-pci binds the NVMe controller for keelfs's
# userspace NVMe driver; the vIOMMU gives it an IOMMU group) and the kernel's
# own NVMe driver (it binds the controller at boot; nvme-setup.sh hands it
# to vfio-pci and back). modules.dep spells some of them with dashes
# (vfio-pci-core, vfio-pci, nvme-core); either spelling matches here.
wanted_modules=(virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev
  virtio_pci fuse virtiofs overlay
  irqbypass vfio vfio_iommu_type1 vfio_pci_core vfio_pci nvme_core nvme)
# Guest binaries besides busybox (their shared libraries come along), each
# put at the same path in the guest. fio is required; setfacl and getfacl
# (package acl) serve the ACL checks of guest-tests/overlay.sh.
guest_bins=(/usr/bin/fio /usr/bin/setfacl /usr/bin/getfacl)
# Tools the guest tests need, put in the guest's /usr/bin: fsx (cargo
# install fsx) for guest-tests/fsx.sh, setfattr and getfattr (Debian package
# attr) for the xattr checks of namespace.sh and persist-*.sh, and GNU cp
# (coreutils 9, whose copy_file_range clones on keelfs) for clones.sh. The
# guest's PATH finds busybox's applets in /bin first: only a test that
# names /usr/bin/cp gets GNU's.
test_bins=()
fsx_bin=$(PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH" command -v fsx || true)
[[ -n $fsx_bin ]] || die "fsx is missing on the host (scripts/setup.sh installs it: cargo install fsx)"
for b in "$fsx_bin" /usr/bin/setfattr /usr/bin/getfattr /usr/bin/cp; do
  [[ -x $b ]] || die "$b is missing on the host (scripts/setup.sh installs it)"
  test_bins+=("$b")
done
# fsx has no O_DIRECT option: fsx-odirect.c is an LD_PRELOAD shim that adds
# O_DIRECT to its opens of one file.
shim_src=$script_dir/fsx-odirect.c
# fsx's configs, shared by the guest tests (guest-tests/fsx.sh, nvme.sh).
fsx_configs=("$script_dir"/guest-tests/fsx/*.toml)
command -v cc >/dev/null || die "no C compiler for $shim_src (scripts/setup.sh installs build-essential)"

# ---------------------------------------------------------------- packages --
apt_install() {
  [[ $(id -u) == 0 ]] || die "missing packages ($*); run as root or install them: apt-get install $*"
  log "installing $* (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || die "apt-get update failed"
  apt-get install -y -qq "$@" >/dev/null || die "apt-get install $* failed"
}

pkg_version() { dpkg-query -W -f='${Status} ${Version}\n' "$1" 2>/dev/null | awk '$3 == "installed" {print $4}'; }

need=()
[[ -x /bin/busybox && -n $(pkg_version busybox-static) ]] || need+=(busybox-static)
[[ -x /usr/bin/fio ]] || need+=(fio)
[[ -x /usr/bin/setfacl ]] || need+=(acl)
command -v cpio >/dev/null || need+=(cpio)
command -v xz >/dev/null || need+=(xz-utils)
command -v gzip >/dev/null || need+=(gzip)
((${#need[@]} == 0)) || apt_install "${need[@]}"
# Not `grep -q`: it exits at the first match, busybox then dies of
# SIGPIPE, and pipefail turns a good busybox into a failure, now and then.
/bin/busybox --list 2>/dev/null | grep -x sh >/dev/null ||
  die "/bin/busybox is not the static busybox with a shell (install busybox-static)"
file_is_static() { ! ldd "$1" >/dev/null 2>&1; }
file_is_static /bin/busybox || die "/bin/busybox is dynamically linked; install busybox-static"

latest_612() {
  compgen -G '/boot/vmlinuz-6.12.*' >/dev/null || return 0
  printf '%s\n' /boot/vmlinuz-6.12.* | sed 's|^/boot/vmlinuz-||' | sort -V | tail -n1
}

if [[ -z $kver ]]; then
  kver=$(latest_612)
  if [[ -z $kver ]]; then
    [[ $(id -u) == 0 ]] || die "no /boot/vmlinuz-6.12.* installed; as root this script would install it from bookworm-backports"
    log "no 6.12 kernel installed; installing linux-image-amd64 from bookworm-backports"
    # One-line (deb ...) or deb822 (Suites: ...) sources.
    if ! grep -rqsE '^(deb .*[[:space:]]bookworm-backports|Suites:.*[[:space:]]bookworm-backports)' \
      /etc/apt/sources.list /etc/apt/sources.list.d/; then
      echo 'deb http://deb.debian.org/debian bookworm-backports main' >/etc/apt/sources.list.d/bookworm-backports.list
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq || die "apt-get update failed"
    apt-get install -y -qq -t bookworm-backports linux-image-amd64 >/dev/null || die "installing linux-image-amd64 from bookworm-backports failed"
    kver=$(latest_612)
    [[ -n $kver ]] || die "linux-image-amd64 from bookworm-backports did not install a 6.12 kernel (see /boot)"
  fi
fi
vmlinuz=/boot/vmlinuz-$kver
moddir=/lib/modules/$kver
[[ -r $vmlinuz ]] || die "kernel $vmlinuz not found or not readable"
[[ -r $moddir/modules.dep ]] || die "$moddir/modules.dep not found (kernel modules for $kver missing?)"

# --------------------------------------------------------------- cache key --
kpkg=$(dpkg-query -S "$vmlinuz" 2>/dev/null | cut -d: -f1 | head -n1 || true)
inputs=$(
  echo "kernel=$kver"
  echo "kernel-package=${kpkg:-none} $( [[ -n $kpkg ]] && pkg_version "$kpkg")"
  echo "vmlinuz-sha256=$(sha256sum "$vmlinuz" | cut -d' ' -f1)"
  echo "busybox-static=$(pkg_version busybox-static)"
  echo "fio=$(pkg_version fio)"
  for b in "${guest_bins[@]}" "${test_bins[@]}"; do echo "bin $b=$(sha256sum "$b" | cut -d' ' -f1)"; done
  echo "modules=${wanted_modules[*]}"
  echo "fsx-odirect.c=$(sha256sum "$shim_src" | cut -d' ' -f1)"
  for c in "${fsx_configs[@]}"; do echo "fsx config $(basename "$c")=$(sha256sum "$c" | cut -d' ' -f1)"; done
  echo "script-sha256=$(sha256sum "$self" | cut -d' ' -f1)"
)
key=$(printf '%s\n' "$inputs" | sha256sum | cut -d' ' -f1)

# One build at a time per output directory (run-guest.sh calls this script).
mkdir -p "$out" || die "cannot create $out"
exec 9>"$out/.lock"
flock 9 || die "cannot lock $out/.lock"

if ((!force)) && [[ -f $out/inputs.sha256 && -f $out/vmlinuz && -f $out/initramfs.cpio.gz ]] &&
  [[ $(cat "$out/inputs.sha256") == "$key" ]]; then
  ((quiet)) || log "guest in $out is up to date (kernel $kver)"
  exit 0
fi

# ------------------------------------------------------------------- build --
log "building guest in $out (kernel $kver)"
work=$(mktemp -d "$out/.build.XXXXXX")
trap 'rm -rf "$work"' EXIT
root=$work/root
mkdir -p "$root"/{bin,sbin,etc,proc,sys,dev,tmp,mnt,root,run,lib/modules,keelfs,usr/bin,usr/sbin}
chmod 1777 "$root/tmp"

cp /bin/busybox "$root/bin/busybox"
# The kernel opens /dev/console before /init runs (its built-in initramfs
# normally has one too).
if [[ $(id -u) == 0 ]]; then
  mknod -m 600 "$root/dev/console" c 5 1
  mknod -m 666 "$root/dev/null" c 1 3
fi

# Copies a file (following symlinks) to the same path under $root.
copy_same_path() {
  local src=$1
  mkdir -p "$root$(dirname "$src")"
  cp -L "$src" "$root$src"
}

# The shared libraries ldd names for binary $1; keep the loader's paths.
copy_libs() {
  local l libs
  file_is_static "$1" && return 0
  libs=$(ldd "$1" | awk '/=> \// {print $3} /^[[:space:]]*\// {print $1}') ||
    die "ldd $1 failed"
  for l in $libs; do
    [[ -e $root$l ]] || copy_same_path "$l"
  done
}
for b in "${guest_bins[@]}"; do
  [[ -x $b ]] || die "guest binary $b missing"
  copy_same_path "$b"
  copy_libs "$b"
done
for b in "${test_bins[@]}"; do
  cp -L "$b" "$root/usr/bin/$(basename "$b")"
  copy_libs "$b"
done
mkdir -p "$root/usr/lib"
cc -shared -fPIC -O2 -Wall -o "$root/usr/lib/fsx-odirect.so" "$shim_src" -ldl ||
  die "compiling $shim_src failed"
mkdir -p "$root/usr/share/keelfs/fsx"
cp "${fsx_configs[@]}" "$root/usr/share/keelfs/fsx/"
log "test tools: ${test_bins[*]} /usr/lib/fsx-odirect.so"
# The loader is looked up through /lib64 as well as its canonical path.
if [[ -e /lib64/ld-linux-x86-64.so.2 && ! -e $root/lib64/ld-linux-x86-64.so.2 ]]; then
  copy_same_path /lib64/ld-linux-x86-64.so.2
fi

# Modules: skip built-ins, add dependencies from modules.dep, decompress.
declare -A seen=()
load_order=()
add_module_file() { # $1: path relative to $moddir, as in modules.dep
  local rel=$1 name dep deps
  name=$(basename "$rel"); name=${name%%.ko*}
  [[ -z ${seen[$name]:-} ]] || return 0
  deps=$(awk -v m="$rel:" '$1 == m {for (i = 2; i <= NF; i++) print $i}' "$moddir/modules.dep")
  # modules.dep lists dependencies with the deepest last: load in reverse.
  if [[ -n $deps ]]; then
    for dep in $(tac <<<"$deps"); do add_module_file "$dep"; done
  fi
  seen[$name]=1
  local src=$moddir/$rel dst=$root/lib/modules/$name.ko
  case "$rel" in
    *.ko.xz) xz -dc "$src" >"$dst" ;;
    *.ko.zst) command -v zstd >/dev/null || die "$rel needs zstd (apt-get install zstd)"
      zstd -qdc "$src" >"$dst" ;;
    *.ko.gz) gzip -dc "$src" >"$dst" ;;
    *.ko) cp "$src" "$dst" ;;
    *) die "unknown module file type: $rel" ;;
  esac
  load_order+=("$name")
}
builtin_list=()
for m in "${wanted_modules[@]}"; do
  # Module names may use - or _ interchangeably.
  pat=${m//[-_]/[-_]}
  if [[ -r $moddir/modules.builtin ]] && grep -Eq "/${pat}\.ko\$" "$moddir/modules.builtin"; then
    builtin_list+=("$m")
    continue
  fi
  rel=$(awk -F: '{print $1}' "$moddir/modules.dep" | grep -E "/${pat}\.ko(\.xz|\.zst|\.gz)?\$" | head -n1 || true)
  [[ -n $rel ]] || die "module $m is neither built into $kver nor in $moddir/modules.dep"
  add_module_file "$rel"
done
printf '%s\n' "${load_order[@]}" >"$root/lib/modules/load-order"
log "modules: built in: ${builtin_list[*]:-none}; loaded by /init: ${load_order[*]:-none}"

cat >"$root/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/bin/sh
EOF
cat >"$root/etc/group" <<'EOF'
root:x:0:
EOF
echo keelfs-guest >"$root/etc/hostname"
printf '%s\n' "$inputs" >"$root/etc/keelfs-guest-inputs"

cat >"$root/init" <<'EOF'
#!/bin/busybox sh
# keelfs test guest init (generated by qemu-scripts/build-guest.sh).
/bin/busybox --install -s /bin
# /keelfs/bin: executables run-guest.sh --add-bin puts in the guest.
export PATH=/keelfs/bin:/bin:/sbin:/usr/bin:/usr/sbin
export HOME=/root TERM=${TERM:-linux}
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
hostname keelfs-guest

for m in $(cat /lib/modules/load-order); do
  insmod /lib/modules/$m.ko || echo "init: insmod $m failed" >&2
done

KEELFS_TAG=keelfs
KEELFS_NVME=
for arg in $(cat /proc/cmdline); do
  case "$arg" in
    keelfs.tag=*) KEELFS_TAG=${arg#keelfs.tag=} ;;
    keelfs.nvme=*) KEELFS_NVME=${arg#keelfs.nvme=} ;;
    keelfs.fsx_ops=*) export FSX_OPS=${arg#keelfs.fsx_ops=} ;;
    keelfs.stress_iters=*) export STRESS_ITERS=${arg#keelfs.stress_iters=} ;;
  esac
done
export KEELFS_TAG KEELFS_NVME

if [ -f /keelfs/script ]; then
  # A heartbeat on the console every 10 s: run-guest.sh takes a silence of
  # a minute for a stalled guest (timers or a vCPU that stopped) and fails
  # the run at once, instead of at its timeout.
  (while :; do sleep 10; echo "KEELFS-HEARTBEAT $(cut -d' ' -f1 /proc/uptime)"; done) &
  # (For the harness's own test, which silences it.)
  export KEELFS_HEARTBEAT_PID=$!
  echo "KEELFS-GUEST-START"
  cd /root
  /bin/sh /keelfs/script </dev/null
  rc=$?
  cd /
  sync
  echo
  echo "KEELFS-GUEST-EXIT=$rc"
else
  echo "keelfs guest: interactive shell (tag '$KEELFS_TAG': mount -t virtiofs $KEELFS_TAG /mnt); exit powers off"
  setsid cttyhack /bin/sh -l
fi
poweroff -f
EOF
chmod 755 "$root/init"

(cd "$root" && find . -print0 | LC_ALL=C sort -z |
  cpio --null -o -H newc -R 0:0 --quiet) | gzip -6 >"$work/initramfs.cpio.gz"
cp "$vmlinuz" "$work/vmlinuz"
echo "$kver" >"$work/kernel-version"
printf '%s\n' "$inputs" >"$work/inputs"
rm -f "$out/inputs.sha256"
for f in vmlinuz initramfs.cpio.gz kernel-version inputs; do
  mv -f "$work/$f" "$out/$f"
done
# Written last: the cache key marks a complete build.
echo "$key" >"$out/inputs.sha256"
log "done: $out/vmlinuz, $out/initramfs.cpio.gz ($(du -h "$out/initramfs.cpio.gz" | cut -f1))"
