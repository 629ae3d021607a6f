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
import os
import subprocess
import sys


def source_rows(report: str, raw_out: str | None = None) -> list[dict]:
    """One dict per CUDA source line (its columns plus "file"). ncu prints, per source file, a
    row ``"File Name","<path>"``, then a header row, then one row per line."""
    out = subprocess.run(["ncu", "--import", report, "--page", "source", "--csv",
                          "--print-source", "cuda"], capture_output=True, text=True, check=True)
    if raw_out:
        with open(raw_out, "w") as f:
            f.write(out.stdout)
    rows, header, file_name = [], None, ""
    for cells in csv.reader(io.StringIO(out.stdout)):
        if not cells:
            continue
        if cells[0] == "File Name":
            file_name, header = cells[1] if len(cells) > 1 else "", None
        elif header is None:
            header = cells
        else:
            rows.append(dict(zip(header, cells), file=file_name))
    return rows


def column(rows: list[dict], *words: str) -> str:
    for name in rows[0]:
        if all(w.lower() in name.lower() for w in words):
            return name
    raise KeyError(f"no column with {words} among {list(rows[0])}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--raw", help="also write ncu's CSV here")
    args = parser.parse_args(argv)
    rows = source_rows(args.report, args.raw)
    if not rows:
        print("no source rows (was the kernel built with -lineinfo?)", file=sys.stderr)
        return 1
    samples = column(rows, "stall sampling", "all")
    text = column(rows, "source")
    line_col = next((c for c in rows[0] if c.strip().lower() in ("#", "line", "line #")), None)

    def count(row):
        try:
            return float(row[samples].replace(",", "") or 0)
        except ValueError:
            return 0.0

    total = sum(count(r) for r in rows) or 1.0
    print(f"{total:.0f} samples; top lines ({samples}):")
    for row in sorted(rows, key=count, reverse=True)[:args.top]:
        where = f"{os.path.basename(row['file'])}:{row.get(line_col, '?') if line_col else '?'}"
        print(f"{100 * count(row) / total:5.1f}%  {where:<28} {row[text].strip()[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
