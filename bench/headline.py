#!/usr/bin/env python3
"""The headline tables of bench/RESULTS.md, generated from the raw JSON
lines of bench/run-vhost.sh, so that no figure there is typed by hand.

RESULTS.md holds each generated block between two markers; the first
names the raw file it was made from:

    <!-- headline: bench/results/vhost-DATE.json -->
    ...
    <!-- /headline -->

Usage:
  bench/headline.py RESULTS.json          print the tables
  bench/headline.py --update RESULTS.md   regenerate the block in place
  bench/headline.py --check RESULTS.md    exit 1 if the block differs
                                          from what its raw file gives

Figures: IOPS and CPU are medians over rounds; a ratio is the median of
the per-round ratios (each round runs every system back to back, so a
ratio compares runs that saw the same machine noise).
"""
import argparse
import collections
import json
import re
import statistics
import sys

WORKLOADS = [
    ("DioOverwrite", "dio-overwrite 4k"),
    ("DioRandrw", "dio-randrw 4k 50/50"),
    ("AioAppend", "aio-append 4k"),
    ("BufferedRandrw", "buffered-randrw 8k"),
    ("ByteWrites", "byte-writes 1 B"),
]
FAIR, PEER = "keelfsd", "virtiofsd"
BEGIN = re.compile(r"<!-- headline: (\S+) -->")
END = "<!-- /headline -->"


def load(path):
    """{(label, workload): {round: line}} and device lines by label."""
    runs = collections.defaultdict(dict)
    devices = collections.defaultdict(dict)
    with open(path) as f:
        for text in f:
            if not text.startswith("{"):
                continue
            line = json.loads(text)
            if line.get("bench") == "vhost":
                runs[(line["label"], line["workload"])][line["round"]] = line
            elif line.get("bench") == "bdev":
                devices[line["label"]][line["round"]] = line
    return runs, devices


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def field(lines, name):
    return median([line.get(name) for line in lines.values()])


def ratio(a, b, name, invert=False):
    """Median over the rounds both ran of a[name] / b[name]."""
    per_round = []
    for rnd in sorted(set(a) & set(b)):
        x, y = a[rnd].get(name), b[rnd].get(name)
        if x and y:
            per_round.append(y / x if invert else x / y)
    return median(per_round)


def kilo(v):
    if v is None:
        return "—"
    if v >= 1_000_000:
        return f"{v / 1e6:,.2f}M"
    return f"{v / 1000:,.0f}k" if v >= 100_000 else f"{v / 1000:,.1f}k"


def num(v, digits=2, suffix=""):
    return "—" if v is None else f"{v:,.{digits}f}{suffix}"


def fair_table(runs, ours, peer):
    out = [
        f"| workload (QD) | {ours} IOPS | {peer} IOPS | **IOPS ratio** | {ours} CPU/op | {peer} CPU/op "
        f"| **CPU/op ratio** | other CPU/op: {ours}, {peer} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, name in WORKLOADS:
        k, v = runs.get((ours, key), {}), runs.get((peer, key), {})
        if not k or not v:
            continue
        qd = next(iter(k.values()))["iodepth"]
        out.append(
            f"| {name} ({qd}) | {kilo(field(k, 'iops'))} | {kilo(field(v, 'iops'))} "
            f"| **{num(ratio(k, v, 'iops'))}x** | {num(field(k, 'daemon_cpu_us_per_op'), suffix=' µs')} "
            f"| {num(field(v, 'daemon_cpu_us_per_op'), suffix=' µs')} "
            f"| **{num(ratio(k, v, 'daemon_cpu_us_per_op'))}x** "
            f"| {num(field(k, 'other_cpu_us_per_op'))}, {num(field(v, 'other_cpu_us_per_op'))} µs |"
        )
    return out


def device_lines(runs, devices):
    """The device limits, and the overwrites that ran on each device as a
    share of fio's figure there in the same round."""
    out = []
    for label, system, where in (
        ("device-loop", FAIR, "a loop device over a RAM image"),
        ("device", "keelfsd-pmem", "the RAM image"),
    ):
        d = devices.get(label)
        if not d:
            continue
        line = (
            f"- device limit on {where} (4k random writes, QD32): fio io_uring {kilo(field(d, 'fio_iops'))}, "
            f"keelfs's block layer {kilo(field(d, 'iops'))}"
        )
        overwrites = runs.get((system, "DioOverwrite"))
        if overwrites:
            share = ratio(overwrites, {r: {"iops": x.get("fio_iops")} for r, x in d.items()}, "iops")
            line += f"; {system}'s direct overwrites reach **{num(share)}x** of fio's figure"
        out.append(line)
    return out


FAIR_PAIRS = [(FAIR, PEER), (FAIR, "virtiofsd-pool"), ("keelfsd-irq", PEER), ("keelfsd-irq", "virtiofsd-pool")]


def latency_table(runs):
    out = [
        "| workload | system | p50 µs | p99 µs | p99.9 µs | **p99 / p50** |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for key, name in WORKLOADS:
        for label in (FAIR, "keelfsd-irq", PEER, "virtiofsd-pool", "keelfsd-tmpfs", "keelfsd-pmem"):
            lines = runs.get((label, key))
            if not lines:
                continue
            p50, p99 = field(lines, "lat_us_p50"), field(lines, "lat_us_p99")
            p999 = median(
                [line.get("lat_us_p999", line.get("lat_us_percentiles", {}).get("99.900000")) for line in lines.values()]
            )
            spread = p99 / p50 if p50 and p99 else None
            out.append(f"| {name} | {label} | {num(p50, 1)} | {num(p99, 1)} | {num(p999, 1)} | **{num(spread, 1)}x** |")
    return out


def other_devices_table(runs, devices):
    out = [
        "| workload | keelfsd-tmpfs IOPS | keelfsd-pmem IOPS | tmpfs / virtiofsd | pmem / virtiofsd "
        "| pmem / device limit | tmpfs CPU/op | pmem CPU/op |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    device = devices.get("device", {})
    for key, name in WORKLOADS:
        t, p, v = runs.get(("keelfsd-tmpfs", key), {}), runs.get(("keelfsd-pmem", key), {}), runs.get((PEER, key), {})
        if not t and not p:
            continue
        limit = None
        if key == "DioOverwrite" and p and device:
            limit = ratio(p, {r: {"iops": d.get("fio_iops")} for r, d in device.items()}, "iops")
        out.append(
            f"| {name} | {kilo(field(t, 'iops'))} | {kilo(field(p, 'iops'))} | {num(ratio(t, v, 'iops'))}x "
            f"| {num(ratio(p, v, 'iops'))}x | {num(limit)}{'x' if limit else ''} "
            f"| {num(field(t, 'daemon_cpu_us_per_op'), suffix=' µs')} | {num(field(p, 'daemon_cpu_us_per_op'), suffix=' µs')} |"
        )
    return out


SEEDS = [
    ("w1-dio-overwrite", "w1 DIO 4k randrw (QD4)"),
    ("w2-aio-append", "w2 AIO append 4k (QD32)"),
    ("w3-buffered-randrw", "w3 buffered 8k, 2 readers + 2 writers"),
    ("byte-writes", "1-byte writes (dd bs=1)"),
]


def runs_by_round(path, key):
    """A results file's JSON lines, as {key(line): {round: line}}."""
    runs = collections.defaultdict(dict)
    with open(path) as f:
        for text in f:
            if text.startswith("{"):
                line = json.loads(text)
                runs[key(line)][line["round"]] = line
    return runs


def seeds_tables(path):
    """bench/run-seeds.sh: each system against ext4, per-round ratios."""
    runs = runs_by_round(path, lambda line: (line["system"], line["workload"]))
    systems = ["keelfs-fuse", "keelfs-fuse-wb", "xfs"]
    out = [
        f"Generated by `bench/headline.py` from `{path}`: reads and writes per second, medians over rounds; "
        "the ratio to ext4 is the median of the per-round ratios.",
        "",
        "| workload | side | ext4 | " + " | ".join(f"{s} (x ext4)" for s in systems) + " |",
        "|---|---|---:|" + "---:|" * len(systems),
    ]
    for key, name in SEEDS:
        ext4 = runs.get(("ext4", key), {})
        for side in ("read_iops", "write_iops"):
            if not field(ext4, side):
                continue
            cells = []
            for system in systems:
                mine = runs.get((system, key), {})
                cells.append(f"{kilo(field(mine, side))} (**{num(ratio(mine, ext4, side))}x**)")
            out.append(f"| {name} | {side.split('_')[0]}s | {kilo(field(ext4, side))} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def metadata_tables(path):
    """bench/run-metadata.sh: one row per file count."""
    rows = collections.defaultdict(dict)
    files = None
    with open(path) as f:
        for text in f:
            if text.startswith("{"):
                line = json.loads(text)
                # metadata-mount counts inodes (directories too): it
                # belongs to the fill before it.
                files = line.get("files", files)
                rows[files][line["workload"]] = line
    out = [
        f"Generated by `bench/headline.py` from `{path}`.",
        "",
        "| files | creates/s | checkpoint: s, bytes per file | RSS per file at fill | mount s (s per million) "
        "| RSS per inode after mount | fsck s, peak RSS | keelfsd serve: to mounted s, RSS per file | find through the mount s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for files in sorted(k for k in rows if k):
        r = rows[files]
        fill, mount = r.get("metadata-fill", {}), r.get("metadata-mount", {})
        fsck, serve = r.get("fsck", {}), r.get("serve", {})
        if not fill:
            continue
        out.append(
            f"| {files:,} | {kilo(fill.get('files_created_per_s'))} "
            f"| {num(fill.get('checkpoint_s'))}, {num(fill.get('checkpoint_bytes_per_file'), 0)} "
            f"| {num(fill.get('rss_bytes_per_file'), 0)} "
            f"| {num(mount.get('mount_s'))} ({num(mount.get('mount_s_per_million_inodes'))}) "
            f"| {num(mount.get('rss_bytes_per_inode'), 0)} "
            f"| {num(fsck.get('fsck_s'))}, {num(fsck.get('fsck_rss_mib'), 0)} MiB "
            f"| {num(serve.get('serve_to_mounted_s'))}, {num(serve.get('daemon_rss_bytes_per_file'), 0)} "
            f"| {num(serve.get('find_s'))} |"
        )
    waits = [(files, rows[files]["metadata-fill"]) for files in sorted(k for k in rows if k)
             if "checkpoint_in_pieces_longest_wait_ms" in rows[files].get("metadata-fill", {})]
    if waits:
        out += [
            "",
            "A checkpoint beside a task that asks for attributes in a loop: how long it took, and the "
            "longest that task waited between two requests.",
            "",
            "| files | whole: s | whole: longest wait ms | in pieces: s | in pieces: longest wait ms "
            "| **longest wait, pieces / whole** |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for files, fill in waits:
            whole, pieces = fill["checkpoint_longest_wait_ms"], fill["checkpoint_in_pieces_longest_wait_ms"]
            ratio = f"**{pieces / whole:.4f}x**" if whole else "—"
            out.append(
                f"| {files:,} | {num(fill.get('checkpoint_s'))} | {num(whole, 1)} "
                f"| {num(fill.get('checkpoint_in_pieces_s'))} | {num(pieces, 1)} | {ratio} |"
            )
    return "\n".join(out)


RBD_WORKLOADS = [
    ("read-4k-qd16", "4k read, stepped, QD16"),
    ("write-4k-qd16", "4k write, stepped, QD16"),
    ("write-4k-qd1", "4k write, stepped, QD1"),
    ("write-1m-qd4", "1M write, sequential, QD4"),
    ("read-1m-qd4", "1M read, sequential, QD4"),
]
RBD_SPIN = [
    ("read-4k-qd16-spin", "4k read, stepped, QD16"),
    ("write-4k-qd1-spin", "4k write, stepped, QD1"),
]
RBD_PATTERN = [
    ("randread-4k-qd16", "read-4k-qd16", "4k read QD16"),
    ("randwrite-4k-qd16", "write-4k-qd16", "4k write QD16"),
]


def rate(lines, prefix=""):
    """IOPS, or MiB/s for requests of 1 MiB and more."""
    first = next(iter(lines.values()))
    if first["bs"] >= 1 << 20:
        return f"{num(field(lines, prefix + 'mib_s'), 0)} MiB/s"
    return kilo(field(lines, prefix + "iops"))


def rbd_pair_table(runs, workloads):
    out = [
        "| workload | keelfs | QEMU rbd | **keelfs / QEMU** | client CPU/op: keelfs, QEMU | **CPU/op keelfs / QEMU** "
        "| OSD CPU/op: keelfs run, QEMU run | mean latency µs: keelfs, QEMU | keelfs p50 / p99 µs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, name in workloads:
        lines = runs.get(label)
        if not lines:
            continue
        out.append(
            f"| {name} | {rate(lines)} | {rate(lines, 'qemu_')} | **{num(field(lines, 'ratio_vs_qemu'))}x** "
            f"| {num(field(lines, 'cpu_us_per_io'))}, {num(field(lines, 'qemu_cpu_us_per_io'))} µs "
            f"| **{num(field(lines, 'cpu_ratio_vs_qemu'))}x** "
            f"| {num(field(lines, 'osd_cpu_us_per_io'))}, {num(field(lines, 'qemu_osd_cpu_us_per_io'))} µs "
            f"| {num(field(lines, 'lat_us_mean'), 0)}, {num(field(lines, 'qemu_lat_us_mean'), 0)} "
            f"| {num(field(lines, 'lat_us_p50'), 0)} / {num(field(lines, 'lat_us_p99'), 0)} |"
        )
    return out


def rbd_tables(path):
    """bench/run-rbd.sh: keelfs-bench on RBD against qemu-img bench's rbd driver."""
    runs = runs_by_round(path, lambda line: line["label"])
    rounds = max((len(v) for v in runs.values()), default=0)
    out = [
        f"Generated by `bench/headline.py` from `{path}` ({rounds} rounds): medians over rounds; a ratio is the "
        "median of the per-round ratios. Rates are IOPS (MiB/s for 1 MiB requests); CPU/op is each client "
        "process's own (librbd's threads included), the OSD's over the same run beside it.",
        "",
        "Both clients sleep while their requests are in flight:",
        "",
        *rbd_pair_table(runs, RBD_WORKLOADS),
    ]
    spin = rbd_pair_table(runs, RBD_SPIN)
    if len(spin) > 2:
        out += ["", "keelfs-bench polling without pause (`--wait spin`), qemu-img as before:", "", *spin]
    pattern = ["| workload | keelfs random | keelfs stepped | **random / stepped** |", "|---|---:|---:|---:|"]
    for rand, stepped, name in RBD_PATTERN:
        r, s = runs.get(rand), runs.get(stepped)
        if r and s:
            pattern.append(f"| {name} | {rate(r)} | {rate(s)} | **{num(ratio(r, s, 'iops'))}x** |")
    if len(pattern) > 2:
        out += ["", "What the stepped offsets change: keelfs-bench alone, random against stepped, same round:", ""]
        out += pattern
    return "\n".join(out)


RBD_SYSTEMS = ["keelfsd-rbd", "keelfsd-rbd-irq"]


def rbd_limit(devices, workload):
    """{round: {"iops": qemu-img's figure}} for a workload's counterpart on
    the block device: stepped 4k writes for overwrites, sequential ones for
    appends, and for the 50/50 mix the rate at which half reads and half
    writes complete (2 / (1/reads + 1/writes))."""
    writes, reads = devices.get("device-rbd", {}), devices.get("device-rbd-read", {})
    if workload == "DioOverwrite":
        return {r: {"iops": d.get("qemu_iops")} for r, d in writes.items()}
    if workload == "AioAppend":
        return {r: {"iops": d.get("qemu_iops")} for r, d in devices.get("device-rbd-seq", {}).items()}
    if workload == "DioRandrw":
        both = set(writes) & set(reads)
        return {r: {"iops": 2 / (1 / writes[r]["qemu_iops"] + 1 / reads[r]["qemu_iops"])} for r in both}
    return {}


def vhost_rbd_tables(path, runs, devices):
    """bench/run-vhost.sh --rbd-pool: keelfsd over vhost-user-fs on RBD,
    against qemu-img bench's rbd driver on the same pool."""
    rounds = max((len(v) for v in runs.values()), default=0)
    out = [
        f"Generated by `bench/headline.py` from `{path}` ({rounds} rounds; the driver sleeps on the call eventfd "
        "while its requests are in flight). Medians over rounds; a ratio is the median of the per-round ratios.",
        "",
        "The block-device ceiling on the same pool, same round, 4k at the workloads' depth: "
        "qemu-img bench through QEMU's rbd driver, and keelfs's block layer (`keelfs-bench bdev --backend rbd`) "
        "beside it:",
        "",
        "| device run | QEMU rbd IOPS | keelfs bdev IOPS | **keelfs / QEMU** | client CPU/op: keelfs, QEMU "
        "| **CPU/op keelfs / QEMU** | OSD CPU/op: keelfs run, QEMU run |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, name in (
        ("device-rbd", "4k writes, stepped"),
        ("device-rbd-read", "4k reads, stepped"),
        ("device-rbd-seq", "4k writes, sequential"),
    ):
        d = devices.get(label)
        if not d:
            continue
        qd = next(iter(d.values()))["iodepth"]
        out.append(
            f"| {name}, QD{qd} | {kilo(field(d, 'qemu_iops'))} | {kilo(field(d, 'iops'))} "
            f"| **{num(field(d, 'ratio_vs_qemu'))}x** "
            f"| {num(field(d, 'cpu_us_per_io'))}, {num(field(d, 'qemu_cpu_us_per_io'))} µs "
            f"| **{num(field(d, 'cpu_ratio_vs_qemu'))}x** "
            f"| {num(field(d, 'osd_cpu_us_per_io'))}, {num(field(d, 'qemu_osd_cpu_us_per_io'))} µs |"
        )
    head = "| workload (QD) | QEMU rbd ceiling IOPS |"
    rule = "|---|---:|"
    for system in RBD_SYSTEMS:
        head += f" {system} IOPS | **/ ceiling** | daemon CPU/op | OSD CPU/op |"
        rule += "---:|---:|---:|---:|"
    out += ["", "keelfsd over vhost-user-fs on RBD, against that ceiling:", "", head, rule]
    for key, name in WORKLOADS:
        cells = []
        limit = rbd_limit(devices, key)
        for system in RBD_SYSTEMS:
            k = runs.get((system, key), {})
            share = ratio(k, limit, "iops") if k and limit else None
            cells.append(
                f"{kilo(field(k, 'iops')) if k else '—'} | **{num(share)}{'x' if share else ''}** "
                f"| {num(field(k, 'daemon_cpu_us_per_op'), suffix=' µs')} "
                f"| {num(field(k, 'osd_cpu_us_per_op'), suffix=' µs')}"
            )
        lines = next((runs[(s, key)] for s in RBD_SYSTEMS if (s, key) in runs), None)
        if not lines:
            continue
        qd = next(iter(lines.values()))["iodepth"]
        out.append(f"| {name} ({qd}) | {kilo(field(limit, 'iops')) if limit else '—'} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def tables(path):
    with open(path) as f:
        first = json.loads(next(line for line in f if line.startswith("{")))
    if first.get("bench") == "seeds":
        return seeds_tables(path)
    if first.get("bench") == "bdev" and first.get("backend") == "rbd" and not first["label"].startswith("device"):
        return rbd_tables(path)
    if first.get("workload", "").startswith("metadata") or first.get("bench") == "metadata":
        return metadata_tables(path)
    runs, devices = load(path)
    if any(label in RBD_SYSTEMS for label, _ in runs):
        return vhost_rbd_tables(path, runs, devices)
    rounds = max((len(v) for v in runs.values()), default=0)
    waits = {line.get("driver_waits", "spin") for lines in runs.values() for line in lines.values()}
    driver = {
        "eventfd": "the driver sleeps on the call eventfd while its requests are in flight, as a guest's vCPU halts",
        "spin": "the driver polls its used ring without pause, taking a core of its own",
    }
    out = [
        f"Generated by `bench/headline.py` from `{path}` ({rounds} rounds; "
        + "; ".join(driver.get(w, w) for w in sorted(waits))
        + ").",
        "",
        "**Fair device**: keelfsd's io_uring backend and virtiofsd's ext4 each on a loop device over a "
        "RAM-backed image. CPU/op is the daemon's own (with its children); *other* is the machine's busy "
        "time in the run less the daemon's and the load generator's: the loop workers and noise.",
        "",
        *device_lines(runs, devices),
    ]
    for ours, peer in FAIR_PAIRS:
        table = fair_table(runs, ours, peer)
        if len(table) > 2:
            out += ["", f"{ours} against {peer}:", "", *table]
    out += ["", "**Latency** (host-side driver, 1 thread):", "", *latency_table(runs)]
    others = other_devices_table(runs, devices)
    if len(others) > 2:
        out += [
            "",
            "**Other devices**: keelfsd's io_uring backend on the tmpfs image itself, and the pmem backend on "
            "a /dev/shm file; the device limit is fio on the raw tmpfs file.",
            "",
            *others,
        ]
    return "\n".join(out)


def regenerate(results_md):
    """(old text, new text): every headline block rebuilt from its file."""
    text = open(results_md).read()
    out, at, blocks = [], 0, 0
    for begin in BEGIN.finditer(text):
        if begin.start() < at:
            continue
        end = text.find(END, begin.end())
        if end < 0:
            sys.exit(f"headline: a block in {results_md} has no '{END}'")
        out += [text[at : begin.end()], "\n", tables(begin.group(1)), "\n"]
        at = end
        blocks += 1
    if not blocks:
        sys.exit(f"headline: no '<!-- headline: FILE -->' ... '{END}' block in {results_md}")
    out.append(text[at:])
    return text, "".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="?")
    ap.add_argument("--update", metavar="RESULTS_MD")
    ap.add_argument("--check", metavar="RESULTS_MD")
    args = ap.parse_args()
    if args.update:
        _, new = regenerate(args.update)
        open(args.update, "w").write(new)
    elif args.check:
        old, new = regenerate(args.check)
        if old != new:
            sys.exit(f"headline: {args.check}'s headline block is not what bench/headline.py makes of its raw file")
    elif args.results:
        print(tables(args.results))
    else:
        ap.error("give RESULTS.json, --update or --check")


if __name__ == "__main__":
    main()
