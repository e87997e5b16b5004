#!/usr/bin/env python3
"""Summarise a metadata matrix (JSON lines from `run-vhost.sh --matrix
metadata`, each with "round", "phase", "driver" and "label"): for each
driver and phase, keelfsd's ops/s and daemon CPU per op against the
stronger of virtiofsd's two configurations, as medians over rounds of
the per-round ratios.

Usage: bench/meta_summary.py RESULTS.json [--system keelfsd] [--peers virtiofsd virtiofsd-pool]

The host mount's matrix (run-seeds.sh --matrix metadata) compares
keelfs-fuse with ext4 and xfs: --system keelfs-fuse --peers ext4. There
the CPU per operation is the whole of it: the caller's (its system
calls: all of ext4's work, and the FUSE client's) and the daemon's.

The stronger peer is chosen per round: the one with more ops/s in that
round, and its CPU per op is the one compared. A ratio is within one
round, so machine noise hits both sides alike.
"""
import argparse
import collections
import json
import statistics

PEERS = ("virtiofsd", "virtiofsd-pool")
PHASES = ("create", "stat-cold", "stat-warm", "open-read-close", "readdirplus", "readdir", "rename", "mkdir-rmdir",
          "unlink", "trace")


def load(path):
    """{(driver, phase): {round: {label: line}}}."""
    cells = collections.defaultdict(lambda: collections.defaultdict(dict))
    with open(path) as f:
        for text in f:
            text = text.strip()
            if not text.startswith("{"):
                continue
            line = json.loads(text)
            if "phase" not in line:
                continue
            cells[(line.get("driver", "sleep"), line["phase"])][line["round"]][line["label"]] = line
    return cells


def cpu_of(line):
    """CPU per op: the daemon's for vhost; the caller's and the daemon's
    for posix-meta."""
    if line.get("bench") == "posix-meta":
        return line.get("bench_cpu_us_per_op", 0) + line.get("daemon_cpu_us_per_op", 0)
    return line.get("daemon_cpu_us_per_op")


def ratios(rounds, system, peer_names):
    """Per round: (ops ratio, CPU-per-op ratio, the stronger peer)."""
    out = []
    for by_label in rounds.values():
        ours = by_label.get(system)
        peers = [by_label[p] for p in peer_names if p in by_label]
        if ours is None or not peers:
            continue
        best = max(peers, key=lambda p: p["iops"])
        ops = ours["iops"] / best["iops"] if best["iops"] else float("nan")
        cpu_ours, cpu_peer = cpu_of(ours), cpu_of(best)
        cpu = cpu_ours / cpu_peer if cpu_ours is not None and cpu_peer else float("nan")
        out.append((ops, cpu, best["label"]))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results")
    parser.add_argument("--system", default="keelfsd")
    parser.add_argument("--peers", nargs="+", default=list(PEERS))
    args = parser.parse_args()
    cells = load(args.results)
    print(f"{args.system} / the stronger of {' and '.join(args.peers)} per round: medians of per-round ratios")
    print(f"{'driver':6} {'phase':16} {'rounds':>6} {'ops/s':>7} {'cpu/op':>7}  "
          f"{'ours ops/s':>10} {'peer ops/s':>10} {'ours cpu':>8} {'peer cpu':>8}  stronger peer")
    order = {p: i for i, p in enumerate(PHASES)}
    for (driver, phase) in sorted(cells, key=lambda k: (k[0], order.get(k[1], 99))):
        rounds = cells[(driver, phase)]
        rs = ratios(rounds, args.system, args.peers)
        if not rs:
            continue

        def median_of(label_pick, value):
            values = [value(label_pick(by)) for by in rounds.values() if label_pick(by) is not None]
            values = [v for v in values if v is not None]
            return statistics.median(values) if values else float("nan")

        ours = lambda by: by.get(args.system)  # noqa: E731
        peer = lambda by: max((by[p] for p in args.peers if p in by), key=lambda p: p["iops"], default=None)  # noqa: E731
        stronger = collections.Counter(r[2] for r in rs).most_common(1)[0][0]
        print(f"{driver:6} {phase:16} {len(rs):>6} {statistics.median(r[0] for r in rs):>6.2f}x "
              f"{statistics.median(r[1] for r in rs):>6.2f}x  "
              f"{median_of(ours, lambda x: x['iops']):>10.0f} {median_of(peer, lambda x: x['iops']):>10.0f} "
              f"{median_of(ours, cpu_of):>8.2f} {median_of(peer, cpu_of):>8.2f}  {stronger}")


if __name__ == "__main__":
    main()
