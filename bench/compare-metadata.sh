#!/usr/bin/env bash
# Metadata at scale, two builds side by side on one image: mount time and
# memory (keelfs-bench core --workload metadata-mount) and fsck's time and
# peak RSS, each build in turn, rounds interleaved (the order alternates)
# so that both see the same machine noise. The image is filled once, by
# the new build, with N files in directories of 1,000; both builds
# read the same on-disk format. One JSON object per line, tagged with
# "build" and "round", then the median ratios new/old. Files are empty
# unless --file-bytes N writes N bytes to each (only the new build fills
# the image, so the old one needs no such option).
#
# Usage: bench/compare-metadata.sh OLD_BIN_DIR NEW_BIN_DIR [--files N] [--rounds N]
#                                  [--file-bytes N] [OUT.json]
#   where each BIN_DIR holds a release keelfsd and keelfs-bench
#   (e.g. target/release of a checkout of each commit).
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $# -ge 2 ]] || { sed -n '12,15p' "$0" >&2; exit 2; }
old=$1 new=$2
shift 2
files=1000000 rounds=3 file_bytes=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --files) files=$2; shift 2 ;;
    --file-bytes) file_bytes=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    *) break ;;
  esac
done
out=${1:-/dev/null}
[[ -x /usr/bin/time ]] || { echo "compare-metadata: /usr/bin/time is missing (apt-get install time)" >&2; exit 2; }
for d in "$old" "$new"; do
  for b in keelfsd keelfs-bench; do
    [[ -x $d/$b ]] || { echo "compare-metadata: $d/$b is not an executable" >&2; exit 2; }
  done
done
work=$(mktemp -d /dev/shm/keelfs-compare-metadata.XXXXXX)
trap 'rm -rf "$work"' EXIT
img=$work/meta.img
# One device size for every run, fill and mounts alike (as keelfs-bench
# sizes metadata-fill: a KiB of metadata per file and its data blocks,
# an eighth more, and 64 MiB).
per_file=$((1024 + (file_bytes + 4095) / 4096 * 4096))
size=$((files * per_file + files * per_file / 8 + (64 << 20)))

# tagged BUILD ROUND: prefix each JSON line on stdin with the two tags.
tagged() { sed "s/^{/{\"build\":\"$1\",\"round\":$2,/"; }

: >"$out"
"$new/keelfs-bench" core --workload metadata-fill --backend uring --path "$img" --entries "$files" \
  --size "$size" --file-bytes "$file_bytes" --json |
  tagged new 0 | tee -a "$out"
for ((round = 1; round <= rounds; round++)); do
  order="old new"
  ((round % 2 == 0)) && order="new old"
  for build in $order; do
    dir=$old
    [[ $build == new ]] && dir=$new
    "$dir/keelfs-bench" core --workload metadata-mount --backend uring --path "$img" --entries "$files" \
      --size "$size" --json |
      tagged "$build" "$round" | tee -a "$out"
    /usr/bin/time -f '%e %M' -o "$work/fsck.time" "$dir/keelfsd" fsck "$img" >"$work/fsck.log" 2>&1 ||
      { echo "compare-metadata: $build's fsck found damage:" >&2; cat "$work/fsck.log" >&2; exit 1; }
    read -r fsck_s fsck_kib <"$work/fsck.time"
    printf '{"workload":"fsck","files":%d,"fsck_s":%s,"fsck_rss_mib":%d}\n' "$files" "$fsck_s" $((fsck_kib / 1024)) |
      tagged "$build" "$round" | tee -a "$out"
  done
done

# The median over rounds of each round's new/old ratio.
python3 - "$out" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = {(r["build"], r["round"], r["workload"]): r for r in rows}
rounds = sorted({r["round"] for r in rows if r["round"] > 0})
for workload, key in [("metadata-mount", "mount_s"), ("metadata-mount", "rss_bytes_per_inode"),
                      ("fsck", "fsck_s"), ("fsck", "fsck_rss_mib")]:
    ratios = [by[("new", n, workload)][key] / by[("old", n, workload)][key] for n in rounds]
    olds = [by[("old", n, workload)][key] for n in rounds]
    news = [by[("new", n, workload)][key] for n in rounds]
    print(json.dumps({"summary": key, "old_median": statistics.median(olds), "new_median": statistics.median(news),
                      "ratio_new_old": round(statistics.median(ratios), 3)}))
EOF
