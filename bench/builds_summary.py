#!/usr/bin/env python3
"""Summarise two builds side by side (JSON lines from
`run-seeds.sh --builds "OLD NEW"`, whose keelfs systems end in @old and
@new): for each workload, driver and transport, the median ratio new/old
over rounds of IOPS and of keelfsd's CPU per operation, each ratio taken
within one round, so that machine noise hits both builds alike. ext4's
median IOPS is listed for scale.

Usage: bench/builds_summary.py RESULTS.json
"""
import collections
import json
import statistics
import sys


def load(path):
    """{(workload, driver, system): {round: line}}, and ext4's IOPS."""
    runs = collections.defaultdict(dict)
    ext4 = collections.defaultdict(list)
    with open(path) as f:
        for text in f:
            line = json.loads(text)
            key = (line["workload"], line.get("driver", "sleep"))
            if line["system"] == "ext4":
                ext4[key].append(line["iops"])
            elif "@" in line["system"]:
                runs[key + (line["system"],)][line["round"]] = line
    return runs, ext4


def ratio(runs, key, field):
    """Median over rounds of new/old, or None without both."""
    workload, driver, old = key
    new = runs.get((workload, driver, old.replace("@old", "@new")), {})
    values = [
        new[r][field] / line[field]
        for r, line in runs[key].items()
        if r in new and line.get(field) and new[r].get(field) is not None
    ]
    return round(statistics.median(values), 3) if values else None


def main():
    runs, ext4 = load(sys.argv[1])
    print("workload driver system: new/old IOPS, new/old CPU per op (rounds); ext4 IOPS")
    for key in sorted(k for k in runs if k[2].endswith("@old")):
        workload, driver, system = key
        iops, cpu = ratio(runs, key, "iops"), ratio(runs, key, "daemon_cpu_us_per_op")
        peer = statistics.median(ext4[(workload, driver)]) if ext4[(workload, driver)] else None
        print(f"{workload} {driver} {system[:-4]}: {iops}x, {cpu}x ({len(runs[key])}); ext4 {peer}")


if __name__ == "__main__":
    main()
