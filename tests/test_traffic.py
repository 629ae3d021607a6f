"""benchmarks/traffic.py on CPU: its formula records (docs/scaling_numbers.py) for every case,
and its routing counts (NumPy, from sampled routings) against the formula."""

import json

import numpy as np
from bench_scripts import bench_module, load_record, run_script

from jax_ep import testing

MODES, SCHEMES = ("normal", "low_latency"), ("flat", "hierarchical")
ROUTINGS, HOSTS = ("uniform", "node_limited"), (2, 4, 8, 32)
# A routing count is a mean over R * T tokens, 16 * 4096 at 2 x 8 in the normal mode: one
# standard error is about 0.15% of the flat figures there, so 2% is over ten. In the low-latency
# mode (16 * 128 tokens, 8 selections each) one standard error is about 0.8% of the flat
# cross-host and 0.9% of the same-host figure: 4% is over four.
TOLERANCE = {"normal": 0.02, "low_latency": 0.04}


def test_traffic_quick(tmp_path):
    run_script("traffic.py", tmp_path)
    path = tmp_path.glob("8xcpu-*-traffic.json").__next__()
    assert bench_module("check_records").record_problems(str(path), check_history=False) == []
    results = load_record(tmp_path, "8xcpu-*-traffic.json")["results"]
    key = {(r["source"], r["mode"], r["scheme"], r["routing"], r["hosts"]): r for r in results}
    assert len(key) == len(results)
    for r in results:
        assert r["op"] == "traffic" and r["ranks_per_host"] == 8, r
        assert (r["hidden"], r["experts"], r["topk"]) == (7168, 256, 8), r
        assert r["tokens"] == (4096 if r["mode"] == "normal" else 128), r
    formula = {k[1:]: r for k, r in key.items() if k[0] == "formula"}
    assert set(formula) == {(m, s, rt, h) for m in MODES for s in SCHEMES for rt in ROUTINGS
                            for h in HOSTS}
    for r in formula.values():
        assert r["cross_host_bytes_per_rank"] == r["formula_cross_host_bytes_per_rank"] > 0
    routing = {k[1:]: r for k, r in key.items() if k[0] == "routing"}
    assert set(routing) == {(m, s, rt, 2) for m in MODES for s in SCHEMES for rt in ROUTINGS}
    for case, r in routing.items():
        want = formula[case]
        for field in ("cross_host_bytes_per_rank", "same_host_bytes_per_rank"):
            assert abs(r[field] / want[field] - 1) <= TOLERANCE[case[0]], (case, field, r, want)
    # The bar: at 2 x 8, uniform top-8 of 256, T = 4096, the hierarchical scheme sends at most a
    # third of the flat scheme's bytes across hosts.
    for mode in MODES:
        flat = formula[(mode, "flat", "uniform", 2)]["cross_host_bytes_per_rank"]
        hier = formula[(mode, "hierarchical", "uniform", 2)]["cross_host_bytes_per_rank"]
        assert hier <= flat / 3.0, (mode, hier, flat)
    # Node-limited routing keeps a token on at most 4 hosts: it changes nothing up to 4 hosts,
    # and halves the hierarchical cross-host bytes at 32 hosts against uniform routing.
    for mode in MODES:
        for h in (2, 4):
            assert (formula[(mode, "hierarchical", "node_limited", h)]["cross_host_bytes_per_rank"]
                    == formula[(mode, "hierarchical", "uniform", h)]["cross_host_bytes_per_rank"])
        limited = formula[(mode, "hierarchical", "node_limited", 32)]
        uniform = formula[(mode, "hierarchical", "uniform", 32)]
        assert limited["cross_host_bytes_per_rank"] < 0.6 * uniform["cross_host_bytes_per_rank"]


def test_node_limited_routing_keeps_at_most_four_hosts():
    idx = testing.make_node_limited_routing(np.random.default_rng(0), 4, 256, 256, 8,
                                            num_hosts=32, max_hosts=4)
    hosts = idx // 8
    assert max(len(set(token)) for token in hosts.reshape(-1, 8).tolist()) == 4
    assert all(len(set(token)) == 8 for token in idx.reshape(-1, 8).tolist())
    # Uniform when every host is kept: each expert about equally often (64 picks expected).
    idx = testing.make_node_limited_routing(np.random.default_rng(1), 8, 1024, 256, 8,
                                            num_hosts=2, max_hosts=4)
    counts = np.bincount(idx.ravel(), minlength=256)
    assert counts.min() > 0.6 * counts.mean() and counts.max() < 1.4 * counts.mean()


def test_a_counts_file_becomes_counted_records(tmp_path):
    """A transport's counts (the emulated proxy's traffic() rows of every rank), written as
    --counts takes them, fold into per-rank bytes beside the formula."""
    traffic = bench_module("traffic")
    sn = traffic.load_formula()
    rows = traffic.routing_rows(sn, "normal", 2, "uniform", np.random.default_rng(3),
                                tokens=256)["hierarchical"]
    row_bytes = sum(sn.traffic_row_bytes("normal"))
    counts = [{"src": s, "dst": d, "puts": int(rows[s, d]), "bytes": int(rows[s, d]) * row_bytes,
               "signals": 0} for s in range(16) for d in range(16) if rows[s, d]]
    path = tmp_path / "counts.json"
    path.write_text(json.dumps({"runs": [
        {"mode": "normal", "scheme": "hierarchical", "hosts": 2, "ranks_per_host": 8,
         "routing": "uniform", "tokens": 256, "traffic": counts}]}))
    (record,) = traffic.counted_records(sn, str(path))
    same, cross = testing.fold_traffic(rows, 16, 8)
    assert record["source"] == "counted" and record["tokens"] == 256
    assert record["cross_host_bytes_per_rank"] == cross.mean() * row_bytes > 0
    assert record["same_host_bytes_per_rank"] == same.mean() * row_bytes > 0
    want = sn.traffic_bytes("normal", "hierarchical", 2, "uniform", 8, 256)[1]
    assert record["formula_cross_host_bytes_per_rank"] == want
    assert abs(record["cross_host_bytes_per_rank"] / want - 1) < 0.05  # 16 * 256 tokens


def test_a_counted_run_of_another_hidden_size_has_its_own_formula(tmp_path):
    """A run at H = 2048 (traffic_counts.py --hidden) keeps its H, and its formula figure is the
    formula's at that H: the bytes of its rows, not H = 7168's."""
    traffic = bench_module("traffic")
    sn = traffic.load_formula()
    hidden = 2048
    rows = traffic.routing_rows(sn, "low_latency", 2, "uniform", np.random.default_rng(4),
                                tokens=128)["flat"]
    row_bytes = sum(sn.traffic_row_bytes("low_latency", hidden))
    assert row_bytes == hidden + 4 * hidden // 128 + 2 * hidden
    counts = [{"src": s, "dst": d, "puts": int(rows[s, d]), "bytes": int(rows[s, d]) * row_bytes,
               "signals": 0} for s in range(16) for d in range(16) if rows[s, d]]
    path = tmp_path / "counts.json"
    path.write_text(json.dumps({"runs": [
        {"mode": "low_latency", "scheme": "flat", "hosts": 2, "ranks_per_host": 8,
         "routing": "uniform", "tokens": 128, "hidden": hidden, "traffic": counts}]}))
    (record,) = traffic.counted_records(sn, str(path))
    assert record["hidden"] == hidden
    want = sn.traffic_bytes("low_latency", "flat", 2, "uniform", 8, 128, hidden)[1]
    assert record["formula_cross_host_bytes_per_rank"] == want
    assert want < 0.3 * sn.traffic_bytes("low_latency", "flat", 2, "uniform", 8, 128)[1]
    assert abs(record["cross_host_bytes_per_rank"] / want - 1) < 0.04


def test_counted_traffic_is_the_op_pair_s_in_flat_ranks():
    """benchmarks/traffic_counts.py's reading of the proxies: what an op pair added (after minus
    before), each leg's ranks renamed to the flat group's and summed where two legs meet."""
    counts = bench_module("traffic_counts")
    readings = {"across": [{(0, 1): np.array([1, 100, 1])},
                           {(0, 1): np.array([3, 300, 3]), (0, 0): np.array([2, 20, 0])}],
                "within": [{}, {(0, 1): np.array([5, 50, 5])}]}

    def read(leg):
        return readings[leg].pop(0)

    ran = []
    # This process is host 0, GPU 1 of 2 x 2: across rank h -> h * 2 + 1, within rank g -> g.
    rows = counts.counted([("across", [1, 3]), ("within", [0, 1])], lambda: ran.append(1),
                          read=read)
    assert ran == [1]
    assert rows == [{"src": 0, "dst": 1, "puts": 5, "bytes": 50, "signals": 5},
                    {"src": 1, "dst": 1, "puts": 2, "bytes": 20, "signals": 0},
                    {"src": 1, "dst": 3, "puts": 2, "bytes": 200, "signals": 2}]
