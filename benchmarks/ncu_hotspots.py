"""Where a kernel's warps spend their time, by CUDA source line, from an Nsight Compute report.

    ncu --section SourceCounters --section WarpStateStats -k regex:NAME -c 1 -o rep python3 ...
    python3 benchmarks/ncu_hotspots.py rep.ncu-rep [--top 30]

Prints the source lines with the most warp-stall samples (every sample: a warp resident on an SM
at that line, issued or not), with their share of the kernel's samples. Spin-waits show up as
the lines of their loops: the samples there say how long warps waited, not why. Needs the kernel
built with -lineinfo (CMakeLists.txt does) and ``ncu`` on the PATH.
"""

from __future__ import annotations

import argparse
import csv
import io
import subprocess
import sys


def source_rows(report: str) -> list[dict]:
    out = subprocess.run(["ncu", "--import", report, "--page", "source", "--csv",
                          "--print-source", "cuda"], capture_output=True, text=True, check=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith('"')]
    return list(csv.DictReader(io.StringIO("\n".join(lines))))


def column(rows: list[dict], *words: str) -> str:
    for name in rows[0]:
        if all(w.lower() in name.lower() for w in words):
            return name
    raise KeyError(f"no column with {words} among {list(rows[0])}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    rows = source_rows(args.report)
    if not rows:
        print("no source rows (was the kernel built with -lineinfo?)", file=sys.stderr)
        return 1
    samples = column(rows, "stall sampling", "all")
    text = column(rows, "source")
    line_col = next((c for c in rows[0] if c.strip("# ").lower() in ("line", "")), None)

    def count(row):
        try:
            return float(row[samples].replace(",", "") or 0)
        except ValueError:
            return 0.0

    total = sum(count(r) for r in rows) or 1.0
    print(f"{total:.0f} samples; top lines ({samples}):")
    for row in sorted(rows, key=count, reverse=True)[:args.top]:
        where = row.get(line_col, "") if line_col else ""
        print(f"{100 * count(row) / total:5.1f}%  {where:>5}  {row[text].strip()[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
