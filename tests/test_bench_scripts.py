"""The first-call and step benchmarks run on CPU and write their records (apart from
tests/test_benchmarks.py so that the slow smoke tests of the two files spread over the workers)."""

import glob
import json
import os

import numpy as np
import pytest
from bench_scripts import bm, jax_ep_importable, load_record, positive, run_script


def test_first_call_quick(tmp_path):
    # One mode, jax_ep only: each case is a fresh process (~5 s on CPU), and the cases differ
    # only in the step they build (the other steps run in-process below).
    run_script("first_call.py", tmp_path, "--modes", "low_latency", "--no-peer")
    payload = load_record(tmp_path, "8xcpu-*-first_call.json")
    assert payload["errors"] == [], payload["errors"]
    results = payload["results"]
    seen = set()
    for rec in results:
        assert rec["op"] == "first_call" and rec["mode"] == "low_latency", rec
        seen.add((rec["mode"], rec["impl"]))
        for key in ("cold_us", "aot_first_us", "steady_us", "aot_ratio", "warm_first_us",
                    "ratio"):
            assert positive(rec[key]), (key, rec)
        assert rec["ratio"] == pytest.approx(rec["warm_first_us"] / rec["steady_us"], rel=1e-3)
    expected = {("low_latency", "reference")} if jax_ep_importable() else set()
    assert seen == expected


def test_first_call_record_of_a_peer_has_no_warm_case():
    """A peer runs cold and aot only (no warm-up to call): its record says so, and its steady
    state comes from the aot process."""
    import first_call

    args = first_call.parse_args(["--quick"])
    got = {"cold": {"impl": "all_to_all", "ranks": 8, "first_us": 900.0, "steady_us": 40.0},
           "aot": {"impl": "all_to_all", "ranks": 8, "first_us": 120.0, "steady_us": 30.0}}
    rec = first_call.make_record(args, "low_latency", got)
    assert rec["warm_first_us"] is None and rec["ratio"] is None, rec
    assert rec["steady_us"] == 30.0 and rec["aot_ratio"] == 4.0 and rec["cold_us"] == 900.0


@pytest.mark.parametrize(("mode", "impl"), [("normal", "all_to_all"), ("normal", "jax_ep"),
                                            ("low_latency", "all_to_all")])
def test_first_call_steps_run(mode, impl):
    """The steps of first_call.py that its script test above does not run."""
    import first_call  # benchmarks/ is on the path through bench_scripts

    args = first_call.parse_args(["--quick"])
    mesh = bm.make_mesh()
    jax_ep, buf = None, None
    if impl == "jax_ep":
        jax_ep, why = bm.import_jax_ep()
        if jax_ep is None:
            pytest.skip(f"jax_ep not importable: {why}")
        buf = jax_ep.Buffer(mesh, bm.AXIS, num_experts=args.experts, hidden=args.hidden,
                            max_tokens_per_rank=args.tokens, num_topk=args.topk,
                            backend="reference")
    step, step_args = first_call.build_step(args, mode, impl, mesh, jax_ep, buf)
    combined = np.asarray(step(*step_args)[0], np.float32)
    assert combined.shape == step_args[0].shape and np.isfinite(combined).all()


def test_bench_step_quick(tmp_path):
    """The step benchmark runs on CPU (reference backend, the padded all_to_all peer) and writes
    one record per op, impl and dtype with the three measures; it prints one table, under one
    header, after a line that says what CPU times are worth."""
    out = run_script("bench_step.py", tmp_path, "--ops", "decode_step,normal_step", "--dtypes",
                     "bf16", "--impls", "jax_ep,all_to_all", "--repeats", "2")
    lines = out.splitlines()
    assert "say nothing about GPU speed" in lines[0], lines
    assert lines[1].split()[:3] == ["op", "impl", "dtype"] and out.count("time_us") == 1, out
    assert sum(line.startswith(("decode_step", "normal_step")) for line in lines) == 4, out
    assert not any(cell.startswith("-") and cell != "-" for line in lines[2:6]
                   for cell in line.split()), out  # a negative slope reads "noise"
    files = glob.glob(os.path.join(str(tmp_path), "8xcpu-*-step.json"))
    assert len(files) == 1, files
    with open(files[0]) as f:
        payload = json.load(f)
    for key in ("machine", "date", "commit", "command", "method", "records"):
        assert key in payload, key
    records = payload["records"]
    assert {(r["op"], r["impl"]) for r in records} == {
        (op, impl) for op in ("decode_step", "normal_step") for impl in ("jax_ep", "all_to_all")}
    for r in records:
        assert "error" not in r, r
        for key in ("dtype", "ranks", "tokens", "hidden", "time_us", "kernel_us", "enqueue_us"):
            assert key in r, (key, r)
        assert r["ranks"] == 8 and r["kernel_us"] is None  # no device trace on CPU


def test_bench_step_runs_no_peer_at_ep1(tmp_path):
    """At EP=1 a peer is a local copy, no comparison: the step benchmark does not run it and its
    record says why."""
    out = run_script("bench_step.py", tmp_path, "--ops", "decode_step", "--dtypes", "bf16",
                     "--impls", "all_to_all", "--ranks", "1")
    (path,) = glob.glob(os.path.join(str(tmp_path), "8xcpu-*-step.json"))
    with open(path) as f:
        payload = json.load(f)
    assert payload["records"] == [] and "EP=1" in payload["skipped"]["all_to_all"], payload
    assert "all_to_all: not run: at EP=1" in out


def test_bench_step_bare_runs_the_op_pair(tmp_path):
    """``--bare``: each step as dispatch -> combine alone (the fp8 decode step's combine reads
    the carried buffer), recorded as such."""
    run_script("bench_step.py", tmp_path, "--ops", "normal_step,decode_step", "--impls",
               "jax_ep,all_to_all", "--dtypes", "fp8", "--repeats", "2", "--bare",
               "--tag", "bare")
    (path,) = glob.glob(os.path.join(str(tmp_path), "8xcpu-*-step-bare.json"))
    with open(path) as f:
        records = json.load(f)["records"]
    assert len(records) == 4, records  # normal (bf16) and decode (fp8), for both impls
    for record in records:
        assert "error" not in record, record
        # Per-layer figures are slopes over two short CPU programs (noise may flip their
        # sign); the programs' own wall times are not.
        assert record["bare"] is True and isinstance(record["time_us"], float), record
        assert record["layers"] == [1, 2] and len(record["wall_us"]) == 2, record
        assert all(positive(w) for w in record["wall_us"]), record


def test_profile_moe_experts_quick(tmp_path):
    """Both variants run and compute the same loss: the fused gate/up layout is the same
    function as swiglu_experts, only in fewer products."""
    run_script("profile_moe_experts.py", tmp_path)
    payload = load_record(tmp_path, "*-moe_experts_profile.json")
    assert payload["errors"] == [], payload["errors"]
    losses = {r["variant"]: r["loss"] for r in payload["results"]}
    assert set(losses) == {"split", "fused"}
    assert abs(losses["split"] - losses["fused"]) <= 1e-3 * abs(losses["split"]), losses
    for r in payload["results"]:
        assert positive(r["wall_ms"]) and positive(r["loop_ms"])
        assert r["span_ms"] is None  # no device plane on CPU


def test_bench_step_layers_are_ascending_counts_and_the_step_is_their_slope():
    """``--layers`` picks the programs (by default all large enough for XLA to run them as
    command buffers); anything but two or more ascending counts >= 1 is refused, naming the
    flag. The step is the least-squares slope of the programs' times over their layers."""
    import bench_step

    assert bench_step.parse_args([]).layers == bench_step.LAYERS
    assert bench_step.parse_args(["--layers", "4,14"]).layers == (4, 14)
    assert bench_step.parse_args(["--layers", "2,6,9"]).layers == (2, 6, 9)
    for bad in ("12,2", "0,4", "3,3", "5"):
        with pytest.raises(SystemExit):
            bench_step.parse_args(["--layers", bad])
    assert bench_step.slope([4, 8, 12], [10.0, 30.0, 50.0]) == pytest.approx(5.0)
    assert bench_step.slope_stderr([4, 8, 12], [10.0, 30.0, 50.0]) == pytest.approx(0.0)
    assert bench_step.slope_stderr([1, 2], [1.0, 5.0]) is None  # two points fit any line
    assert bench_step.slope_stderr([4, 8, 12, 16], [100.0, 140.0, 200.0, 220.0]) > 1.0
    # one noisy program moves the fitted slope less than it moves a two-point difference
    walls = [100.0, 140.0, 200.0, 220.0]  # 10 us per layer, the third program 20 us slow
    assert abs(bench_step.slope([4, 8, 12, 16], walls) - 10.0) < abs((200 - 100) / 8 - 10.0)
