#!/usr/bin/env bash
# QoS per export in wall-clock rates (issue 21; moved out of the tests by
# issue 35, whose tests assert the limiter in virtual time). One keelfsd,
# ONE reactor, two exports each with a host FUSE mount on images in
# /dev/shm; export A limited to LIMIT IOPS by its config. fio reads 4 KiB
# at random, O_DIRECT, iodepth 16, from a 128 MiB file on each.
#
# Each round, interleaved:
#   alone:   fio on A alone, limited by keelfsd;
#   paced:   A unlimited in keelfsd, fio itself pacing A at LIMIT IOPS
#            (--rate_iops), beside fio on B: the same load on the reactor
#            without the limiter;
#   limited: A limited by keelfsd, beside fio on B.
# Reports A's IOPS as a share of its limit (alone and beside B), what B
# keeps beside the limited A as a share of what it gets beside the paced
# A, and the reactor's sleeps per second with A alone (a limiter that kept
# the reactor polling would leave it none). One JSON line per phase and
# round, then a summary; with OUT, appended there too.
#
# usage: bench/run-qos.sh [OUT.json] [--rounds N] [--limit IOPS] [--runtime S]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=""
rounds=3
limit=5000
runtime=10
while (($#)); do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --limit) limit=$2; shift 2 ;;
    --runtime) runtime=$2; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) out=$1; shift ;;
  esac
done
keelfsd=$repo/target/release/keelfsd
[[ -x $keelfsd ]] || { echo "run-qos.sh: $keelfsd is missing (cargo build --release)" >&2; exit 2; }
for tool in fio python3 dd; do
  command -v "$tool" >/dev/null || { echo "run-qos.sh: $tool is missing (scripts/setup.sh)" >&2; exit 2; }
done
work=$(mktemp -d /dev/shm/keelfs-qos.XXXXXX)
daemon=""
cleanup() {
  for m in a b; do mountpoint -q "$work/$m" && umount "$work/$m"; done
  if [[ -n $daemon ]]; then kill "$daemon" 2>/dev/null || true; wait "$daemon" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$work/a" "$work/b"

emit() {
  echo "$1"
  echo "$1" >>"$work/lines.json"
  if [[ -n $out ]]; then echo "$1" >>"$out"; fi
}

for m in a b; do "$keelfsd" mkfs "$work/$m.img" --size 1G >/dev/null; done
cat >"$work/keelfsd.toml" <<EOF
[daemon]
reactors = 1
rpc_socket = "$work/rpc.sock"
[[device]]
name = "a"
path = "$work/a.img"
[[device]]
name = "b"
path = "$work/b.img"
[[export]]
tag = "a"
device = "a"
fuse_mount = "$work/a"
cache = "none"
[export.qos]
iops = $limit
[[export]]
tag = "b"
device = "b"
fuse_mount = "$work/b"
cache = "none"
EOF
"$keelfsd" serve --config "$work/keelfsd.toml" >"$work/keelfsd.log" 2>&1 &
daemon=$!
for _ in $(seq 1 100); do
  mountpoint -q "$work/a" && mountpoint -q "$work/b" && break
  sleep 0.1
done
mountpoint -q "$work/b" || { echo "run-qos.sh: keelfsd did not mount" >&2; cat "$work/keelfsd.log" >&2; exit 1; }
for m in a b; do dd if=/dev/urandom of="$work/$m/f" bs=1M count=128 oflag=direct status=none; done

set_iops() { "$keelfsd" rpc export_set_qos "{\"tag\": \"a\", \"iops\": $1}" --rpc "$work/rpc.sock" >/dev/null; }
sleeps() { "$keelfsd" stats --rpc "$work/rpc.sock" | python3 -c 'import json,sys; print(json.load(sys.stdin)["reactors"][0]["sleeps"])'; }
# fio_start NAME FILE [ARGS...]: fio in the background, its JSON to $work/NAME.json.
fio_start() {
  local name=$1 file=$2
  shift 2
  fio --name="$name" --filename="$file" --size=128M --rw=randread --bs=4k --direct=1 --ioengine=libaio \
    --iodepth=16 --time_based --runtime="$runtime" --ramp_time=2 --output-format=json "$@" >"$work/$name.json" &
}
iops_of() { python3 -c 'import json,sys; t=open(sys.argv[1]).read(); print(round(json.loads(t[t.index("{"):])["jobs"][0]["read"]["iops"]))' "$work/$1.json"; }

for r in $(seq 1 "$rounds"); do
  before=$(sleeps)
  t0=$EPOCHREALTIME
  fio_start alone "$work/a/f"
  wait $!
  after=$(sleeps)
  seconds=$(python3 -c "print($EPOCHREALTIME - $t0)")
  emit "{\"bench\":\"qos\",\"phase\":\"alone\",\"round\":$r,\"limit_iops\":$limit,\"a_iops\":$(iops_of alone),\"reactor_sleeps_per_s\":$(python3 -c "print(round(($after - $before) / $seconds))")}"

  set_iops 0
  fio_start paced "$work/a/f" --rate_iops="$limit"
  pa=$!
  fio_start b_paced "$work/b/f"
  wait "$pa" $!
  emit "{\"bench\":\"qos\",\"phase\":\"paced\",\"round\":$r,\"limit_iops\":$limit,\"a_iops\":$(iops_of paced),\"b_iops\":$(iops_of b_paced)}"

  set_iops "$limit"
  fio_start limited "$work/a/f"
  la=$!
  fio_start b_limited "$work/b/f"
  wait "$la" $!
  emit "{\"bench\":\"qos\",\"phase\":\"limited\",\"round\":$r,\"limit_iops\":$limit,\"a_iops\":$(iops_of limited),\"b_iops\":$(iops_of b_limited)}"
done

python3 - "$work/lines.json" <<'PY' | while read -r line; do emit "$line"; done
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def of(phase, key):
    return [r[key] for r in rows if r["phase"] == phase]
limit = rows[0]["limit_iops"]
b_shares = [l / p for l, p in zip(of("limited", "b_iops"), of("paced", "b_iops"))]
print(json.dumps({
    "bench": "qos-summary",
    "rounds": len(b_shares),
    "a_alone_share_of_limit": [round(a / limit, 3) for a in of("alone", "a_iops")],
    "a_beside_b_share_of_limit": [round(a / limit, 3) for a in of("limited", "a_iops")],
    "b_beside_limited_over_beside_paced": [round(s, 3) for s in b_shares],
    "reactor_sleeps_per_s_a_alone": of("alone", "reactor_sleeps_per_s"),
}))
PY
