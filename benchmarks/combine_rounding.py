"""Rounding of a normal combine across hosts: flat against hierarchical, bf16 or fp32 partials.

    python benchmarks/combine_rounding.py [--quick] [--tokens T] [--seed S] [--out DIR]

The tokens of one owner rank, T = 4096 (``--quick``: 8), H = 7168, top-8 of 256 experts, at 2,
4, 8 and 32 hosts of 8 ranks, under uniform and DeepSeek-V3's node-limited routing
(``jax_ep.testing.make_node_limited_routing``, the sampler of ``benchmarks/traffic.py``). Each
expert's output row is N(0, 1) rounded to bf16; the routing weights of a token are the 8
largest values of a softmax over 256 N(0, 1) logits (drawn apart from which experts the routing
picked). A destination rank's row ``y`` is its selections' weighted outputs summed in float32
and rounded to bf16, as the caller of ``combine`` makes it. Values:

- ``weighted``: those rows;
- ``cancelling``: each row also carries ``c_r u``, ``u`` an N(0, 1) row of the token shared by
  its ranks and ``c_r`` 64 times the token's ``sqrt(sum_k w_k^2)`` times a centred N(0, 1) draw
  per rank, so the ``c_r`` of a token sum to zero: its rows are about 64x larger than their sum.

Each token's rows are then summed three ways, with ``jax_ep.testing.sum_by_host``:

- ``flat``: float32 over all ranks in ascending rank order, rounded once to bf16 (what the
  kernels do inside one host);
- ``hierarchical_bf16``: per host, float32 over its ranks in rank order, that partial sum
  rounded to bf16 (what the forwarder sends), then float32 over the hosts, rounded to bf16;
- ``hierarchical_fp32``: the same with float32 partial sums over the network.

One record per (routing, hosts, values, scheme), ``op = "combine_rounding"``. Against the
float64 sum of the bf16 rows (exact here), in bf16 ulps of that sum: ``error_ulp_max``,
``error_ulp_mean``, ``error_ulp_p99`` and ``frac_error_over_1_ulp`` (sums that are exactly 0 are
left out, ``frac_exact_zero`` of the elements; sums that nearly cancel make the max large); in
bf16 ulps of the sum of the rows' absolute values (the unit of the per-element tolerance, which
bounds it): ``error_magnitude_ulp_max`` and ``error_magnitude_ulp_mean``;
``frac_differing_from_flat`` (bf16 bits). Against the float64 sum of the float32 rows before
their rounding to bf16: ``end_to_end_ulp_mean`` and ``end_to_end_ulp_p99``. The same for every
scheme of a case: ``row_rounding_ulp_max``, ``row_rounding_ulp_mean``, ``row_rounding_ulp_p99``
and ``row_rounding_magnitude_ulp_mean`` (how far the exact sum of the bf16 rows already lies
from that of the float32 rows: the rows' own rounding), ``ranks_per_token`` and
``hosts_per_token`` (the sample's). Bytes across hosts per rank, normal mode, from
docs/scaling_numbers.py's formula (``traffic_rows``, ``traffic_bytes``) at T tokens:
``combine_cross_host_bytes_per_rank`` (the combine alone; a float32 partial row has 4 bytes a
channel, a bf16 row 2) and ``call_cross_host_bytes_per_rank`` (dispatch and combine).

Runs on a CPU (NumPy, no JAX device work), about 9 minutes on one core (``--quick``: seconds).
Writes ``<out>/<machine>-<date>-combine_rounding.json`` (or ``--out`` itself when it ends in
``.json``) and prints a table.
"""

from __future__ import annotations

import argparse
import sys

import bench_records as br
import ml_dtypes
import numpy as np
import traffic

from jax_ep import testing

OP = "combine_rounding"
RANKS_PER_HOST = 8
VALUES = ("weighted", "cancelling")
SCHEMES = ("flat", "hierarchical_bf16", "hierarchical_fp32")
CANCELLATION = 64.0  # cancelling: the shared part of a row against the token's sum
CHUNK_TOKENS = 256   # tokens summed at once (memory: [chunk, 8, H] float32 arrays)
QUICK_TOKENS = 8
BF16 = ml_dtypes.bfloat16
FP32_PER_BF16_BYTES = 2  # a float32 partial row against a bf16 row of the same channels


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"{QUICK_TOKENS} tokens a case")
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens of the owner rank (default docs/scaling_numbers.py's T = 4096)")
    p.add_argument("--seed", type=int, default=0, help="seed of routings, weights and rows")
    br.add_out_argument(p)
    br.add_note_argument(p)
    return p.parse_args(argv)


def bf16_ulp(x):
    """The bf16 ulp of each exact value ``x`` (float64): ``2^(e - 7)`` for ``2^e <= |x| <
    2^(e+1)``, at least bf16's smallest subnormal."""
    _, exponent = np.frexp(np.abs(x))
    exponent = np.where(x == 0, -1000, exponent)
    return np.maximum(np.ldexp(1.0, exponent - 8),
                      float(ml_dtypes.finfo(BF16).smallest_subnormal))


def routing_weights(rng, tokens, sn):
    """``[tokens, K]`` float32: the K largest values of a softmax over E N(0, 1) logits."""
    logits = rng.standard_normal((tokens, sn.E))
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return -np.sort(-p, axis=-1)[:, :sn.K].astype(np.float32)


def token_rows(rng, idx, weights, num_ranks, values, sn):
    """The rows the ranks of a chunk's tokens send back, one slot per distinct destination
    rank in ascending rank order (unused slots zero, rank -1).

    Returns ``(y [n, K, H] bf16, unrounded [n, K, H] float32, ranks [n, K])``.
    """
    n, k = idx.shape
    dest = idx // (sn.E // num_ranks)
    order = np.argsort(dest, axis=-1, kind="stable")
    dest = np.take_along_axis(dest, order, axis=-1)
    w = np.take_along_axis(weights, order, axis=-1)
    slot = np.concatenate([np.zeros((n, 1), np.int64),
                           np.cumsum(np.diff(dest, axis=-1) != 0, axis=-1)], axis=-1)
    outputs = rng.standard_normal((n, k, sn.H), dtype=np.float32).astype(BF16)
    rows = np.zeros((n, k, sn.H), np.float32)
    ranks = np.full((n, k), -1, np.int64)
    tokens = np.arange(n)
    for j in range(k):  # the caller's sum of its local experts, in top-k order per rank
        rows[tokens, slot[:, j]] += w[:, j, None] * outputs[:, j].astype(np.float32)
        ranks[tokens, slot[:, j]] = dest[:, j]
    if values == "cancelling":
        used = ranks >= 0
        z = np.where(used, rng.standard_normal((n, k)), 0.0)
        centred = np.where(used, z - z.sum(-1, keepdims=True) / used.sum(-1, keepdims=True), 0.0)
        scale = CANCELLATION * np.sqrt((weights.astype(np.float64) ** 2).sum(-1))
        shared = rng.standard_normal((n, sn.H), dtype=np.float32)
        rows += (centred * scale[:, None]).astype(np.float32)[:, :, None] * shared[:, None, :]
    return rows.astype(BF16), rows, ranks


class Errors:
    """Error figures of one way of summing, gathered chunk by chunk."""

    def __init__(self):
        self.ulps, self.magnitude_ulps, self.end_to_end_ulps = [], [], []
        self.differing = self.count = 0

    def add(self, got, exact, magnitude, unrounded, flat=None):
        """``got`` (bf16, or float64) against ``exact`` (the float64 sum of the bf16 rows), in
        bf16 ulps of it and of ``magnitude`` (the sum of the rows' absolute values), and
        against ``unrounded`` (the float64 sum of the rows before their rounding to bf16);
        ``flat``: the flat scheme's bf16 result, for the bits that differ."""
        got = got.astype(np.float64)
        err = np.abs(got - exact)
        nonzero = exact != 0  # an error in ulps of an exact zero has no size
        self.ulps.append((err[nonzero] / bf16_ulp(exact[nonzero])).astype(np.float32))
        self.magnitude_ulps.append((err / bf16_ulp(magnitude)).astype(np.float32))
        nonzero = unrounded != 0
        self.end_to_end_ulps.append((np.abs(got - unrounded)[nonzero]
                                     / bf16_ulp(unrounded[nonzero])).astype(np.float32))
        if flat is not None:
            self.differing += int((got != flat.astype(np.float64)).sum())
        self.count += err.size

    def fields(self):
        ulps, magnitude_ulps = np.concatenate(self.ulps), np.concatenate(self.magnitude_ulps)
        end_to_end = np.concatenate(self.end_to_end_ulps)
        return dict(error_ulp_max=float(ulps.max()), error_ulp_mean=float(ulps.mean()),
                    error_ulp_p99=float(np.percentile(ulps, 99)),
                    frac_error_over_1_ulp=float((ulps > 1).sum()) / ulps.size,
                    error_magnitude_ulp_max=float(magnitude_ulps.max()),
                    error_magnitude_ulp_mean=float(magnitude_ulps.mean()),
                    end_to_end_ulp_mean=float(end_to_end.mean()),
                    end_to_end_ulp_p99=float(np.percentile(end_to_end, 99)),
                    frac_differing_from_flat=self.differing / self.count)


def measure_case(sn, routing_name, hosts, values, tokens, seed):
    """Error figures of every scheme for one case, and of the rows' own rounding, with the
    sample's exact zeros and ranks and hosts a token."""
    num_ranks = hosts * RANKS_PER_HOST
    rank_hosts = np.arange(num_ranks) // RANKS_PER_HOST
    rng = np.random.default_rng(seed)
    max_hosts = sn.NODE_LIMITED_MAX_HOSTS if routing_name == "node_limited" else hosts
    idx = testing.make_node_limited_routing(rng, 1, tokens, sn.E, sn.K, hosts, max_hosts,
                                            sn.NODE_LIMITED_GROUP_TOP)[0]
    weights = routing_weights(rng, tokens, sn)
    errors = {scheme: Errors() for scheme in SCHEMES}
    row_rounding = Errors()
    ranks_seen = hosts_seen = exact_zeros = 0
    for start in range(0, tokens, CHUNK_TOKENS):
        chunk = slice(start, min(start + CHUNK_TOKENS, tokens))
        y, unrounded, ranks = token_rows(rng, idx[chunk], weights[chunk], num_ranks, values, sn)
        exact = y.astype(np.float64).sum(1)
        unrounded = unrounded.astype(np.float64).sum(1)
        magnitude = np.abs(y.astype(np.float64)).sum(1)
        sums = {
            "flat": testing.sum_by_host(y, ranks, None, dtype=BF16),
            "hierarchical_bf16": testing.sum_by_host(y, ranks, rank_hosts, dtype=BF16),
            "hierarchical_fp32": testing.sum_by_host(y, ranks, rank_hosts, dtype=BF16,
                                                     partial_dtype=np.float32),
        }
        for scheme, got in sums.items():
            errors[scheme].add(got, exact, magnitude, unrounded, sums["flat"])
        row_rounding.add(unrounded, exact, magnitude, unrounded)
        exact_zeros += int((exact == 0).sum())
        used = ranks >= 0
        ranks_seen += int(used.sum())
        host_of = np.where(used, rank_hosts[np.maximum(ranks, 0)], -1)
        hosts_seen += int(sum(len(set(h) - {-1}) for h in host_of.tolist()))
    rows = row_rounding.fields()
    case = dict(row_rounding_ulp_max=rows["error_ulp_max"],
                row_rounding_ulp_mean=rows["error_ulp_mean"],
                row_rounding_ulp_p99=rows["error_ulp_p99"],
                row_rounding_magnitude_ulp_mean=rows["error_magnitude_ulp_mean"],
                frac_exact_zero=exact_zeros / (tokens * sn.H),
                ranks_per_token=ranks_seen / tokens, hosts_per_token=hosts_seen / tokens)
    return {scheme: e.fields() for scheme, e in errors.items()}, case


def cross_host_bytes(sn, scheme, hosts, routing_name, tokens):
    """``(combine, call)`` bytes across hosts per rank, normal mode, from the formula."""
    d_rank, d_host = sn.destinations(routing_name, hosts, RANKS_PER_HOST)
    layout = "flat" if scheme == "flat" else "hierarchical"
    rows = sn.traffic_rows("normal", layout, hosts, d_rank, d_host, RANKS_PER_HOST, tokens)[1]
    combine_row = sn.traffic_row_bytes("normal")[1]  # a bf16 row of H channels
    call = sn.traffic_bytes("normal", layout, hosts, routing_name, RANKS_PER_HOST, tokens)[1]
    if scheme == "hierarchical_fp32":
        extra = rows * combine_row * (FP32_PER_BF16_BYTES - 1)
        return rows * combine_row + extra, call + extra
    return rows * combine_row, call


def records(sn, tokens, seed):
    out = []
    for routing_name in sn.TRAFFIC_ROUTINGS:
        for hosts in sn.TRAFFIC_HOSTS:
            for values in VALUES:
                errors, sample = measure_case(sn, routing_name, hosts, values, tokens, seed)
                for scheme in SCHEMES:
                    combine, call = cross_host_bytes(sn, scheme, hosts, routing_name, tokens)
                    out.append(dict(
                        op=OP, routing=routing_name, hosts=hosts, ranks_per_host=RANKS_PER_HOST,
                        values=values, scheme=scheme, tokens=tokens, hidden=sn.H,
                        experts=sn.E, topk=sn.K, seed=seed, **errors[scheme], **sample,
                        combine_cross_host_bytes_per_rank=float(combine),
                        call_cross_host_bytes_per_rank=float(call)))
    return out


def print_table(records):
    print("| routing | hosts x G | values | scheme | ulp of the sum: max / mean / p99 | > 1 ulp "
          "| ulp of the magnitude: max / mean | differs from flat | rows' own rounding: mean / "
          "p99 ulp | end to end: mean / p99 ulp | GB combine cross-host | GB call cross-host |")
    print("|" + " --- |" * 12)
    for r in records:
        print(f"| {r['routing']} | {r['hosts']} x {r['ranks_per_host']} | {r['values']} | "
              f"{r['scheme']} | {r['error_ulp_max']:.3g} / {r['error_ulp_mean']:.3f} / "
              f"{r['error_ulp_p99']:.2f} | {r['frac_error_over_1_ulp']:.2%} | "
              f"{r['error_magnitude_ulp_max']:.3f} / {r['error_magnitude_ulp_mean']:.4f} | "
              f"{r['frac_differing_from_flat']:.2%} | {r['row_rounding_ulp_mean']:.3f} / "
              f"{r['row_rounding_ulp_p99']:.2f} | {r['end_to_end_ulp_mean']:.3f} / "
              f"{r['end_to_end_ulp_p99']:.2f} | "
              f"{r['combine_cross_host_bytes_per_rank'] / 1e9:.4f} | "
              f"{r['call_cross_host_bytes_per_rank'] / 1e9:.4f} |")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    sn = traffic.load_formula()
    tokens = args.tokens or (QUICK_TOKENS if args.quick else sn.traffic_tokens("normal"))
    header = br.result_header(argv, args.note, __file__)
    results = records(sn, tokens, args.seed)
    path = br.result_path(args.out, header, OP)
    br.write_json(path, {**header, "results": results})
    print_table(results)
    print(f"\nwrote {path}")
    return path


if __name__ == "__main__":
    main()
