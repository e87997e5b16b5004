#!/usr/bin/env python3
"""Summarise a poll-mode matrix (JSON lines from run-vhost.sh or
run-seeds.sh whose keelfsd results carry "poll_mode", "setup" and
"driver"): for each workload, setup and driver, every poll mode's median
over rounds, and its ratio to the better of `busy` and `interrupt` (the
two fixed policies that `adaptive`, the default, chooses between).

Usage: bench/poll_summary.py RESULTS.json [--field iops]

Lines without a poll_mode (peers such as ext4, the device limit) are
listed apart with their medians, for scale. "poll-state" lines (what
each adaptive run's reactor ended in: regime, reason, switches) are
counted per cell beneath the table. A ratio is within one run,
so machine noise hits both sides alike; on a shared machine treat small
differences as noise.
"""
import argparse
import collections
import json
import statistics

MODES = ("busy", "adaptive", "interrupt")


def load(path, field):
    """{(workload, setup, driver): {mode: [values]}}, and the peers'."""
    matrix = collections.defaultdict(lambda: collections.defaultdict(list))
    peers = collections.defaultdict(list)
    with open(path) as f:
        for line in f:
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if r.get(field) is None:
                continue
            workload = str(r.get("workload") or r.get("rw"))
            if "poll_mode" in r:
                key = (workload, r.get("setup", "?"), r.get("driver", "?"))
                matrix[key][r["poll_mode"]].append(float(r[field]))
            else:
                system = str(r.get("system") or r.get("label") or "")
                if "driver" in r:
                    system += f" ({r['driver']})"
                peers[(workload, system)].append(float(r[field]))
    return matrix, peers


def adaptive_endings(path):
    """{(workload, setup, driver): Counter of "regime (reason)"} over the
    adaptive runs' poll-state lines."""
    endings = collections.defaultdict(collections.Counter)
    with open(path) as f:
        for line in f:
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if r.get("bench") != "poll-state" or r.get("poll_mode") != "adaptive":
                continue
            key = (str(r.get("workload")), r.get("setup", "?"), r.get("driver", "?"))
            for poll in r.get("reactors") or []:
                if poll:
                    endings[key][f"{poll.get('regime')} ({poll.get('reason')}, {poll.get('switches')} sw)"] += 1
    return endings


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results")
    p.add_argument("--field", default="iops")
    a = p.parse_args()
    matrix, peers = load(a.results, a.field)
    print(f"{a.field}: median per poll mode, and its ratio to the best of busy/interrupt")
    print(f"{'workload':<22} {'setup':<15} {'driver':<7} " + " ".join(f"{m:>20}" for m in MODES))
    for (workload, setup, driver), modes in sorted(matrix.items()):
        med = {m: statistics.median(v) for m, v in modes.items() if v}
        best = max([med[m] for m in ("busy", "interrupt") if m in med] or [0.0])
        cells = []
        for m in MODES:
            if m not in med:
                cells.append(f"{'-':>20}")
            elif best > 0:
                cells.append(f"{med[m]:>12.0f} ({med[m] / best:4.2f}x)")
            else:
                cells.append(f"{med[m]:>12.0f} (  - )")
        print(f"{workload:<22} {setup:<15} {driver:<7} " + " ".join(cells))
    for (workload, system), values in sorted(peers.items()):
        print(f"{workload:<22} {system:<23} {statistics.median(values):>12.0f} (peer, n={len(values)})")
    endings = adaptive_endings(a.results)
    if endings:
        print("adaptive runs ended in:")
    for (workload, setup, driver), counts in sorted(endings.items()):
        ended = ", ".join(f"{n}x {what}" for what, n in counts.most_common())
        print(f"{workload:<22} {setup:<15} {driver:<7} {ended}")


if __name__ == "__main__":
    main()
