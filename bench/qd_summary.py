#!/usr/bin/env python3
"""Summarise a queue-depth sweep of bench/run-vhost.sh --matrix systems.

Reads the JSON lines of one or more runs (each at one --depth and one
--driver) and prints, per driver, depth and workload, keelfsd against the
stronger of the virtiofsd systems (the one with more IOPS in the medians):
the IOPS ratio, the daemon CPU per request ratio, and keelfsd's p99/p50.
Medians over rounds; a ratio is the ratio of medians.

Usage: bench/qd_summary.py RESULTS.json [MORE.json ...]
"""
import json
import statistics
import sys
from collections import defaultdict

PEERS = ("virtiofsd", "virtiofsd-pool")
SUBJECT = "keelfsd"


def load(paths):
    cells = defaultdict(lambda: defaultdict(list))
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                d = json.loads(line)
                if d.get("bench") != "vhost" or d.get("label") not in PEERS + (SUBJECT,):
                    continue
                key = (d["driver"], d["iodepth"], d["workload"])
                cells[key][d["label"]].append(d)
    return cells


def median(rows, field):
    return statistics.median(r[field] for r in rows)


def main(paths):
    if not paths:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    cells = load(paths)
    print(f"{'driver':7}{'QD':>4}  {'workload':14}{'keelfsd':>10}{'peer':>16}{'peer IOPS':>11}"
          f"{'IOPS x':>8}{'CPU/op x':>10}{'p99/p50':>9}")
    for (driver, depth, workload) in sorted(cells):
        systems = cells[(driver, depth, workload)]
        if SUBJECT not in systems or not any(p in systems for p in PEERS):
            continue
        ours = systems[SUBJECT]
        peer = max((p for p in PEERS if p in systems), key=lambda p: median(systems[p], "iops"))
        theirs = systems[peer]
        iops_ratio = median(ours, "iops") / median(theirs, "iops")
        cpu_ratio = median(ours, "daemon_cpu_us_per_op") / median(theirs, "daemon_cpu_us_per_op")
        tail = median(ours, "lat_us_p99") / median(ours, "lat_us_p50")
        print(f"{driver:7}{depth:>4}  {workload:14}{median(ours, 'iops'):>10.0f}{peer:>16}"
              f"{median(theirs, 'iops'):>11.0f}{iops_ratio:>8.2f}{cpu_ratio:>10.2f}{tail:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
