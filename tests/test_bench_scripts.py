"""The first-call and step benchmarks run on CPU and write their records (apart from
tests/test_benchmarks.py so that the slow smoke tests of the two files spread over the workers)."""

import glob
import json
import os
import statistics

import numpy as np
import pytest
from bench_scripts import bench_module, bm, jax_ep_importable, load_record, positive, run_script

first_call = bench_module("first_call")


def check_spread(stats, runs):
    """One measure's summary over ``runs`` processes: its values, their median, min, max and
    relative spread."""
    values = stats["values"]
    assert len(values) == runs, stats
    assert stats["median"] == pytest.approx(statistics.median(values), rel=1e-5), stats
    assert stats["min"] == min(values) and stats["max"] == max(values), stats
    assert stats["rel_spread"] == pytest.approx(
        (max(values) - min(values)) / statistics.median(values), rel=1e-2, abs=1e-3), stats


def test_first_call_quick(tmp_path):
    # One mode, jax_ep only, the warm case in --quick's 2 fresh processes (~6 s each on CPU); the
    # other cases differ only in how the process warms up (test_first_call_child below), in the
    # step they build (the steps test) or in their XLA flags (the child_env test).
    out = run_script("first_call.py", tmp_path, "--modes", "low_latency", "--no-peer",
                     "--cases", "warm")
    payload = load_record(tmp_path, "8xcpu-*-first_call.json")
    assert payload["errors"] == [], payload["errors"]
    assert payload["processes_per_case"] == 2 and payload["partial"] is False, payload
    assert "median of 2 fresh processes per case [(max - min) / median]" in out, out
    results = payload["results"]
    seen = set()
    for rec in results:
        assert rec["op"] == "first_call" and rec["mode"] == "low_latency", rec
        seen.add((rec["mode"], rec["impl"]))
        for key in ("steady_us", "warm_first_us", "ratio", *first_call.TOP_LEVEL_TIMES):
            assert positive(rec[key]), (key, rec)
        assert rec["cold_us"] is None and rec["aot_first_us"] is None, rec  # not run
        assert rec["ratio"] == pytest.approx(rec["warm_first_us"] / rec["steady_us"], rel=1e-3)
        assert set(rec["cases"]) == {"warm"}, rec["cases"]
        warm = rec["cases"]["warm"]
        assert warm["command_buffers"]
        assert not any(first_call.COMMAND_BUFFER_FLAG in f for f in warm["xla_flags"])
        assert warm["num_runs"] == 2, warm
        for name in ("first_us", "steady_us", "second_us", "steady_alternating_us",
                     "paused_us", *(f"{c}_us" for c in first_call.NEW_ARGUMENT_CALLS)):
            check_spread(warm["measures"][name], 2)
        # The reference backend runs no FFI handler: nothing to count under capture.
        assert warm["measures"]["fresh_args_captured"] is None, warm["measures"]
        moved = warm["measures"]["steady_new_outputs"]
        assert all(0 <= v <= 3 for v in moved["values"]), moved  # of --quick's 3 calls
        # The record's top-level times are the warm case's medians.
        assert rec["warm_first_us"] == warm["measures"]["first_us"]["median"]
        for key in ("steady_us", *first_call.TOP_LEVEL_TIMES):
            assert rec[key] == warm["measures"][key]["median"], key
    expected = {("low_latency", "reference")} if jax_ep_importable() else set()
    assert seen == expected


def test_first_call_sets_command_buffer_types_only_in_the_cases_named_for_them(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    flag = first_call.COMMAND_BUFFER_FLAG
    for case in {*first_call.CASES, *first_call.PEER_CASES}:
        flags = first_call.child_env(case)["XLA_FLAGS"]
        assert flags.startswith("--xla_force_host_platform_device_count=8"), (case, flags)
        assert flags.endswith(flag) == case.endswith("_no_cmdbuf"), (case, flags)
        assert flags.endswith(f"{flag}FUSION") == case.endswith("_fusion_cmdbuf"), (case, flags)
        assert (flag in flags) == case.endswith(("_no_cmdbuf", "_fusion_cmdbuf")), (case, flags)


def process_result(case, impl, **measures):
    return {"case": case, "impl": impl, "ranks": 8, "xla_flags": "", "measures": measures}


def test_first_call_record_takes_medians_over_processes():
    """A case's figures are medians over its processes (not the first, last or mean), with
    min, max, relative spread and every process's value, in process order."""
    args = first_call.parse_args(["--quick"])
    # Each measure's median is neither the first, the last nor the mean of its values.
    got = {"warm": [process_result("warm", "jax_ep", first_us=900.0, steady_us=40.0,
                                   fresh_args_us=700.0, warmup_s=0.5),
                    process_result("warm", "jax_ep", first_us=300.0, steady_us=36.0,
                                   fresh_args_us=250.0, warmup_s=0.75),
                    process_result("warm", "jax_ep", first_us=100.0, steady_us=30.0,
                                   fresh_args_us=200.0, warmup_s=0.25)],
           "warm_no_cmdbuf": [process_result("warm_no_cmdbuf", "jax_ep", first_us=50.0,
                                             steady_us=45.0)]}
    rec = first_call.make_record(args, "low_latency", got)
    first = rec["cases"]["warm"]["measures"]["first_us"]
    assert first == {"median": 300.0, "min": 100.0, "max": 900.0,
                     "rel_spread": pytest.approx(800.0 / 300.0, rel=1e-2),
                     "values": [900.0, 300.0, 100.0]}
    assert rec["warm_first_us"] == 300.0 and rec["steady_us"] == 36.0
    assert rec["fresh_args_us"] == 250.0 and rec["ratio"] == pytest.approx(300.0 / 36.0)
    assert rec["warmup_s"] == 0.75  # one-time costs: the worst process
    assert rec["steady_case"] == "warm" and rec["cases"]["warm"]["num_runs"] == 3
    no_cmdbuf = rec["cases"]["warm_no_cmdbuf"]
    assert not no_cmdbuf["command_buffers"] and no_cmdbuf["measures"]["first_us"] == {
        "median": 50.0, "min": 50.0, "max": 50.0, "rel_spread": 0.0, "values": [50.0]}


def test_first_call_record_of_a_peer_has_no_warm_case():
    """A peer runs cold and aot only (no warm-up to call): its record says so, and its steady
    state comes from the aot processes."""
    args = first_call.parse_args(["--quick"])
    got = {"cold": [process_result("cold", "all_to_all", first_us=900.0, steady_us=40.0)],
           "aot": [process_result("aot", "all_to_all", first_us=120.0, steady_us=30.0),
                   process_result("aot", "all_to_all", first_us=140.0, steady_us=40.0)]}
    rec = first_call.make_record(args, "low_latency", got)
    assert rec["warm_first_us"] is None and rec["ratio"] is None, rec
    assert rec["steady_us"] == 35.0, rec
    assert rec["aot_ratio"] == pytest.approx(130.0 / 35.0, rel=1e-5), rec
    assert rec["cold_us"] == 900.0 and rec["steady_case"] == "aot", rec


@pytest.mark.parametrize(("mode", "case", "impl"), [("low_latency", "cold", "jax_ep"),
                                                    ("normal", "aot", "all_to_all")])
def test_first_call_child(tmp_path, mode, case, impl):
    """A child process's measures for the cases the script test above does not run (here in
    this process, on jax_ep's reference backend wherever the suite runs): every call with new
    arguments timed, no capture count without FFI handlers, output moves counted."""
    if impl == "jax_ep" and not jax_ep_importable():
        pytest.skip("jax_ep not importable")
    path = os.path.join(str(tmp_path), "child.json")
    args = first_call.parse_args(["--quick", "--backend", "reference", "--child",
                                  f"{mode},{case},{impl}", "--child-out", path])
    first_call.run_child(args)
    with open(path) as f:
        result = json.load(f)
    measures = result["measures"]
    assert result["case"] == case and result["mode"] == mode, result
    for name in ("first_us", "steady_us", "second_us", "steady_alternating_us", "paused_us",
                 *(f"{c}_us" for c in first_call.NEW_ARGUMENT_CALLS)):
        assert positive(measures[name]), (name, measures)
    for name in first_call.NEW_ARGUMENT_CALLS:
        assert measures[f"{name}_captured"] is None, measures  # no FFI handler here
        assert measures[f"{name}_new_outputs"] in (0, 1), measures
    assert 0 <= measures["steady_new_outputs"] <= args.steady_calls, measures
    assert ("compile_s" in measures) == (case == "aot"), measures


@pytest.mark.parametrize(("mode", "impl"), [("normal", "all_to_all"), ("normal", "jax_ep"),
                                            ("low_latency", "all_to_all")])
def test_first_call_steps_run(mode, impl):
    """The steps of first_call.py that its script test above does not run."""
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
