#!/bin/sh
# Hands an NVMe controller to vfio-pci for keelfs's userspace NVMe driver
# (nvme:PCI devices), and back to the kernel's nvme driver. A small cousin
# of SPDK's scripts/setup.sh, for one controller at a time. POSIX sh: it
# also runs under busybox sh in the QEMU test guest (qemu-scripts/).
#
#   nvme-setup.sh bind PCI [--hugepages N]
#   nvme-setup.sh unbind PCI
#   nvme-setup.sh status [PCI]
#
# Exit status: 0 done, 1 failed, 2 usage error.
set -u

prog=nvme-setup.sh
sysfs=/sys/bus/pci
default_hugepages=64

usage() {
  cat <<EOF
Usage: $prog bind PCI [--hugepages N]
       $prog unbind PCI
       $prog status [PCI]

bind PCI      Give the NVMe controller at PCI (e.g. 0000:00:05.0 or 00:05.0)
              to vfio-pci: load vfio-pci (modprobe, when there is one), write
              vfio-pci to its driver_override, unbind its current driver,
              reprobe it (/sys/bus/pci/drivers_probe), wait for its VFIO
              group /dev/vfio/N, and reserve N 2 MiB hugepages
              (/proc/sys/vm/nr_hugepages; --hugepages, default
              $default_hugepages; 0 leaves them alone; never lowers them)
              and mount hugetlbfs on /dev/hugepages when nothing is mounted
              there. Prints the group's path (/dev/vfio/N) on stdout.
unbind PCI    Give it back to the kernel: clear driver_override, unbind it
              from vfio-pci and reprobe, so that the nvme driver takes it
              again; when the nvme driver is loaded, wait for its namespace
              block device and print its path (/dev/nvmeXn1) on stdout.
status [PCI]  Show the controller (or every NVMe controller): driver,
              driver_override, IOMMU group, block devices; and hugepages.

Needs root, an IOMMU (intel_iommu=on, or amd_iommu on AMD; in QEMU a
vIOMMU: -device intel-iommu,intremap=on,caching-mode=on with -machine
kernel-irqchip=split) and the vfio-pci module.
Exit status: 0 done, 1 failed, 2 usage error.
EOF
}

usage_error() {
  echo "$prog: error: $*" >&2
  echo "Try '$prog --help'." >&2
  exit 2
}
fail() {
  echo "$prog: error: $*" >&2
  exit 1
}
say() { echo "$prog: $*" >&2; }

# normalize_pci ADDR: prints the full domain:bus:slot.function address.
normalize_pci() {
  case "$1" in
    [0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F]:[0-9a-fA-F][0-9a-fA-F]:[0-9a-fA-F][0-9a-fA-F].[0-7])
      echo "$1" | tr 'A-F' 'a-f' ;;
    [0-9a-fA-F][0-9a-fA-F]:[0-9a-fA-F][0-9a-fA-F].[0-7])
      echo "0000:$1" | tr 'A-F' 'a-f' ;;
    *) return 1 ;;
  esac
}

# driver_of PCI: the name of the bound driver, empty when none.
driver_of() {
  if [ -e "$sysfs/devices/$1/driver" ]; then
    basename "$(readlink -f "$sysfs/devices/$1/driver")"
  fi
}

# group_of PCI: the IOMMU group number, empty when none.
group_of() {
  if [ -e "$sysfs/devices/$1/iommu_group" ]; then
    basename "$(readlink -f "$sysfs/devices/$1/iommu_group")"
  fi
}

# override_of PCI: driver_override, empty when unset ("(null)").
override_of() {
  o=$(cat "$sysfs/devices/$1/driver_override" 2>/dev/null || true)
  [ "$o" = "(null)" ] || echo "$o"
}

# wait_for SECONDS TEST-ARGS...: polls `test TEST-ARGS` every 0.1 s.
wait_for() {
  wf_tenths=$(($1 * 10))
  shift
  while [ "$wf_tenths" -gt 0 ]; do
    test "$@" && return 0
    sleep 0.1
    wf_tenths=$((wf_tenths - 1))
  done
  test "$@"
}

# sysfs_write VALUE FILE: writes VALUE, with the kernel's error on failure.
sysfs_write() {
  if ! err=$( (printf '%s\n' "$1" >"$2") 2>&1); then
    say "writing '$1' to $2 failed: $err"
    return 1
  fi
}

# names_in DIR: the names of DIR's entries on one line.
names_in() {
  for ni in "$1"/*; do
    [ -e "$ni" ] && printf '%s ' "$(basename "$ni")"
  done
}

# check_device PCI: the device exists and is an NVMe controller (warns if it
# is another class).
check_device() {
  [ -d "$sysfs/devices/$1" ] ||
    fail "no such PCI device $1 (the PCI devices here: $(names_in "$sysfs/devices"))"
  cls=$(cat "$sysfs/devices/$1/class" 2>/dev/null || true)
  case "$cls" in
    0x010802) ;;
    *) say "warning: $1 has PCI class ${cls:-unknown}, not an NVMe controller (0x010802)" ;;
  esac
}

# nvme_blockdevs PCI: the /dev paths of the namespaces the nvme driver made
# for the controller (multipath naming: the nvmeXcYnZ path device belongs
# to the head nvmeXnZ).
nvme_blockdevs() {
  for c in "$sysfs/devices/$1"/nvme/nvme*; do
    [ -d "$c" ] || continue
    for n in "$c"/nvme*n*; do
      [ -e "$n" ] || continue
      nb=$(basename "$n")
      case "$nb" in
        nvme*c*n*) echo "/dev/${nb%%c*}n${nb##*n}" ;;
        *) echo "/dev/$nb" ;;
      esac
    done
  done
}

load_vfio() {
  if [ ! -d "$sysfs/drivers/vfio-pci" ] && command -v modprobe >/dev/null 2>&1; then
    modprobe vfio-pci 2>/dev/null || true
  fi
  if [ ! -d /sys/module/vfio_iommu_type1 ] && command -v modprobe >/dev/null 2>&1; then
    modprobe vfio_iommu_type1 2>/dev/null || true
  fi
  [ -d "$sysfs/drivers/vfio-pci" ] ||
    fail "the vfio-pci driver is not loaded and 'modprobe vfio-pci' did not load it: the kernel needs the vfio-pci module (CONFIG_VFIO_PCI; in the keelfs guest qemu-scripts/build-guest.sh puts it in the initramfs)"
  [ -d /sys/module/vfio_iommu_type1 ] ||
    say "warning: vfio_iommu_type1 is not loaded (modprobe vfio_iommu_type1); VFIO cannot map DMA without it"
}

hugepages() {
  want=$1
  [ "$want" -gt 0 ] || return 0
  have=$(cat /proc/sys/vm/nr_hugepages)
  if [ "$have" -lt "$want" ]; then
    sysfs_write "$want" /proc/sys/vm/nr_hugepages || fail "cannot reserve $want hugepages"
    have=$(cat /proc/sys/vm/nr_hugepages)
    [ "$have" -ge "$want" ] ||
      fail "asked for $want 2 MiB hugepages, the kernel reserved $have (not enough contiguous free memory?)"
  fi
  if ! grep -q ' /dev/hugepages hugetlbfs ' /proc/mounts; then
    if ! { mkdir -p /dev/hugepages && mount -t hugetlbfs nodev /dev/hugepages; }; then
      say "warning: could not mount hugetlbfs on /dev/hugepages"
    fi
  fi
  say "hugepages: $have x 2 MiB reserved ($(awk '/^HugePages_Free/ {print $2}' /proc/meminfo) free)"
}

cmd_bind() {
  pci=$1 nr=$2
  check_device "$pci"
  grp=$(group_of "$pci")
  [ -n "$grp" ] ||
    fail "$pci has no IOMMU group: the IOMMU is off. Boot the kernel with intel_iommu=on (amd_iommu=on on AMD); in QEMU add a vIOMMU (-device intel-iommu,intremap=on,caching-mode=on, -machine q35,kernel-irqchip=split; qemu-scripts/run-guest.sh --nvme does)"
  load_vfio
  drv=$(driver_of "$pci")
  if [ "$drv" != vfio-pci ]; then
    sysfs_write vfio-pci "$sysfs/devices/$pci/driver_override" ||
      fail "cannot set driver_override of $pci (root needed)"
    if [ -n "$drv" ]; then
      say "unbinding $pci from $drv"
      sysfs_write "$pci" "$sysfs/devices/$pci/driver/unbind" || fail "cannot unbind $pci from $drv"
    fi
    sysfs_write "$pci" "$sysfs/drivers_probe" || true
    wait_for 10 -e "$sysfs/devices/$pci/driver" || true
    drv=$(driver_of "$pci")
    [ "$drv" = vfio-pci ] ||
      fail "$pci is bound to '${drv:-no driver}' after the reprobe, not vfio-pci (dmesg may say why)"
    say "$pci bound to vfio-pci (IOMMU group $grp)"
  else
    say "$pci is already bound to vfio-pci (IOMMU group $grp)"
  fi
  others=""
  for o in "$sysfs/devices/$pci/iommu_group/devices"/*; do
    [ -e "$o" ] && [ "$(basename "$o")" != "$pci" ] && others="$others $(basename "$o")"
  done
  [ -z "$others" ] || say "warning: IOMMU group $grp also holds $others; VFIO needs all of them bound to vfio-pci or no driver"
  wait_for 10 -c "/dev/vfio/$grp" || fail "/dev/vfio/$grp did not appear within 10 s (devtmpfs or udev missing?)"
  [ -c /dev/vfio/vfio ] || say "warning: /dev/vfio/vfio (the VFIO container) is missing"
  hugepages "$nr"
  echo "/dev/vfio/$grp"
}

cmd_unbind() {
  pci=$1
  check_device "$pci"
  sysfs_write "" "$sysfs/devices/$pci/driver_override" || fail "cannot clear driver_override of $pci (root needed)"
  drv=$(driver_of "$pci")
  if [ -n "$drv" ] && [ "$drv" != nvme ]; then
    say "unbinding $pci from $drv"
    sysfs_write "$pci" "$sysfs/devices/$pci/driver/unbind" || fail "cannot unbind $pci from $drv"
  fi
  if [ -z "$(driver_of "$pci")" ]; then
    sysfs_write "$pci" "$sysfs/drivers_probe" || true
  fi
  if [ ! -d "$sysfs/drivers/nvme" ] && command -v modprobe >/dev/null 2>&1; then
    modprobe nvme 2>/dev/null || true
  fi
  if [ ! -d "$sysfs/drivers/nvme" ]; then
    say "the nvme driver is not loaded: $pci is left without a driver"
    return 0
  fi
  wait_for 10 -e "$sysfs/devices/$pci/driver" || true
  drv=$(driver_of "$pci")
  [ "$drv" = nvme ] || fail "$pci is bound to '${drv:-no driver}' after the reprobe, not nvme (dmesg may say why)"
  # The controller resets and scans its namespaces asynchronously.
  tenths=300
  while [ "$tenths" -gt 0 ]; do
    devs=$(nvme_blockdevs "$pci")
    ready=1
    [ -n "$devs" ] || ready=0
    for d in $devs; do [ -b "$d" ] || ready=0; done
    [ "$ready" -eq 0 ] || break
    sleep 0.1
    tenths=$((tenths - 1))
  done
  [ -n "$devs" ] || ready=0
  [ "$ready" -eq 1 ] ||
    fail "$pci is bound to nvme but no namespace block device appeared within 30 s (${devs:-none found})"
  say "$pci bound to nvme: $(echo "$devs" | tr '\n' ' ')"
  echo "$devs"
}

show() {
  pci=$1
  d=$sysfs/devices/$pci
  grp=$(group_of "$pci")
  ids="$(sed 's/^0x//' "$d/vendor"):$(sed 's/^0x//' "$d/device")"
  echo "$pci  [$ids]  driver: $(driver_of "$pci" | grep . || echo none)  driver_override: $(override_of "$pci" | grep . || echo none)"
  if [ -n "$grp" ]; then
    if [ -c "/dev/vfio/$grp" ]; then g="/dev/vfio/$grp"; else g="(no /dev/vfio/$grp)"; fi
    echo "  IOMMU group $grp $g, devices: $(names_in "$d/iommu_group/devices")"
  else
    echo "  no IOMMU group (IOMMU off: intel_iommu=on / a vIOMMU)"
  fi
  b=$(nvme_blockdevs "$pci" | tr '\n' ' ')
  [ -z "$b" ] || echo "  block devices: $b"
}

cmd_status() {
  if [ -n "${1:-}" ]; then
    check_device "$1"
    show "$1"
  else
    n=0
    for d in "$sysfs"/devices/*; do
      [ "$(cat "$d/class" 2>/dev/null)" = 0x010802 ] || continue
      show "$(basename "$d")"
      n=$((n + 1))
    done
    [ "$n" -gt 0 ] || echo "no NVMe controllers (PCI class 0x010802)"
  fi
  if [ -n "$(names_in /sys/class/iommu)" ]; then
    echo "IOMMU: on ($(names_in /sys/class/iommu))"
  else
    echo "IOMMU: off (no /sys/class/iommu entries)"
  fi
  echo "vfio-pci: $([ -d "$sysfs/drivers/vfio-pci" ] && echo loaded || echo 'not loaded')" \
    " vfio_iommu_type1: $([ -d /sys/module/vfio_iommu_type1 ] && echo loaded || echo 'not loaded')"
  awk '/^HugePages_(Total|Free)|^Hugepagesize/ {printf "%s %s %s  ", $1, $2, $3} END {print ""}' /proc/meminfo
}

[ $# -ge 1 ] || { usage >&2; exit 2; }
action=$1
shift
case "$action" in
  -h|--help|help) usage; exit 0 ;;
  bind|unbind|status) ;;
  *) usage_error "unknown command '$action'" ;;
esac

pci=""
nr=$default_hugepages
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --hugepages)
      [ "$action" = bind ] || usage_error "--hugepages goes with bind"
      [ $# -ge 2 ] || usage_error "--hugepages needs a number"
      nr=$2
      shift 2 ;;
    --hugepages=*)
      [ "$action" = bind ] || usage_error "--hugepages goes with bind"
      nr=${1#*=}
      shift ;;
    -*) usage_error "unknown option '$1'" ;;
    *)
      [ -z "$pci" ] || usage_error "one PCI address only (got '$pci' and '$1')"
      pci=$(normalize_pci "$1") || usage_error "'$1' is not a PCI address like 0000:00:05.0 or 00:05.0"
      shift ;;
  esac
done
case "$nr" in
  ''|*[!0-9]*) usage_error "--hugepages '$nr' is not a number" ;;
esac

case "$action" in
  bind|unbind)
    [ -n "$pci" ] || usage_error "$action needs a PCI address"
    [ "$(id -u)" -eq 0 ] || fail "$action needs root"
    [ -d "$sysfs/devices" ] || fail "$sysfs/devices is missing (sysfs not mounted?)"
    if [ "$action" = bind ]; then cmd_bind "$pci" "$nr"; else cmd_unbind "$pci"; fi ;;
  status) cmd_status "$pci" ;;
esac
