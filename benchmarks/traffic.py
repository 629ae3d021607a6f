"""Bytes each rank sends per call to its own host and to other hosts, flat against hierarchical.

    python benchmarks/traffic.py [--quick] [--counts FILE ...] [--out DIR]

One record per (mode, scheme, hosts, routing, source), ``op = "traffic"``, for one dispatch
and one combine (the combine sends back as many rows as the dispatch sent), per rank:
``cross_host_bytes_per_rank`` and ``same_host_bytes_per_rank`` (to the other ranks of its host;
what a rank sends to itself is a local copy and is in neither), with
``formula_cross_host_bytes_per_rank`` beside them. Modes: ``normal`` (T = 4096, bf16 dispatch
rows of align16(2H + 4(2K+1)) bytes, 2H combine rows) and ``low_latency`` (T = 128, fp8 dispatch
rows of H + 4H/128 bytes per selection, 2H combine rows). Schemes: ``flat`` (a row per token and
destination rank; low latency: per selection) and ``hierarchical`` (DeepEP's: a row per token
and destination host crosses the network to the GPU with the source's local index there, which
forwards it over NVLink). Routings: ``uniform`` top-8 of 256 experts and DeepSeek-V3's
``node_limited`` one (at most 4 hosts a token). 8 ranks a host throughout.

Sources:

- ``formula``: docs/scaling_numbers.py's ``traffic_bytes`` (its derivation: docs/scaling.md,
  "Traffic by host"), at 2, 4, 8 and 32 hosts;
- ``routing``: counted with NumPy from a sampled routing (``jax_ep.testing.
  make_node_limited_routing``, seed ``--seed``): the rows each rank sends to each rank under the
  scheme, folded by host (``jax_ep.testing.fold_traffic``), times the row bytes; at 2, 4 and 8
  hosts (``--quick``: 2 hosts);
- ``counted``: what a transport counted on a run (``--counts FILE``, once per file), folded the
  same way. The file is JSON: ``{"runs": [{"mode", "scheme", "hosts", "ranks_per_host",
  "routing", "tokens", "traffic": [{"src", "dst", "bytes", ...}, ...]}]}``, the rows of every
  rank's proxy (``EmulatedQueueForTests.traffic()``'s format), as
  ``benchmarks/traffic_counts.py`` writes it from a GPU run over the emulated network. Its
  bytes are whatever the transport moved, flags and counts included. A run's ``"hidden"``
  (default H) is its record's, and its formula's.

Runs on a CPU in seconds. Writes ``<out>/<machine>-<date>-traffic.json`` (or ``--out`` itself
when it ends in ``.json``) and prints a table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import bench_records as br
import numpy as np

from jax_ep import testing

OP = "traffic"
RANKS_PER_HOST = 8


def load_formula():
    """docs/scaling_numbers.py as a module (it is a script, not a package)."""
    path = os.path.join(br.REPO_ROOT, "docs", "scaling_numbers.py")
    spec = importlib.util.spec_from_file_location("scaling_numbers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="routing counts at 2 hosts only (the formula records are all written)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled routings")
    p.add_argument("--counts", action="append", default=[],
                   help="JSON file of a transport's counts (see the module doc); repeatable")
    br.add_out_argument(p)
    br.add_note_argument(p)
    return p.parse_args(argv)


def routing_rows(sn, mode, hosts, routing_name, rng, tokens=None):
    """``{scheme: [R, R]}``: the rows each rank sends to each rank (``[src, dst]``, one
    dispatch) under one sampled routing, for each scheme: flat, a row per (token, destination
    rank) (low latency: per selection); hierarchical, a row per (token, remote host) to the GPU
    of the source's local index there, which forwards a row per destination rank (selection) of
    that host but itself, and rows to the source's own host sent directly."""
    g = RANKS_PER_HOST
    num_ranks = hosts * g
    t = sn.traffic_tokens(mode) if tokens is None else tokens
    max_hosts = sn.NODE_LIMITED_MAX_HOSTS if routing_name == "node_limited" else hosts
    idx = testing.make_node_limited_routing(rng, num_ranks, t, sn.E, sn.K, hosts, max_hosts,
                                            sn.NODE_LIMITED_GROUP_TOP)
    dest = idx // (sn.E // num_ranks)                                        # [R, T, K]
    selections = np.zeros((num_ranks, t, num_ranks), np.int32)               # [src, T, dst]
    np.add.at(selections, (np.arange(num_ranks)[:, None, None], np.arange(t)[None, :, None],
                           dest), 1)
    per_token = selections > 0 if mode == "normal" else selections
    per_dst = per_token.sum(1).astype(np.float64)                            # [src, dst]
    host = np.arange(num_ranks) // g
    local = np.arange(num_ranks) % g
    same_host = host[:, None] == host[None, :]
    rows = per_dst * same_host                                  # own host: direct
    host_rows = (selections.reshape(num_ranks, t, hosts, g) > 0).any(-1).sum(1)  # [src, host]
    for h in range(hosts):
        relay = h * g + local                                   # [src]: where its rows land
        remote = host != h
        rows[remote, relay[remote]] += host_rows[remote, h]     # cross the network, once a host
        targets = np.arange(h * g, (h + 1) * g)
        for src in np.flatnonzero(remote):                      # forwarded over NVLink
            rows[relay[src], targets] += per_dst[src, targets]  # relay -> itself: a local copy
    return {"flat": per_dst, "hierarchical": rows}


def make_record(sn, mode, scheme, hosts, routing_name, source, same_bytes, cross_bytes,
                tokens=None, hidden=None, **extra):
    tokens = sn.traffic_tokens(mode) if tokens is None else tokens
    hidden = sn.H if hidden is None else hidden
    formula_cross = sn.traffic_bytes(mode, scheme, hosts, routing_name, RANKS_PER_HOST,
                                     tokens, hidden)[1]
    return dict(op=OP, mode=mode, scheme=scheme, hosts=hosts, ranks_per_host=RANKS_PER_HOST,
                routing=routing_name, tokens=tokens, hidden=hidden, experts=sn.E, topk=sn.K,
                cross_host_bytes_per_rank=float(cross_bytes),
                same_host_bytes_per_rank=float(same_bytes),
                formula_cross_host_bytes_per_rank=float(formula_cross), source=source, **extra)


def formula_records(sn):
    out = []
    for mode in sn.TRAFFIC_MODES:
        for scheme in sn.TRAFFIC_SCHEMES:
            for routing_name in sn.TRAFFIC_ROUTINGS:
                for hosts in sn.TRAFFIC_HOSTS:
                    same, cross = sn.traffic_bytes(mode, scheme, hosts, routing_name,
                                                   RANKS_PER_HOST)
                    out.append(make_record(sn, mode, scheme, hosts, routing_name, "formula",
                                           same, cross))
    return out


def routing_records(sn, host_counts, seed):
    out = []
    for mode in sn.TRAFFIC_MODES:
        row_bytes = sum(sn.traffic_row_bytes(mode))
        for routing_name in sn.TRAFFIC_ROUTINGS:
            for hosts in host_counts:
                by_scheme = routing_rows(sn, mode, hosts, routing_name,
                                         np.random.default_rng(seed))
                for scheme in sn.TRAFFIC_SCHEMES:
                    same, cross = testing.fold_traffic(by_scheme[scheme], hosts * RANKS_PER_HOST,
                                                       RANKS_PER_HOST)
                    out.append(make_record(
                        sn, mode, scheme, hosts, routing_name, "routing",
                        same.mean() * row_bytes, cross.mean() * row_bytes, seed=seed,
                        cross_host_rows_per_rank=float(cross.mean()),
                        same_host_rows_per_rank=float(same.mean())))
    return out


def counted_records(sn, path):
    with open(path) as f:
        runs = json.load(f)["runs"]
    out = []
    for run in runs:
        for key, want in (("experts", sn.E), ("topk", sn.K), ("ranks_per_host", RANKS_PER_HOST)):
            if run.get(key, want) != want:
                raise ValueError(f"{path}: a run with {key}={run[key]}; the formula is for "
                                 f"{key}={want}")
        num_ranks = run["hosts"] * RANKS_PER_HOST
        same, cross = testing.fold_traffic(run["traffic"], num_ranks, RANKS_PER_HOST)
        out.append(make_record(sn, run["mode"], run["scheme"], run["hosts"], run["routing"],
                               "counted", same.mean(), cross.mean(), tokens=run["tokens"],
                               hidden=run.get("hidden"),
                               counts_file=os.path.basename(path)))
    return out


def print_table(records):
    print("| source | mode | scheme | routing | hosts x G | GB cross-host | GB same-host | "
          "formula GB cross-host | vs formula |")
    print("|" + " --- |" * 9)
    for r in records:
        formula = r["formula_cross_host_bytes_per_rank"]
        ratio = r["cross_host_bytes_per_rank"] / formula if formula else float("nan")
        print(f"| {r['source']} | {r['mode']} | {r['scheme']} | {r['routing']} | "
              f"{r['hosts']} x {r['ranks_per_host']} | {r['cross_host_bytes_per_rank'] / 1e9:.4f}"
              f" | {r['same_host_bytes_per_rank'] / 1e9:.4f} | {formula / 1e9:.4f} | "
              f"{ratio:.4f} |")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    sn = load_formula()
    header = br.result_header(argv, args.note, __file__)
    records = formula_records(sn)
    records += routing_records(sn, (2,) if args.quick else (2, 4, 8), args.seed)
    for counts in args.counts:
        records += counted_records(sn, counts)
    path = br.result_path(args.out, header, OP)
    br.write_json(path, {**header, "results": records})
    print_table(records)
    print(f"\nwrote {path}")
    return path


if __name__ == "__main__":
    main()
