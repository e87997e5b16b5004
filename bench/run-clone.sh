#!/usr/bin/env bash
# A clone of a large file with GNU cp, on keelfs's host mount (FUSE, where
# cp's copy_file_range reaches keelfs as FUSE_COPY_FILE_RANGE and keelfs
# shares the whole blocks, issue 37) and on XFS with reflink (cp's FICLONE),
# each on an image in /dev/shm of the same size, rounds alternating.
# Records per round the seconds cp took and the data blocks the copy took
# (df's used KiB before and after), then the clone's data read back
# through each mount compared with the source (cmp). One JSON line per
# round, and a summary with the ratio keelfs/XFS of the medians.
#
# --dir puts both images in another directory than /dev/shm (a 10 GiB
# clone needs two 12 GiB images: more than this machine's RAM).
#
# usage: bench/run-clone.sh [OUT.jsonl] [--gib N] [--rounds N] [--dir DIR]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out="" gib=4 rounds=3 dir=/dev/shm
while (($#)); do
  case $1 in
    --gib) gib=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) out=$1; shift ;;
  esac
done
keelfsd=${KEELFSD:-$repo/target/release/keelfsd}
[[ -x $keelfsd ]] || { echo "run-clone.sh: $keelfsd is missing (cargo build --release -p keelfsd)" >&2; exit 2; }
for tool in mkfs.xfs cp cmp python3; do
  command -v "$tool" >/dev/null || { echo "run-clone.sh: $tool is missing" >&2; exit 2; }
done
work=$(mktemp -d "$dir/keelfs-clone.XXXXXX")
daemon=""
cleanup() {
  if [[ -n $daemon ]]; then kill "$daemon" 2>/dev/null || true; wait "$daemon" 2>/dev/null || true; fi
  umount "$work/xfs" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

emit() {
  echo "$1"
  echo "$1" >>"$work/rows.jsonl"
  if [[ -n $out ]]; then echo "$1" >>"$out"; fi
}

size=$(((gib + 2) * 1024))M
mkdir -p "$work/keelfs" "$work/xfs"
"$keelfsd" mkfs "$work/keelfs.img" --size "$size" --force >/dev/null
"$keelfsd" serve --device "$work/keelfs.img" --fuse-mount "$work/keelfs" 2>"$work/keelfsd.log" &
daemon=$!
for _ in $(seq 300); do mountpoint -q "$work/keelfs" && break; sleep 0.05; done
mountpoint -q "$work/keelfs" || { echo "run-clone.sh: keelfsd never mounted" >&2; exit 1; }
truncate -s "$size" "$work/xfs.img"
mkfs.xfs -q -m reflink=1 "$work/xfs.img"
mount -o loop "$work/xfs.img" "$work/xfs"
for fs in keelfs xfs; do
  dd if=/dev/urandom of="$work/$fs/source" bs=1M count=$((gib * 1024)) status=none conv=fsync
done

used_kib() { df -k --output=used "$1" | tail -1 | tr -d ' '; }

for round in $(seq "$rounds"); do
  for fs in keelfs xfs; do
    rm -f "$work/$fs/copy"
    sync
    before=$(used_kib "$work/$fs")
    start=$(date +%s.%N)
    cp "$work/$fs/source" "$work/$fs/copy"
    sync
    seconds=$(python3 -c "import time; print(round(time.time() - $start, 3))")
    after=$(used_kib "$work/$fs")
    same=true
    cmp -s "$work/$fs/source" "$work/$fs/copy" || same=false
    emit "{\"bench\":\"clone\",\"fs\":\"$fs\",\"round\":$round,\"gib\":$gib,\"cp_seconds\":$seconds,\"used_kib_added\":$((after - before)),\"copy_matches\":$same}"
  done
done
summary=$(python3 - "$work/rows.jsonl" <<'KEELFS_SCRIPT_END'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
med = {fs: statistics.median(r["cp_seconds"] for r in rows if r["fs"] == fs) for fs in ("keelfs", "xfs")}
print(json.dumps({"bench": "clone", "summary": True, "gib": rows[0]["gib"], "median_cp_seconds": med,
                  "keelfs_over_xfs": round(med["keelfs"] / med["xfs"], 2)}))
KEELFS_SCRIPT_END
)
emit "$summary"
