"""benchmarks/combine_rounding.py on CPU (``--quick``): one record per case and scheme, the
flat and float32-partial schemes at the flat sum's bits, bfloat16 partials off them, and the
cross-host bytes of docs/scaling_numbers.py's formula."""

import pytest
from bench_scripts import bench_module, load_record, run_script

SCHEMES = ("flat", "hierarchical_bf16", "hierarchical_fp32")
ROUTINGS, HOSTS, VALUES = ("uniform", "node_limited"), (2, 4, 8, 32), ("weighted", "cancelling")


def test_combine_rounding_quick(tmp_path):
    run_script("combine_rounding.py", tmp_path)
    path = next(tmp_path.glob("8xcpu-*-combine_rounding.json"))
    assert bench_module("check_records").record_problems(str(path), check_history=False) == []
    results = load_record(tmp_path, "8xcpu-*-combine_rounding.json")["results"]
    key = {(r["routing"], r["hosts"], r["values"], r["scheme"]): r for r in results}
    assert set(key) == {(rt, h, v, s) for rt in ROUTINGS for h in HOSTS for v in VALUES
                        for s in SCHEMES} and len(key) == len(results)
    sn = bench_module("traffic").load_formula()
    for (routing, hosts, values, _), r in key.items():
        flat, bf16, fp32 = (key[(routing, hosts, values, s)] for s in SCHEMES)
        assert r["op"] == "combine_rounding" and (r["hidden"], r["topk"]) == (7168, 8), r
        # The rows' own rounding is the case's, whatever the scheme.
        for field in ("row_rounding_ulp_mean", "ranks_per_token", "hosts_per_token"):
            assert r[field] == flat[field] > 0, (field, r)
        # Flat: one rounding, so at most half an ulp of the terms' magnitude.
        assert flat["frac_differing_from_flat"] == 0
        assert flat["error_magnitude_ulp_max"] <= 0.5 and flat["error_ulp_p99"] <= 0.5, flat
        # Float32 partials: a float32 sum of a few bfloat16 rows is (nearly always) exact, so
        # the flat bits; bfloat16 partials: rounded once per host, off them.
        assert fp32["frac_differing_from_flat"] <= 1e-3, fp32
        assert bf16["frac_differing_from_flat"] > 0.05, bf16
        assert bf16["error_ulp_mean"] > flat["error_ulp_mean"], (bf16, flat)
        # At most half an ulp of the result and 2^-8 of the magnitude for the partial sums
        # (oracle.assert_combine_close's tolerance across hosts): 1.5 ulps of the magnitude.
        assert bf16["error_magnitude_ulp_max"] <= 1.5, bf16
        # Bytes across hosts (normal mode): the formula's; float32 partials double the
        # combine's rows and add one bf16 combine to the call.
        tokens = r["tokens"]
        assert flat["call_cross_host_bytes_per_rank"] == pytest.approx(
            sn.traffic_bytes("normal", "flat", hosts, routing, 8, tokens)[1])
        assert bf16["call_cross_host_bytes_per_rank"] == pytest.approx(
            sn.traffic_bytes("normal", "hierarchical", hosts, routing, 8, tokens)[1])
        assert fp32["combine_cross_host_bytes_per_rank"] == pytest.approx(
            2 * bf16["combine_cross_host_bytes_per_rank"])
        assert fp32["call_cross_host_bytes_per_rank"] == pytest.approx(
            bf16["call_cross_host_bytes_per_rank"] + bf16["combine_cross_host_bytes_per_rank"])
