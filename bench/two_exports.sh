# shellcheck shell=bash
# Sourced by bench/run-hostile.sh and bench/hostile-latency.sh: the
# keelfsd config both serve, two exports ("calm" and "hostile") on
# 256 MiB images of their own, with no client cache (every request
# reaches the daemon), after what the caller already wrote to CONFIG.
#
# append_two_exports KEELFSD WORK CONFIG: format WORK/calm.img and
# WORK/hostile.img with KEELFSD, and append their devices and exports,
# with sockets WORK/calm.sock and WORK/hostile.sock, to CONFIG.
append_two_exports() {
  local keelfsd=$1 work=$2 config=$3 tag
  for tag in calm hostile; do
    "$keelfsd" mkfs "$work/$tag.img" --size 256M --force >/dev/null 2>&1
    printf '[[device]]\nname = "%s"\npath = "%s"\n[[export]]\ntag = "%s"\ndevice = "%s"\nsocket = "%s"\ncache = "none"\n' \
      "$tag" "$work/$tag.img" "$tag" "$tag" "$work/$tag.sock" >>"$config"
  done
}
