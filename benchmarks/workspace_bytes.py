"""Device memory of one rank's Buffer workspace, by group size, from the built library itself.

    python benchmarks/workspace_bytes.py [--out DIR]

For R in 2, 8, 16, 64 and 256 ranks, H=7168, top-8 of 256 experts, bf16 rows, asks
``jax_ep._C.workspace_bytes`` (the kernels' own layout arithmetic, no GPU needed) for:

- ``normal``: a normal-mode Buffer at T_max = 4096 tokens per rank and its default capacity
  (``R * T_max`` receive rows);
- ``low_latency``: a low-latency Buffer at T_max = 128 (its normal-mode region included).

Writes ``<machine>-<date>-workspace_bytes.json``, one record per (mode, ranks):
``{"op": "workspace_bytes", "mode", "ranks", "tokens", "hidden", "dtype", "bytes"}``, and prints
them beside the bounds a group of that size should meet (``BOUNDS``: twice DeepEP's size hints
for the normal mode at 64 and 256 ranks, and the low-latency Buffer at 256 ranks).
"""

from __future__ import annotations

import argparse
import sys

import bench_records as br  # benchmarks/ is sys.path[0]

RANKS = (2, 8, 16, 64, 256)
HIDDEN, EXPERTS, TOPK = 7168, 256, 8
MODES = {"normal": (4096, False), "low_latency": (128, True)}  # mode: (T_max, low_latency)
# (mode, ranks): the most bytes a rank's workspace should take (GB = 1e9 bytes).
BOUNDS = {("normal", 64): 1.5e9, ("normal", 256): 4.7e9, ("low_latency", 256): 2.5e9}


def workspace_records(module) -> list[dict]:
    """One record per (mode, ranks), from ``module.workspace_bytes`` (``jax_ep._C``)."""
    from jax_ep.backends.cuda import buffer_config  # noqa: PLC0415

    records = []
    for mode, (tokens, low_latency) in MODES.items():
        for ranks in RANKS:
            config = buffer_config(
                module, num_ranks=ranks, num_experts=EXPERTS, hidden=HIDDEN,
                max_tokens_per_rank=tokens, num_topk=TOPK, capacity=ranks * tokens,
                dtype_bytes=2, low_latency=low_latency)
            records.append({"op": "workspace_bytes", "mode": mode, "ranks": ranks,
                            "tokens": tokens, "hidden": HIDDEN, "dtype": "bf16",
                            "bytes": int(module.workspace_bytes(config))})
    return records


def table(records) -> str:
    lines = [f"{'mode':<12} {'ranks':>5} {'tokens':>6} {'GB':>8}  bound"]
    for r in records:
        bound = BOUNDS.get((r["mode"], r["ranks"]))
        verdict = "" if bound is None else (
            f"<= {bound / 1e9:.2f} GB: {'met' if r['bytes'] <= bound else 'NOT met'}")
        lines.append(f"{r['mode']:<12} {r['ranks']:>5} {r['tokens']:>6} "
                     f"{r['bytes'] / 1e9:>8.3f}  {verdict}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    br.add_out_argument(parser)
    args = parser.parse_args(argv)
    try:
        from jax_ep import _C  # noqa: PLC0415
    except ImportError as e:
        print(f"needs the built extension jax_ep._C ({e})", file=sys.stderr)
        return 1
    header = br.result_header(sys.argv[1:] if argv is None else argv)
    records = workspace_records(_C)
    path = br.result_path(args.out, header, "workspace_bytes")
    br.write_json(path, {**header, "records": records})
    print(table(records))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
