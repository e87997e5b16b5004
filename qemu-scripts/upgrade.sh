#!/usr/bin/env bash
# "Restart keelfsd under a running guest", as a test: a local live migration
# (migrate.sh) from a QEMU served by the old keelfsd to a new QEMU process
# served by the new build.
#
# Why a migration and not a restart: QEMU 10's vhost-user-fs device cannot
# reconnect to a restarted back-end. hw/virtio/vhost-user-fs.c registers no
# chardev event handler (vhost-user-blk does, and reconnects), so once
# keelfsd exits, the guest's virtio-fs device stays broken until the VM
# restarts. A live migration to a second QEMU on the same host, whose
# keelfsd (serve --incoming) takes over the image and the session state
# (open inodes and handles) from the old one at switch-over, replaces the
# daemon without the guest noticing anything but a pause of a few ms.
set -euo pipefail

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$script_dir/.." && pwd)
prog=upgrade.sh

usage() {
  cat <<EOF
Usage: qemu-scripts/$prog --keelfsd-new PATH [--keelfsd PATH] [migrate.sh options]

Upgrades keelfsd under a running guest: runs qemu-scripts/migrate.sh with the
old build on the source and the new build on the destination

  migrate.sh --keelfsd OLD --keelfsd-dest NEW [options]

so a guest (guest-tests/migrate.sh: held files and directories, listing
loops, fio with crc32c verification) moves from a QEMU served by the old
keelfsd to a new QEMU process served by the new one, and checks everything
there; then both daemons must exit 0 on SIGTERM and the new build's
keelfsd fsck must pass on the image.

QEMU 10's vhost-user-fs-pci cannot reconnect to a restarted back-end
(hw/virtio/vhost-user-fs.c handles no chardev events), so restarting
keelfsd in place would break the guest's file system; the upgrade path is a
local live migration onto a new QEMU process whose keelfsd is the new
build. See qemu-scripts/README.md for the operator's commands.

Options:
  --keelfsd PATH       the old keelfsd (default: target/release/keelfsd, else
                       target/debug/keelfsd)
  --keelfsd-new PATH   the new keelfsd (required)
  --accel A            auto, kvm or tcg for the guests (run-guest.sh --accel;
                       default auto: KVM only when it boots the guest kernel)
  -h, --help           show this help
Any other option goes to migrate.sh: --during-io, --timeout SECS,
--workdir DIR, --keep, --verbose (see migrate.sh --help).
EOF
}

# shellcheck source=qemu-scripts/lib.sh
source "$script_dir/lib.sh"

old=""
new=""
rest=()
while (($#)); do
  case "$1" in
    --keelfsd) need_arg "$1" $#; old=$2; shift 2 ;;
    --keelfsd-new) need_arg "$1" $#; new=$2; shift 2 ;;
    --keelfsd-dest|--peer|--virtiofsd) die "$1 is not an upgrade option (use migrate.sh)" ;;
    --accel) need_arg "$1" $#; set_accel "$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) rest+=("$1"); shift ;;
  esac
done
[[ -n $new ]] || die "give --keelfsd-new PATH (the new keelfsd build; see --help)"
[[ -n $old ]] || old=$(find_keelfsd)
[[ -x $old ]] || die "--keelfsd $old: not an executable"
[[ -x $new ]] || die "--keelfsd-new $new: not an executable"
echo "$prog: old keelfsd $old ($("$old" --version 2>&1 | head -n1 || true)), new $new ($("$new" --version 2>&1 | head -n1 || true))" >&2
exec "$script_dir/migrate.sh" --keelfsd "$old" --keelfsd-dest "$new" "${rest[@]}"
