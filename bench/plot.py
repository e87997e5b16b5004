#!/usr/bin/env python3
"""Draw bench results as SVG: IOPS per workload per system (median of the
rounds, with the min-max range), and latency CDFs from the percentiles.

Usage: bench/plot.py RESULTS.json [MORE.json ...] --out DIR
Reads the JSON lines of run-vhost.sh (bench "vhost") and run-seeds.sh
(bench "seeds"). No plotting library needed: the SVG is written by hand.
"""
import argparse
import collections
import html
import json
import statistics

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


def load(paths):
    rows = []
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    rows.append(json.loads(line))
    return rows


def key(row):
    system = row.get("system") or row.get("label") or "?"
    workload = str(row.get("workload", "?"))
    return workload, system


def bars(rows, title, path, field="iops"):
    groups = collections.defaultdict(list)
    for r in rows:
        if field in r and r[field] is not None:
            groups[key(r)].append(float(r[field]))
    workloads = sorted({w for w, _ in groups})
    systems = sorted({s for _, s in groups})
    if not workloads:
        return
    width, height, left, top, bottom = 900, 420, 70, 40, 90
    plot_w, plot_h = width - left - 20, height - top - bottom
    peak = max(max(v) for v in groups.values()) or 1
    group_w = plot_w / len(workloads)
    bar_w = group_w * 0.8 / max(len(systems), 1)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">',
           f'<text x="{width/2}" y="20" text-anchor="middle" font-size="14">{html.escape(title)}</text>']
    for i in range(5):
        y = top + plot_h * (1 - i / 4)
        out.append(f'<line x1="{left}" x2="{width-20}" y1="{y}" y2="{y}" stroke="#ddd"/>')
        out.append(f'<text x="{left-5}" y="{y+4}" text-anchor="end">{peak*i/4:,.0f}</text>')
    for wi, w in enumerate(workloads):
        x0 = left + wi * group_w + group_w * 0.1
        out.append(f'<text x="{x0 + group_w*0.4}" y="{height-bottom+15}" text-anchor="middle">{html.escape(w)}</text>')
        for si, s in enumerate(systems):
            vals = groups.get((w, s))
            if not vals:
                continue
            med = statistics.median(vals)
            x = x0 + si * bar_w
            h = plot_h * med / peak
            out.append(f'<rect x="{x:.1f}" y="{top+plot_h-h:.1f}" width="{bar_w*0.9:.1f}" height="{h:.1f}" fill="{COLORS[si % len(COLORS)]}">'
                       f'<title>{html.escape(s)} {html.escape(w)}: {med:,.0f}</title></rect>')
            lo, hi = min(vals), max(vals)
            cx = x + bar_w * 0.45
            out.append(f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{top+plot_h-plot_h*hi/peak:.1f}" y2="{top+plot_h-plot_h*lo/peak:.1f}" stroke="black"/>')
    for si, s in enumerate(systems):
        x = left + si * 150
        out.append(f'<rect x="{x}" y="{height-30}" width="12" height="12" fill="{COLORS[si % len(COLORS)]}"/>')
        out.append(f'<text x="{x+16}" y="{height-20}">{html.escape(s)}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out))


def cdfs(rows, workload, path):
    curves = {}
    for r in rows:
        w, s = key(r)
        if w != workload or not r.get("lat_us_percentiles"):
            continue
        pts = sorted((float(p), float(v)) for p, v in r["lat_us_percentiles"].items() if v)
        curves.setdefault(s, pts)  # the first round's curve
    if not curves:
        return
    import math
    width, height, left, top, bottom = 700, 400, 60, 40, 70
    plot_w, plot_h = width - left - 20, height - top - bottom
    lo = min(v for pts in curves.values() for _, v in pts)
    hi = max(v for pts in curves.values() for _, v in pts)
    lo, hi = math.log10(max(lo, 0.1)), math.log10(max(hi, 1))
    span = (hi - lo) or 1
    def xy(p, v):
        x = left + plot_w * (math.log10(max(v, 0.1)) - lo) / span
        y = top + plot_h * (1 - p / 100)
        return x, y
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">',
           f'<text x="{width/2}" y="20" text-anchor="middle" font-size="14">{html.escape(workload)}: latency CDF (µs, log scale)</text>']
    for e in range(int(math.floor(lo)), int(math.ceil(hi)) + 1):
        x = left + plot_w * (e - lo) / span
        if left <= x <= width - 20:
            out.append(f'<line x1="{x}" x2="{x}" y1="{top}" y2="{top+plot_h}" stroke="#ddd"/>')
            out.append(f'<text x="{x}" y="{top+plot_h+15}" text-anchor="middle">{10**e:g}</text>')
    for p in (0, 50, 90, 99, 100):
        y = top + plot_h * (1 - p / 100)
        out.append(f'<text x="{left-5}" y="{y+4}" text-anchor="end">{p}%</text>')
    for si, (s, pts) in enumerate(sorted(curves.items())):
        d = " ".join(f"{'M' if i == 0 else 'L'}{xy(p, v)[0]:.1f},{xy(p, v)[1]:.1f}" for i, (p, v) in enumerate(pts))
        color = COLORS[si % len(COLORS)]
        out.append(f'<path d="{d}" fill="none" stroke="{color}" stroke-width="2"/>')
        out.append(f'<rect x="{left + si*150}" y="{height-30}" width="12" height="12" fill="{color}"/>')
        out.append(f'<text x="{left + si*150 + 16}" y="{height-20}">{html.escape(s)}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = load(args.inputs)
    for bench in sorted({r.get("bench") for r in rows}):
        sub = [r for r in rows if r.get("bench") == bench]
        bars(sub, f"{bench}: IOPS per workload (median of rounds, min-max bar)", f"{args.out}/{bench}-iops.svg")
        for w in sorted({key(r)[0] for r in sub}):
            cdfs(sub, w, f"{args.out}/{bench}-latency-{w}.svg")


if __name__ == "__main__":
    main()
