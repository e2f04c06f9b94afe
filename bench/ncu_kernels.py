#!/usr/bin/env python3
"""Where a decode step's device time goes, kernel by kernel (issue 9's profiles).

    bench/ncu_kernels.py run GPU_BENCH MODEL STREAMS [--skip N] [--count N] [--csv OUT.csv]
    bench/ncu_kernels.py summary OUT.csv

`run` profiles `gpu_bench MODEL cuda STREAMS 128 64 "" n` (eager launches: ncu sees each kernel
alone, so no PDL overlap, and at ncu's default base clocks) under Nsight Compute, skipping the
first N launches (start-up, the logits check and the prefills) and recording the next `count`:
each kernel's duration and DRAM bytes. `summary` prints, per kernel name and grid, the launch
count, mean µs, share of the profiled time, MB read per launch and the read rate. Needs `ncu`
on PATH or under /usr/local/cuda*/bin.
"""
import argparse
import collections
import csv
import glob
import shutil
import subprocess
import sys

METRICS = "gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum"


def ncu_path():
    found = shutil.which("ncu") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/ncu"))), None)
    if not found:
        sys.exit("ncu not found")
    return found


def run(a):
    cmd = [ncu_path(), "--metrics", METRICS, "--launch-skip", str(a.skip), "--launch-count",
           str(a.count), "--csv", "--print-units", "base",
           a.gpu_bench, a.model, "cuda", a.streams, "128", "64", "", "n"]
    with open(a.csv, "w") as out:
        subprocess.run(cmd, stdout=out, check=True)
    summary(a.csv)


def summary(path):
    header, kernels = None, collections.defaultdict(dict)
    for row in csv.reader(open(path)):
        if row and row[0] == "ID":
            header = row
            continue
        if header is None or len(row) != len(header):
            continue  # the program's own output, interleaved
        d = dict(zip(header, row))
        k = kernels[int(d["ID"])]
        k["name"] = f'{d["Kernel Name"][:48]} {d.get("Grid Size", "")}'
        k[d["Metric Name"]] = float(d["Metric Value"].replace(",", ""))
    agg = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for k in kernels.values():
        a = agg[k["name"]]
        a[0] += 1
        a[1] += k.get("gpu__time_duration.sum", 0.0)
        a[2] += k.get("dram__bytes_read.sum", 0.0)
    total = sum(a[1] for a in agg.values()) or 1.0
    print(f"{'kernel (grid)':64} {'launches':>8} {'µs':>8} {'share':>6} {'MB read':>8} {'TB/s':>6}")
    for name, (n, ns, rd) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        rate = rd / ns / 1e3 if ns else 0.0
        print(f"{name:64} {n:8d} {ns / n / 1e3:8.2f} {100 * ns / total:5.1f}% {rd / n / 1e6:8.2f} {rate:6.2f}")
    print(f"profiled: {len(kernels)} launches, {total / 1e3:.1f} µs")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("gpu_bench")
    r.add_argument("model")
    r.add_argument("streams")
    r.add_argument("--skip", type=int, default=7000)
    r.add_argument("--count", type=int, default=700)
    r.add_argument("--csv", default="ncu_kernels.csv")
    s = sub.add_parser("summary")
    s.add_argument("csv")
    a = p.parse_args()
    run(a) if a.cmd == "run" else summary(a.csv)


if __name__ == "__main__":
    main()
