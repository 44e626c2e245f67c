#!/usr/bin/env python3
"""Where one decode step's device time goes, from an Nsight Compute CSV.

Reads what `ncu --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum,...` printed for an
`ember bench decode --no-cuda-graphs` run (kernels timed one by one, so launch gaps are not in
it), cuts the kernels into decode steps at the final RMS norm that ends each step, and
summarises the last whole step: per kernel and grid, the launches, total and mean time, and
the DRAM read rate. The step's total against the bench's own time per token is what the
launches between kernels cost. Then the same per kernel name for the prompt (every kernel up
to the first step's end: the prefill and its output head).

    python3 scripts/ncu_step_summary.py ncu.csv

With --whole, every kernel in the file summarised by name (for a capture of a prefill).
"""

import collections
import csv
import sys

# The kernel that closes a step: the final norm before the output head (the per-layer norms
# are fused into the products).
STEP_END = "rms_norm_f32"


def kernels(path):
    lines = open(path).read().splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if header is None:
        sys.exit(f"no ncu table in {path} (did ncu run? see its .err beside it)")
    found = collections.OrderedDict()
    for row in csv.DictReader(lines[header:]):
        k = found.setdefault(int(row["ID"]), {"name": row["Kernel Name"], "grid": row["Grid Size"]})
        k[row["Metric Name"]] = float(row["Metric Value"].replace(",", ""))
    return list(found.values())


def summarise(kernels, key):
    """Per group of kernels (`key` of a kernel): launches, total and mean time, DRAM read rate."""
    total_ns = sum(k["gpu__time_duration.sum"] for k in kernels)
    groups = collections.OrderedDict()
    for k in kernels:
        g = groups.setdefault(key(k), [0, 0.0, 0.0])
        g[0] += 1
        g[1] += k["gpu__time_duration.sum"]
        g[2] += k.get("dram__bytes_read.sum", 0.0)
    print(f"{'kernel':<42} {'grid':<16} {'n':>4} {'total us':>9} {'mean us':>8} {'GB/s':>6} {'share':>6}")
    for (name, grid), (n, ns, read) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"{name[:42]:<42} {grid:<16} {n:>4} {ns / 1e3:>9.1f} {ns / n / 1e3:>8.2f} "
              f"{read / ns:>6.0f} {100 * ns / total_ns:>5.1f}%")


def totals(kernels):
    ns = sum(k["gpu__time_duration.sum"] for k in kernels)
    read = sum(k.get("dram__bytes_read.sum", 0.0) for k in kernels)
    return f"{ns / 1e3:.1f} us one by one, {read / 1e9:.3f} GB read, {read / ns:.0f} GB/s"


def main(path):
    ks = kernels(path)
    # A step runs from after one closing norm (and the output head after it) to the next
    # closing norm's head.
    ends = [i + 1 for i, k in enumerate(ks) if k["name"] == STEP_END]
    if len(ends) < 2:
        sys.exit(f"fewer than two '{STEP_END}' kernels in {path}: no whole step to summarise")
    step = ks[ends[-2] + 1 : ends[-1] + 1]
    print(f"{len(ks)} kernels; the last whole decode step: {len(step)} kernels, {totals(step)}")
    summarise(step, lambda k: (k["name"], k["grid"]))
    prompt = ks[: ends[0] + 1]
    print(f"\nthe prompt (to the first step's end): {len(prompt)} kernels, {totals(prompt)}")
    summarise(prompt, lambda k: (k["name"], ""))


def whole(path):
    ks = kernels(path)
    print(f"{len(ks)} kernels, {totals(ks)}")
    summarise(ks, lambda k: (k["name"], ""))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--whole":
        whole(sys.argv[2])
    elif len(sys.argv) == 2:
        main(sys.argv[1])
    else:
        sys.exit(__doc__)
