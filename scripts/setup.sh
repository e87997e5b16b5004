#!/usr/bin/env bash
# Installs what keelfs's build, tests and benchmarks need on a fresh Debian
# bookworm machine (as root). Idempotent: quick when everything is present.
set -euo pipefail

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }
need_apt=()
command -v fio >/dev/null || need_apt+=(fio)
command -v cc >/dev/null || need_apt+=(build-essential)
# The QEMU guest tests (qemu-scripts/): a static busybox, cpio and xz for the
# initramfs, setfattr/getfattr for the xattr checks.
installed busybox-static || need_apt+=(busybox-static)
command -v cpio >/dev/null || need_apt+=(cpio)
command -v xz >/dev/null || need_apt+=(xz-utils)
command -v setfattr >/dev/null || need_apt+=(attr)
# The kernel peers of bench/run-seeds.sh.
command -v mkfs.xfs >/dev/null || need_apt+=(xfsprogs)
# ... and QEMU 10 and Linux 6.12 from bookworm-backports (bookworm's QEMU 7.2
# and Linux 6.1 lack multi-queue virtio-fs).
need_bpo=()
qemu_major=$(qemu-system-x86_64 --version 2>/dev/null | sed -n 's/^QEMU emulator version \([0-9]*\).*/\1/p')
((${qemu_major:-0} >= 10)) || need_bpo+=(qemu-system-x86)
compgen -G '/boot/vmlinuz-6.12.*' >/dev/null || need_bpo+=(linux-image-amd64)
if ((${#need_apt[@]} + ${#need_bpo[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  if ((${#need_bpo[@]})) && ! grep -rqsE '^(deb .*[[:space:]]bookworm-backports|Suites:.*[[:space:]]bookworm-backports)' \
    /etc/apt/sources.list /etc/apt/sources.list.d/; then
    echo 'deb http://deb.debian.org/debian bookworm-backports main' >/etc/apt/sources.list.d/bookworm-backports.list
  fi
  apt-get update -qq
  ((${#need_apt[@]} == 0)) || apt-get install -y -qq "${need_apt[@]}" >/dev/null
  ((${#need_bpo[@]} == 0)) || apt-get install -y -qq -t bookworm-backports "${need_bpo[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null; then
  echo "setup: cargo is missing; install a Rust toolchain (rustup) first" >&2
  exit 1
fi

# The POSIX suites run against a host mount of keelfs; fsx also runs in the
# QEMU guest (qemu-scripts/guest-tests/fsx.sh).
export PATH="$HOME/.cargo/bin:$PATH"
command -v pjdfstest >/dev/null || cargo install --quiet pjdfstest
command -v fsx >/dev/null || cargo install --quiet fsx
# pjdfstest switches to these users.
getent passwd tests >/dev/null || printf 'tests:x:::pjdfstest dummy user:/:/usr/sbin/nologin\n' | newusers
echo "setup: ok (fio $(fio --version), $(cargo --version))"
