#!/usr/bin/env bash
# Installs what keelfs's build, tests and benchmarks need on a fresh Debian
# bookworm machine (as root). Idempotent: quick when everything is present.
# Every step prints one line (what it installs and why); a failure names
# the step and exits non-zero. --dry-run prints the same lines and changes
# nothing.
set -euo pipefail

prog=setup.sh
usage() {
  cat <<EOF
Usage: scripts/$prog [--dry-run]

Installs the Debian packages (some from bookworm-backports) and cargo tools
that keelfs's tests and benchmarks need, and the 'tests' user pjdfstest
switches to, and turns FUSE over io_uring on (a run-time kernel parameter,
lost at reboot). Each missing piece is one line: "setup: install KIND NAME: WHY".

  --dry-run   print what would be installed; change nothing; exit 0
  -h, --help  show this help

Environment: KEELFS_SETUP_ROOT=DIR probes DIR/boot, DIR/etc/apt and DIR/sys
instead of /boot, /etc/apt and /sys (tests use it to look at an empty machine).
EOF
}

dry_run=0
while (($#)); do
  case "$1" in
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "$prog: error: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

root=${KEELFS_SETUP_ROOT:-}
step="checking what is installed"
# A failing command anywhere names the step it broke.
on_error() {
  local rc=$?
  echo "$prog: error: step \"$step\" failed (exit $rc)" >&2
  exit "$rc"
}
trap on_error ERR

say() { echo "setup: $*"; }
have() { command -v "$1" >/dev/null 2>&1; }
# installed PKG: dpkg knows PKG as installed (false when dpkg-query is
# missing, as on a machine that is not Debian's).
installed() {
  have dpkg-query || return 1
  dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'
}
# The major version of the installed QEMU, 0 when there is none. Every
# probe here must survive set -e and pipefail on an empty machine.
qemu_major() {
  local v=""
  if have qemu-system-x86_64; then
    v=$(qemu-system-x86_64 --version 2>/dev/null | sed -n 's/^QEMU emulator version \([0-9]*\).*/\1/p' || true)
  fi
  echo "${v:-0}"
}
guest_kernel_present() { compgen -G "$root/boot/vmlinuz-6.12.*" >/dev/null; }
backports_listed() {
  grep -rqsE '^(deb .*[[:space:]]bookworm-backports|Suites:.*[[:space:]]bookworm-backports)' \
    "$root/etc/apt/sources.list" "$root/etc/apt/sources.list.d/"
}

need_apt=()
need_bpo=()
# want_apt PKG WHY / want_bpo PKG WHY: queue a package and say why.
want_apt() { need_apt+=("$1"); say "install apt package $1: $2"; }
want_bpo() { need_bpo+=("$1"); say "install apt package $1 from bookworm-backports: $2"; }

have cc || want_apt build-essential "a C toolchain for crates that build C (and strip for the guest)"
have nm || want_apt binutils "nm, to check that keelfsd's release binary ships no test code"
have fio || want_apt fio "the guest and host fio workloads and keelfs-bench's fio peer"
installed busybox-static || want_apt busybox-static "the guest initramfs's shell and tools"
have cpio || want_apt cpio "packing the guest initramfs"
have xz || want_apt xz-utils "unpacking the guest kernel's .ko.xz modules"
have setfattr || want_apt attr "setfattr/getfattr for the guest's xattr checks"
have setfacl || want_apt acl "setfacl/getfacl, run on keelfs and ext4 to compare their ACLs"
have mkfs.xfs || want_apt xfsprogs "xfs, a kernel peer in bench/run-seeds.sh"
have mkfs.ext4 || want_apt e2fsprogs "ext4, a kernel peer in bench/run-seeds.sh"
have shellcheck || want_apt shellcheck "linting the project's shell scripts in CI"
have systemd-analyze || want_apt systemd "systemd-analyze checks contrib/keelfsd.service"
# From backports: it must be systemd's exact version, and installing it
# with -t bookworm-backports moves both to the backports one, wherever
# systemd came from.
have systemd-nspawn || want_bpo systemd-container "systemd-nspawn boots a real systemd that runs keelfsd under contrib/keelfsd.service"
have python3 || want_apt python3 "qemu-scripts/qmp.py, the QMP client of migrate.sh and upgrade.sh (and run-e2e.sh's stats)"
# Debian's module, for Debian's python3: the tests call /usr/bin/python3.
"$root/usr/bin/python3" -c 'import prometheus_client' 2>/dev/null ||
  want_apt python3-prometheus-client "the Prometheus text-format parser that checks keelfsd's metrics"
have tmux || want_apt tmux "the terminal that keelfsd top is tested in"
# bookworm's QEMU 7.2 and Linux 6.1 lack multi-queue virtio-fs.
(($(qemu_major) >= 10)) || want_bpo qemu-system-x86 "QEMU 10 to boot the test guests"
guest_kernel_present || want_bpo linux-image-amd64 "Linux 6.12, the test guests' kernel"
# The RBD backend: scripts/ceph-dev.sh's one-node cluster, librbd to link,
# and QEMU's rbd driver to compare with (it must match the QEMU above).
have ceph-mon || want_apt ceph-mon "the dev cluster's monitor (scripts/ceph-dev.sh)"
have ceph-osd || want_apt ceph-osd "the dev cluster's BlueStore OSD (scripts/ceph-dev.sh)"
have ceph-mgr || want_apt ceph-mgr "the dev cluster's manager (scripts/ceph-dev.sh)"
{ have ceph && have rbd; } || want_apt ceph-common "the ceph and rbd CLIs that set up and check the dev cluster"
installed librbd-dev || want_apt librbd-dev "librbd, which keelfs's RBD backend links"
installed librados-dev || want_apt librados-dev "librados, the RADOS client under librbd"
have ip || want_apt iproute2 "the dev cluster's bridge and the test hosts' network namespaces"
{ installed qemu-block-extra && (($(qemu_major) >= 10)); } ||
  want_bpo qemu-block-extra "QEMU's rbd driver, the RBD benchmark peer"

cargo_bin=${CARGO_HOME:-$HOME/.cargo}/bin
export PATH="$cargo_bin:$PATH"
need_cargo=()
want_cargo() { need_cargo+=("$1"); say "install cargo tool $1: $2"; }
have pjdfstest || want_cargo pjdfstest "the POSIX suite run against a host mount of keelfs"
have fsx || want_cargo fsx "the file-system exerciser run on the host mount and in the guest"
# scripts/miri.sh (run by .ci/run) needs a nightly toolchain with Miri.
nightly_miri() { have rustup && rustup run nightly cargo miri --version >/dev/null 2>&1; }
need_miri=0
if ! nightly_miri; then
  need_miri=1
  say "install rust toolchain nightly: Miri (components miri, rust-src) checks the parsers, codecs and queues in scripts/miri.sh"
fi
need_user=0
if ! getent passwd tests >/dev/null 2>&1; then
  need_user=1
  say "add user tests: pjdfstest switches to it"
fi
# FUSE over io_uring (Linux 6.14+, CONFIG_FUSE_IO_URING=y) stays off
# until the fuse module's parameter says Y; the host-mount tests run on it
# as well as on /dev/fuse, and fail (never skip) without it.
fuse_uring=$root/sys/module/fuse/parameters/enable_uring
fuse_uring_on() {
  local v=""
  [[ -r $fuse_uring ]] || return 1
  read -r v <"$fuse_uring" || true
  [[ $v == Y ]]
}
need_fuse_uring=0
if ! fuse_uring_on; then
  need_fuse_uring=1
  say "enable FUSE over io_uring ($fuse_uring = Y): the host-mount tests run on it as well as on /dev/fuse"
fi
if ! have cargo; then
  say "missing: cargo; install a Rust toolchain (rustup) first"
  ((dry_run)) || { echo "$prog: error: cargo is missing; install a Rust toolchain (rustup) first" >&2; exit 1; }
fi

if ((dry_run)); then
  say "dry run: ${#need_apt[@]} apt, ${#need_bpo[@]} backports, ${#need_cargo[@]} cargo install(s); nothing changed"
  exit 0
fi

export DEBIAN_FRONTEND=noninteractive
if ((${#need_bpo[@]})) && ! backports_listed; then
  step="adding the bookworm-backports apt source"
  say "$step"
  echo 'deb http://deb.debian.org/debian bookworm-backports main' >"$root/etc/apt/sources.list.d/bookworm-backports.list"
fi
if ((${#need_apt[@]} + ${#need_bpo[@]})); then
  step="apt-get update"
  say "$step"
  apt-get update -qq
fi
if ((${#need_apt[@]})); then
  step="apt-get install ${need_apt[*]}"
  say "$step"
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
if ((${#need_bpo[@]})); then
  step="apt-get install -t bookworm-backports ${need_bpo[*]}"
  say "$step"
  apt-get install -y -qq -t bookworm-backports "${need_bpo[@]}" >/dev/null
fi
for tool in "${need_cargo[@]}"; do
  step="cargo install $tool"
  say "$step"
  cargo install --quiet "$tool"
done
if ((need_miri)); then
  step="installing the nightly toolchain with Miri"
  say "$step"
  have rustup || { echo "$prog: error: no rustup to install the nightly toolchain with" >&2; exit 1; }
  rustup toolchain install nightly --profile minimal --component miri,rust-src
  rustup run nightly cargo miri setup
fi
if ((need_user)); then
  step="adding user tests"
  printf 'tests:x:::pjdfstest dummy user:/:/usr/sbin/nologin\n' | newusers
fi
if ((need_fuse_uring)); then
  step="enabling FUSE over io_uring"
  say "$step"
  if [[ ! -e $fuse_uring ]] && have modprobe; then
    modprobe fuse || true
  fi
  if [[ ! -e $fuse_uring ]]; then
    echo "$prog: error: no $fuse_uring: this kernel ($(uname -r)) lacks FUSE over io_uring" \
      "(Linux 6.14+ built with CONFIG_FUSE_IO_URING=y)" >&2
    exit 1
  fi
  echo Y >"$fuse_uring"
fi

# Check that what the tests call is really there now.
step="checking the result"
(($(qemu_major) >= 10)) || { echo "$prog: error: QEMU 10 is still missing after the install" >&2; exit 1; }
guest_kernel_present || { echo "$prog: error: no /boot/vmlinuz-6.12.* after the install" >&2; exit 1; }
for t in fio cpio xz setfattr mkfs.xfs shellcheck systemd-analyze systemd-nspawn python3 pjdfstest fsx \
  ceph-mon ceph-osd ceph-mgr ceph rbd ip; do
  have "$t" || { echo "$prog: error: $t is still missing after the install" >&2; exit 1; }
done
fuse_uring_on || { echo "$prog: error: $fuse_uring is still not Y" >&2; exit 1; }
nightly_miri || { echo "$prog: error: cargo miri (nightly) is still missing after the install" >&2; exit 1; }
for p in librbd-dev librados-dev qemu-block-extra; do
  installed "$p" || { echo "$prog: error: package $p is still missing after the install" >&2; exit 1; }
done
say "ok (fio $(fio --version), QEMU $(qemu_major), Ceph $(ceph --version | cut -d' ' -f3), $(cargo --version))"
