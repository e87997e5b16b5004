#!/usr/bin/env python3
"""Regression check: compare two result files of the same bench (JSON
lines from run-vhost.sh, run-seeds.sh, run-core.sh or run-bdev.sh) and
flag every (workload, system) whose median IOPS fell by more than the
threshold. Exit 1 if any did.

Usage: bench/compare.py OLD.json NEW.json [--threshold 0.15] [--field iops]

Medians over rounds, as the runs interleave systems: on a shared, noisy
machine compare ratios within a run first, and treat this as a tripwire.
"""
import argparse
import collections
import json
import statistics
import sys


def medians(path, field):
    groups = collections.defaultdict(list)
    with open(path) as f:
        for line in f:
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if r.get(field) is None:
                continue
            system = str(r.get("system") or r.get("label") or r.get("backend") or "")
            # Results from a driver that waits differently are another
            # experiment (files before 2026-12-01 all had a spinning one).
            # Before then, "keelfsd" was the io_uring backend on a tmpfs
            # file, which is "keelfsd-tmpfs" now.
            if r.get("bench") == "vhost" and "driver_waits" not in r and system == "keelfsd":
                system = "keelfsd-tmpfs"
            if r.get("bench") == "vhost" and r.get("driver_waits", "spin") != "spin":
                system += " (" + r["driver_waits"] + ")"
            key = (str(r.get("workload") or r.get("rw")), system)
            groups[key].append(float(r[field]))
    return {k: statistics.median(v) for k, v in groups.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--threshold", type=float, default=0.15)
    ap.add_argument("--field", default="iops")
    args = ap.parse_args()
    old, new = medians(args.old, args.field), medians(args.new, args.field)
    regressed = 0
    for key in sorted(set(old) & set(new)):
        o, n = old[key], new[key]
        change = (n - o) / o if o else 0.0
        flag = "REGRESSED" if change < -args.threshold else ""
        regressed += bool(flag)
        print(f"{key[0]:24s} {key[1]:14s} {o:>12,.0f} -> {n:>12,.0f}  {change:+7.1%} {flag}")
    for key in sorted(set(old) ^ set(new)):
        print(f"{key[0]:24s} {key[1]:14s} only in {'old' if key in old else 'new'}")
    sys.exit(1 if regressed else 0)


if __name__ == "__main__":
    main()
