"""benchmarks/bench_moe_layer.py on CPU: the --quick run writes the result schema, and the three
implementations (jax_ep reference backend, all_to_all, ragged_all_to_all) compute the same MoE
layer, forward and gradients.

XLA:CPU has no ragged_all_to_all, so the in-process checks replace it with an all_gather
emulation of its documented semantics (the script itself skips that impl on CPU).
"""

import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bench_scripts import bench_module, bm, bp, bt, load_record, run_script, timer_noise
from harness import emulated_ragged_all_to_all
from jax.sharding import Mesh

from jax_ep import testing as oracle

bml = bench_module("bench_moe_layer")

RECORD_KEYS = {"op": str, "impl": str, "dtype": str, "ranks": int, "tokens": int, "hidden": int,
               "ffn": int, "topk": int, "experts": int, "time_us": float}


def _jax_ep_importable():
    module, _ = bm.import_jax_ep()
    return module is not None


def test_bench_moe_layer_quick(tmp_path):
    stdout = run_script("bench_moe_layer.py", tmp_path)
    payload = load_record(tmp_path, "8xcpu-*-moe_layer.json")
    assert "partial" not in payload
    # The only error allowed is timer noise; every impl is still accounted for by a result or
    # by such a report.
    noise = timer_noise(payload["errors"])
    assert [e for e in payload["errors"] if e not in noise] == [], payload["errors"]
    assert "ragged_all_to_all" in payload["skipped"]  # no GPU: skipped, saying why
    layers = [r for r in payload["results"] if r["op"] == "moe_layer_fwd_bwd"]
    impls = {r["impl"] for r in [*layers, *noise] if r["op"] == "moe_layer_fwd_bwd"}
    assert impls == ({"jax_ep", "all_to_all"} if _jax_ep_importable() else {"all_to_all"})
    for rec in layers:
        for key, kind in RECORD_KEYS.items():
            assert isinstance(rec[key], kind), (key, rec)
        assert rec["dtype"] == "bf16" and rec["matmul"] == "auto", rec
        assert rec["gate_up"] == "fused", rec
        assert rec["resolved"] == "tiled", rec  # no Hopper GPU here
        assert (rec["ranks"], rec["tokens"], rec["hidden"], rec["ffn"], rec["experts"],
                rec["topk"]) == (8, 64, 256, 128, 16, 2), rec
        assert rec["time_us"] > 0, rec
        assert rec["speedup_vs_best_peer"] > 0 or rec["best_peer"] is None, rec
    experts = [r for r in payload["results"] if r["op"] == "expert_gemms_fwd_bwd"]
    if _jax_ep_importable():  # the expert GEMMs alone: one rank's block, 16 / 8 experts
        reported = experts + [e for e in noise if e["op"] == "expert_gemms_fwd_bwd"]
        assert len(reported) == 1, payload
    if experts:
        (experts,) = experts
        assert (experts["matmul"], experts["experts_local"], experts["rows_used"],
                experts["rows"]) == ("auto", 2, 64 * 2, 8 * 64 * 2), experts
        assert experts["time_us"] > 0 and experts["tflops_per_rank"] > 0, experts
    # The forward check ran for every timed impl and passed.
    assert set(payload["checks"]) == {f"{i}/auto" for i in impls}
    assert all(c["ok"] for c in payload["checks"].values()), payload["checks"]
    lines = stdout.strip().splitlines()
    assert "x best peer" in lines[-1]  # the table is printed last
    assert any(line.startswith("matmul") and "experts" in line for line in lines[-6:])
    assert any(line.startswith("auto->tiled") for line in lines[-4:])


def _fixed_timing(monkeypatch):
    """Programs still compile and run once, but the time is fixed: on CPU a product of these
    sizes is shorter than the timing noise (a non-positive difference is an error row)."""

    def time_per_op_us(short, long, args, *_):
        jax.block_until_ready((short(*args), long(*args)))
        return 1.0, {"t_short_us": 1.0, "t_long_us": 2.0}

    monkeypatch.setattr(bt, "time_per_op_us", time_per_op_us)


def test_bench_library_matmuls_run_every_section(tmp_path, monkeypatch):
    """The tokamax+mosaic sections (experts, gemms, products, layer) with reference kernels in
    place of the GPU ones, in process: records, the forward check, and the table."""
    if not _jax_ep_importable():
        pytest.skip("jax_ep not importable")
    from test_grouped_gemm import _reference_product

    from jax_ep.moe import grouped_gemm

    monkeypatch.setattr(grouped_gemm, "_product", _reference_product)
    monkeypatch.setattr(grouped_gemm, "_import_status", lambda module: (True, module))
    monkeypatch.setattr(grouped_gemm, "library_status", lambda library: (True, library))
    _fixed_timing(monkeypatch)
    bml.main(["--quick", "--hidden", "256", "--ffn", "256", "--matmul", "tokamax+mosaic",
              "--impls", "jax_ep", "--out", str(tmp_path), "--n-long", "2"])
    (path,) = glob.glob(os.path.join(str(tmp_path), "*-moe_layer.json"))
    with open(path) as f:
        payload = json.load(f)
    assert payload["errors"] == [], payload["errors"]
    ops = sorted((r["op"], r.get("library"), r.get("product"), r.get("shape"))
                 for r in payload["results"])
    products = [("expert_gemm_product", lib, p, s) for lib in ("mosaic", "tokamax")
                for p in ("dw", "dx", "forward") for s in ("down", "gate_up")]
    assert ops == sorted([("expert_gemms_fwd_bwd", None, None, None),
                          ("expert_gemm_products_fwd_bwd", None, None, None),
                          ("moe_layer_fwd_bwd", None, None, None)] + products), ops
    assert payload["checks"]["jax_ep/tokamax+mosaic"]["ok"], payload["checks"]
    for rec in payload["results"]:
        assert rec["time_us"] > 0, rec
        if rec["op"] == "expert_gemm_product":
            assert (rec["k"], rec["m"]) == {"gate_up": (256, 512), "down": (256, 256)}[
                rec["shape"]], rec


# ----------------------------------------------------------------------------- same function


def _setup(num_ranks=8, tokens=16, hidden=128, ffn=64, experts=16, topk=4, gate_up="fused"):
    args = bml.parse_args(["--quick", "--tokens", str(tokens), "--hidden", str(hidden),
                           "--ffn", str(ffn), "--experts", str(experts), "--topk", str(topk),
                           "--n-short", "1", "--n-long", "2", "--gate-up", gate_up])
    mesh = Mesh(np.array(jax.devices("cpu")[:num_ranks]), (bm.AXIS,))
    return args, mesh, bml.Inputs(mesh, args)


def _assert_layer_close(got, want, args, name):
    """The bfloat16 layer's results of two implementations per element and row
    (``oracle.assert_layer_close``): the longest sum is the hidden size, the ffn size or an
    expert's tokens."""
    num_terms = max(args.hidden, args.ffn, args.tokens * 8)
    oracle.assert_layer_close(got, want, dtype=jnp.bfloat16, num_terms=num_terms, what=name)


def _grads(mesh, layer, inputs):
    step = bml.fwd_bwd(layer)
    x, idx, w, ct = inputs.sets[0]

    count = len(inputs.weights)

    def fn(*args):
        loss, grads = step(args[:count], *args[count:])
        return loss[None], *grads

    out = bt.shard_mapped(mesh, fn, count + 4)(*inputs.weights, x, idx, w, ct)
    return [np.asarray(a.astype(jnp.float32)) for a in out]


@pytest.mark.skipif(not _jax_ep_importable(), reason="jax_ep not importable")
@pytest.mark.parametrize("impl", ["all_to_all", "ragged_all_to_all"])
def test_implementations_compute_the_same_layer(impl, monkeypatch):
    if impl == "ragged_all_to_all":
        monkeypatch.setattr(bp.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    import jax_ep

    args, mesh, inputs = _setup()
    num_ranks = mesh.shape[bm.AXIS]
    buf = jax_ep.Buffer(mesh, bm.AXIS, num_experts=args.experts, hidden=args.hidden,
                        max_tokens_per_rank=args.tokens, num_topk=args.topk, backend="reference",
                        report_errors=False)
    ref = bml.make_layer("jax_ep", num_ranks, args.experts, args.topk, buf)
    layer = bml.make_layer(impl, num_ranks, args.experts, args.topk)
    want = bml.forward(mesh, ref, inputs)
    got = bml.forward(mesh, layer, inputs)
    assert np.max(np.abs(want)) > 0.1  # a real signal, not zeros
    err, ok = bml.compare(got, want)
    assert ok, err
    # Gradients w.r.t. x and the expert weights agree too (same loss, same function).
    for name, g, w in zip(("loss", "dx", "dw_gate_up", "dw_down"),
                          _grads(mesh, layer, inputs), _grads(mesh, ref, inputs), strict=True):
        _assert_layer_close(g, w, args, name)
    buf.close()


@pytest.mark.skipif(not _jax_ep_importable(), reason="jax_ep not importable")
def test_gate_up_layouts_compute_the_same_layer():
    """--gate-up fused holds the split weights side by side: same forward, and its weight
    gradient is the two split ones side by side."""
    import jax_ep

    (args, mesh, fused), (_, _, split) = (_setup(gate_up=g) for g in ("fused", "split"))
    np.testing.assert_array_equal(np.asarray(fused.weights[0], np.float32), np.concatenate(
        [np.asarray(split.weights[0], np.float32), np.asarray(split.weights[1], np.float32)],
        axis=2))
    buf = jax_ep.Buffer(mesh, bm.AXIS, num_experts=args.experts, hidden=args.hidden,
                        max_tokens_per_rank=args.tokens, num_topk=args.topk, backend="reference",
                        report_errors=False)
    layer = bml.make_layer("jax_ep", mesh.shape[bm.AXIS], args.experts, args.topk, buf)
    err, ok = bml.compare(bml.forward(mesh, layer, fused), bml.forward(mesh, layer, split))
    assert ok, err
    (_, dx, dw_gate_up, dw_down), (_, dx1, dw_gate, dw_up, dw_down1) = (
        _grads(mesh, layer, inputs) for inputs in (fused, split))
    for name, got, want in (("dx", dx, dx1), ("dw_gate_up", dw_gate_up,
                                              np.concatenate([dw_gate, dw_up], axis=2)),
                            ("dw_down", dw_down, dw_down1)):
        _assert_layer_close(got, want, args, name)
    buf.close()


def test_compare_flags_a_different_function():
    rng = np.random.default_rng(0)
    want = rng.standard_normal((64, 32)).astype(np.float32)
    assert bml.compare(want + 1e-3, want)[1]
    wrong = want.copy()
    wrong[3, 5] += 0.5  # one row of one token off: must be caught
    assert not bml.compare(wrong, want)[1]
    assert not bml.compare(want * np.nan, want)[1]


def test_bench_sweeps_library_configs(tmp_path, monkeypatch):
    """--sweep: one product record per configuration of SWEEP_CONFIGS, each measured with its
    configuration in place (seen by the kernels while they trace), the module's restored after."""
    if not _jax_ep_importable():
        pytest.skip("jax_ep not importable")
    from jax_ep.moe import grouped_gemm

    seen = []

    def product(library, product, a, b, sizes):
        configs = {"tokamax": grouped_gemm.TOKAMAX_CONFIGS, "mosaic": grouped_gemm.MOSAIC_CONFIGS}
        seen.append((library, product, dict(configs[library]["contract" if product == "dw"
                                                             else "rows"])))
        from test_grouped_gemm import _reference_product

        return _reference_product(library, product, a, b, sizes)

    before = {k: dict(v) for k, v in grouped_gemm.MOSAIC_CONFIGS.items()}
    # Two configurations of each kind: the plumbing is the same for every one, and each is
    # products to compile (all 14 of mosaic's: 42 products, 13 s).
    monkeypatch.setattr(bml, "SWEEP_CONFIGS", {k: v[:2] for k, v in bml.SWEEP_CONFIGS.items()})
    monkeypatch.setattr(grouped_gemm, "_product", product)
    monkeypatch.setattr(grouped_gemm, "_import_status", lambda module: (True, module))
    monkeypatch.setattr(grouped_gemm, "library_status", lambda library: (True, library))
    _fixed_timing(monkeypatch)
    bml.main(["--quick", "--hidden", "512", "--ffn", "512", "--matmul", "mosaic", "--sweep",
              "--sections", "products", "--out", str(tmp_path), "--n-long", "2"])
    (path,) = glob.glob(os.path.join(str(tmp_path), "*-moe_layer.json"))
    with open(path) as f:
        payload = json.load(f)
    assert payload["errors"] == [], payload["errors"]
    rows = bml.SWEEP_CONFIGS[("mosaic", "rows")]
    contract = bml.SWEEP_CONFIGS[("mosaic", "contract")]
    got = [(r["shape"], r["product"], r["config"]) for r in payload["results"]]
    assert sorted(map(str, got)) == sorted(map(str, [
        (s, p, c) for s in ("gate_up", "down")
        for p, configs in (("forward", rows), ("dx", rows), ("dw", contract)) for c in configs]))
    assert {(p, str(c)) for _, p, c in seen} == {(p, str(c)) for _, p, c in got}
    assert grouped_gemm.MOSAIC_CONFIGS == before

