#!/usr/bin/env bash
# Space given back to an image file (issue 21): keelfs (keelfsd serving a
# host FUSE mount) against ext4 (a loop device; the loop driver turns
# discards into holes punched in its file), both on image files in the same
# host directory. Each round writes SIZE MiB (dd, fsync), deletes it and
# syncs, then:
#   online: continuous discard (keelfs discard = true; ext4 -o discard):
#           polls the image's allocated size until it stops falling;
#   fstrim: no continuous discard; runs fstrim on the mount and times it.
# Reports, per filesystem and mode, the share of the deleted bytes given
# back to the image file and the seconds it took (wall clock, from the
# sync's end). Prints one JSON line per round and a summary line of
# keelfs/ext4 ratios; with OUT, appends them there too.
#
# usage: bench/run-discard.sh [OUT.json] [--rounds N] [--size-mib N] [--dir DIR]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=""
rounds=3
size_mib=256
dir=${TMPDIR:-/tmp}
while (($#)); do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --size-mib) size_mib=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) out=$1; shift ;;
  esac
done
keelfsd=$repo/target/release/keelfsd
[[ -x $keelfsd ]] || { echo "run-discard.sh: $keelfsd is missing (cargo build --release)" >&2; exit 2; }
for tool in mkfs.ext4 losetup fstrim python3; do
  command -v "$tool" >/dev/null || { echo "run-discard.sh: $tool is missing (scripts/setup.sh)" >&2; exit 2; }
done
work=$(mktemp -d "$dir/keelfs-discard.XXXXXX")
daemon=""
loop=""
cleanup() {
  mountpoint -q "$work/mnt" && umount "$work/mnt"
  if [[ -n $daemon ]]; then kill "$daemon" 2>/dev/null || true; wait "$daemon" 2>/dev/null || true; fi
  [[ -z $loop ]] || losetup -d "$loop" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$work/mnt"

emit() {
  echo "$1"
  echo "$1" >>"$work/lines.json"
  if [[ -n $out ]]; then echo "$1" >>"$out"; fi
}
allocated() { local b s; read -r b s < <(stat -c '%b %B' "$1"); echo $((b * s)); }

# mount_fs FS MODE: an empty filesystem of FS on $work/fs.img at $work/mnt.
mount_fs() {
  local fs=$1 mode=$2 discard=false
  rm -f "$work/fs.img"
  [[ $mode == online ]] && discard=true
  if [[ $fs == keelfs ]]; then
    "$keelfsd" mkfs "$work/fs.img" --size 1G >/dev/null
    printf '[daemon]\nsandbox = "none"\n[[device]]\nname = "d"\npath = "%s"\n[[export]]\ntag = "d"\ndevice = "d"\nfuse_mount = "%s"\ndiscard = %s\n' \
      "$work/fs.img" "$work/mnt" "$discard" >"$work/keelfsd.toml"
    "$keelfsd" serve --config "$work/keelfsd.toml" >"$work/keelfsd.log" 2>&1 &
    daemon=$!
    for _ in $(seq 1 100); do mountpoint -q "$work/mnt" && return 0; sleep 0.1; done
    echo "run-discard.sh: keelfsd did not mount" >&2
    cat "$work/keelfsd.log" >&2
    exit 1
  fi
  truncate -s 1G "$work/fs.img"
  mkfs.ext4 -q -E nodiscard,lazy_itable_init=0,lazy_journal_init=0 "$work/fs.img"
  loop=$(losetup -f --show "$work/fs.img")
  local options=rw
  [[ $discard == true ]] && options=discard
  mount -o "$options" "$loop" "$work/mnt"
}

unmount_fs() {
  umount "$work/mnt"
  if [[ -n $daemon ]]; then wait "$daemon" 2>/dev/null || true; daemon=""; fi
  if [[ -n $loop ]]; then losetup -d "$loop"; loop=""; fi
}

# settle SIZE T0: seconds from T0 (microseconds) until the image's
# allocated size last changed from SIZE, its size at T0 (0: no change
# after T0), polling every millisecond until it held still for 2 s (at
# most 30 s).
settle() {
  local last=$1 t0=$2 changed=$2 t a
  while t=$(now_us) && ((t - changed < 2000000 && t - t0 < 30000000)); do
    a=$(allocated "$work/fs.img")
    if [[ $a != "$last" ]]; then last=$a; changed=$(now_us); fi
    sleep 0.001
  done
  seconds_between "$t0" "$changed"
}
now_us() { local t=${EPOCHREALTIME/./}; echo $((10#$t)); }
seconds_between() { printf '%d.%06d' $((($2 - $1) / 1000000)) $((($2 - $1) % 1000000)); }

round() { # FS MODE ROUND
  local fs=$1 mode=$2 round=$3
  mount_fs "$fs" "$mode"
  dd if=/dev/urandom of="$work/mnt/big" bs=1M count="$size_mib" conv=fsync status=none
  sync "$work/mnt"
  local full t0 seconds after
  full=$(allocated "$work/fs.img")
  rm "$work/mnt/big"
  sync "$work/mnt"
  t0=$(now_us)
  local at_sync
  at_sync=$(allocated "$work/fs.img")
  if [[ $mode == fstrim ]]; then
    fstrim "$work/mnt"
    seconds=$(seconds_between "$t0" "$(now_us)")
  else
    seconds=$(settle "$at_sync" "$t0")
  fi
  after=$(allocated "$work/fs.img")
  unmount_fs
  local given=$((full - after)) deleted=$((size_mib << 20))
  emit "{\"bench\":\"discard\",\"fs\":\"$fs\",\"mode\":\"$mode\",\"round\":$round,\"deleted_bytes\":$deleted,\"given_back_bytes\":$given,\"given_back_share\":$(python3 -c "print(round($given / $deleted, 3))"),\"given_back_by_sync_share\":$(python3 -c "print(round(max($full - $at_sync, 0) / $deleted, 3))"),\"seconds\":$seconds}"
}

for mode in online fstrim; do
  for r in $(seq 1 "$rounds"); do
    round keelfs "$mode" "$r"
    round ext4 "$mode" "$r"
  done
done

summary=$(python3 - "$work/lines.json" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
out = {"bench": "discard-summary"}
for mode in ("online", "fstrim"):
    def total(fs, key):
        return sum(r[key] for r in rows if r["fs"] == fs and r["mode"] == mode)
    for fs in ("keelfs", "ext4"):
        out[f"{mode}_{fs}_share"] = round(total(fs, "given_back_bytes") / max(total(fs, "deleted_bytes"), 1), 3)
        out[f"{mode}_{fs}_seconds"] = round(total(fs, "seconds"), 3)
    out[f"{mode}_seconds_keelfs_over_ext4"] = round(total("keelfs", "seconds") / max(total("ext4", "seconds"), 1e-3), 3)
print(json.dumps(out))
PY
)
emit "$summary"
