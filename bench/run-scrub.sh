#!/usr/bin/env bash
# A scrub's rate and cost (issue 38's goals: an 8 GiB image at its set
# rate within 5%, at most 10% of a core at 100 MiB/s). One keelfsd with
# the defaults a user gets serves an image made with --data-checksums in
# /dev/shm; keelfs-bench fills a file of --data through the vhost-user
# driver; then the daemon's CPU is sampled idle for as long as the scrub
# should take, and again while `scrub_start` runs at --mib-per-sec to its
# end. The daemon's CPU is charged to the scrub only above its idle
# share (its poller's). One JSON line: the scrub's time against the set
# rate, and the daemon's CPU share, idle and scrubbing.
#
# usage: bench/run-scrub.sh [OUT.jsonl] [--data GIB] [--mib-per-sec N]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out="" data_gib=8 rate=100
while (($#)); do
  case $1 in
    --data) data_gib=$2; shift 2 ;;
    --mib-per-sec) rate=$2; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) out=$1; shift ;;
  esac
done
keelfsd=${KEELFSD:-$repo/target/release/keelfsd}
bench=${KEELFS_BENCH:-$repo/target/release/keelfs-bench}
for tool in "$keelfsd" "$bench"; do
  [[ -x $tool ]] || { echo "run-scrub.sh: $tool is missing (cargo build --release)" >&2; exit 2; }
done
command -v python3 >/dev/null || { echo "run-scrub.sh: python3 is missing" >&2; exit 2; }
work=$(mktemp -d /dev/shm/keelfs-scrub.XXXXXX)
daemon=""
cleanup() {
  if [[ -n $daemon ]]; then kill "$daemon" 2>/dev/null || true; wait "$daemon" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

"$keelfsd" mkfs "$work/img" --size "$((data_gib + 2))G" --data-checksums >/dev/null
"$keelfsd" serve --device "$work/img" --socket "$work/fs.sock" --rpc "$work/rpc.sock" 2>"$work/keelfsd.log" &
daemon=$!
for _ in $(seq 300); do [[ -S $work/rpc.sock && -S $work/fs.sock ]] && break; sleep 0.05; done
[[ -S $work/rpc.sock ]] || { echo "run-scrub.sh: keelfsd never listened" >&2; cat "$work/keelfsd.log" >&2; exit 1; }
"$bench" vhost --socket "$work/fs.sock" --workload dio-read --file-size "${data_gib}G" --seconds 1 --json >/dev/null

python3 - "$daemon" "$rate" "$data_gib" "$keelfsd" "$work/rpc.sock" <<'KEELFS_SCRIPT_END' | tee -a "${out:-/dev/null}"
import json, os, subprocess, sys, time
pid, rate, data_gib, keelfsd, sock = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
tick = os.sysconf("SC_CLK_TCK")
def tree(root):
    """root and its descendants (the sandboxed daemon is a child)."""
    children = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        children.setdefault(ppid, []).append(int(p))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out
def cpu_s():
    total = 0
    for p in tree(pid):
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                fields = open(f"/proc/{p}/task/{task}/stat").read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
        except OSError:
            pass
    return total / tick
def rpc(method, params):
    out = subprocess.run([keelfsd, "rpc", method, json.dumps(params), "--rpc", sock], check=True, capture_output=True)
    return json.loads(out.stdout)
expected_s = data_gib * 1024 / rate
idle_s = min(expected_s, 30)
c0, t0 = cpu_s(), time.monotonic()
time.sleep(idle_s)
idle_share = (cpu_s() - c0) / (time.monotonic() - t0)
c0, t0 = cpu_s(), time.monotonic()
rpc("scrub_start", {"export": "keelfs", "mib_per_sec": rate})
while True:
    status = rpc("scrub_status", {"export": "keelfs"})
    if status["state"] != "running":
        break
    time.sleep(0.05)
took = time.monotonic() - t0
scrub_share = (cpu_s() - c0) / took
mib = status["bytes_checked"] / (1 << 20)
print(json.dumps({
    "bench": "scrub", "state": status["state"], "errors": status["errors"], "mib_checked": round(mib, 1),
    "mib_per_sec_set": rate, "mib_per_sec_got": round(mib / took, 2), "rate_ratio": round(mib / took / rate, 4),
    "took_s": round(took, 2), "scrub_ns_by_daemon": status["elapsed_ns"],
    "daemon_cpu_share_idle": round(idle_share, 4), "daemon_cpu_share_scrubbing": round(scrub_share, 4),
    "scrub_cpu_share": round(scrub_share - idle_share, 4),
}))
KEELFS_SCRIPT_END
