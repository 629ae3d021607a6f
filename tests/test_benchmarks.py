"""The benchmark scripts run end to end on CPU (8 host devices, reference backend), write the
result schema, and their peers (all_to_all, ragged_all_to_all) move the right rows.

The scripts run as subprocesses with small shapes (``--quick``); jax_ep's CUDA backend and
ragged_all_to_all are skipped there (no GPU; XLA:CPU has no ragged_all_to_all), so the records
are the reference backend's and all_to_all's. ragged_all_to_all's offsets are checked in-process
against an all_gather emulation of the collective.
"""

import ast
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bench_scripts import (
    BENCH_DIR,
    bench_module,
    bi,
    bm,
    bp,
    br,
    bt,
    jax_ep_importable,
    load_record,
    positive,
    run_script,
)
from harness import emulated_ragged_all_to_all
from jax.sharding import Mesh

bench_ep = bench_module("bench_ep")

RECORD_KEYS = {"op": str, "impl": str, "dtype": str, "ranks": int, "tokens": int, "hidden": int,
               "topk": int, "experts": int, "measured_us": float, "noise_us": float,
               "below_noise": bool}
OPS = {"layout", "dispatch", "combine", "low_latency_dispatch", "low_latency_combine"}
IMPLS = {"jax_ep", "reference", "all_to_all", "ragged_all_to_all",
         "ragged_all_to_all_decomposer"}


def test_bench_ep_quick(tmp_path):
    # Every call's outputs kept: more work per op, so that CPU timing noise stays below it. One
    # low-latency token count (--quick has 1 and 8; the sweep's code is the same). H=128
    # (--quick: 512), the fp8 block: the script's plumbing is the same at any width, and at
    # conftest's -O0 the runs of the 26 programs took a third of the test at 512.
    stdout = run_script("bench_ep.py", tmp_path, "--outputs", "all", "--ll-tokens", "8",
                        "--hidden", "128")
    payload = load_record(tmp_path, "8xcpu-*[0-9].json")
    results = payload["results"]
    assert results, payload
    # No error on CPU: a time that CPU timer noise drowns is a record that says so.
    assert payload["errors"] == [], payload["errors"]
    for rec in results:
        for key, kind in RECORD_KEYS.items():
            assert isinstance(rec[key], kind), (key, rec)
        assert rec["op"] in OPS and rec["impl"] in IMPLS, rec
        assert rec["dtype"] in ("bf16", "fp8"), rec
        assert rec["ranks"] == 8 and rec["topk"] == 8 and rec["experts"] == 32, rec
        assert positive(rec["bytes_per_rank"]) or rec["op"] == "layout", rec
        if rec["below_noise"]:
            assert rec["time_us"] is None and rec["gbps"] is None, rec
            assert rec["measured_us"] <= rec["noise_us"], rec
            continue
        assert positive(rec["time_us"]) and rec["time_us"] > rec["noise_us"], rec
        if rec["op"] == "layout":
            assert rec["gbps"] is None, rec
        else:
            # NVLink's share is a GPU figure: none on CPU.
            assert positive(rec["gbps"]) and rec["nvlink_share"] is None, rec
    # No GPU: jax_ep's kernels and ragged_all_to_all are skipped, saying why.
    assert "jax_ep" in payload["skipped"] and "ragged_all_to_all" in payload["skipped"]
    assert any(r["impl"] == "all_to_all" and r["op"] == "dispatch" for r in results), results

    def reported(impl):
        return {(r["op"], r["dtype"], r["tokens"]) for r in results if r["impl"] == impl}

    cases = {("dispatch", "bf16", 128), ("dispatch", "fp8", 128), ("combine", "bf16", 128)} | {
        (op, dt, 8) for op, dt in [("low_latency_dispatch", "fp8"),
                                   ("low_latency_dispatch", "bf16"),
                                   ("low_latency_combine", "bf16")]}
    assert reported("all_to_all") == cases
    if jax_ep_importable():
        assert reported("reference") == cases | {("layout", "bf16", 128)}
    # Same shape, same routing -> the same byte count for jax_ep's backends, and for the peers.
    by_case = {}
    for r in results:
        key = (r["op"], r["dtype"], r["tokens"], r["impl"] in bp.PEER_CLASSES)
        by_case.setdefault(key, set()).add(r["bytes_per_rank"])
    assert all(len(v) == 1 for v in by_case.values()), by_case
    # The table is printed last: a row per record, each with a figure or words.
    lines = stdout.strip().splitlines()
    assert "x best peer" in lines[-1] and "NVL%" not in stdout
    assert "say nothing about GPU speed" in stdout
    rows = lines[lines.index(next(x for x in lines if x.startswith("op "))) + 2:-1]
    assert len(rows) == len(results) and not any("ERROR" in row for row in rows), rows
    assert sum("below noise (±" in row for row in rows) == sum(
        r["below_noise"] for r in results), rows


def test_bench_ep_sweep_writes_plots(tmp_path):
    # One op: the sweep's sizes and both plots (a plot per mode, whatever ran) are what is new.
    # --out names the file (run_script's folder comes first; the last --out wins).
    run_script("bench_ep.py", tmp_path, "--sweep", "--impls", "all_to_all", "--ops", "dispatch",
               "--sweep-tokens", "32,64", "--tokens", "64", "--out", str(tmp_path / "sw.json"),
               "--outputs", "all")  # outputs: as above
    assert sorted(os.listdir(tmp_path)) == ["sw-low_latency.png", "sw-normal.png", "sw.json"]
    payload = load_record(tmp_path, "sw.json")
    assert payload["errors"] == [], payload["errors"]
    tokens = {r["tokens"] for r in payload["results"] if r["op"] == "dispatch"}
    assert tokens == {32, 64}, payload["results"]
    for plot in payload["plots"]:
        path = os.path.join(str(tmp_path), plot)
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", path
    assert len(payload["plots"]) == 2


def test_bench_ep_out_is_a_folder_or_a_json_file(tmp_path):
    header = {"machine": "8xcpu", "date": "2026-12-04"}
    folder = tmp_path / "results"
    assert br.result_path(str(folder), header) == str(folder / "8xcpu-2026-12-04.json")
    assert br.result_path(str(folder), header, "t") == str(folder / "8xcpu-2026-12-04-t.json")
    assert folder.is_dir()
    named = tmp_path / "new" / "x.json"
    assert br.result_path(str(named), header, "ignored") == str(named)
    assert named.parent.is_dir() and not named.exists()


def test_noise_decides_what_is_a_figure():
    """The noise of a per-op time is twice the standard error of the medians' difference (from
    the samples' median absolute deviation), per call; a time at or below it is no figure."""
    steady = [100.0, 100.0, 100.0]
    assert bt.noise_us(steady, [130.0] * 3, 3) == 0.0
    short, long = [100.0, 110.0, 90.0], [130.0, 140.0, 120.0]  # MAD 10 each
    stderr = 1.2533 * 1.4826 * 10 / 3 ** 0.5
    assert bt.noise_us(short, long, 2) == pytest.approx(2 * (2 * stderr**2) ** 0.5 / 2)
    # One slow call moves neither the medians nor the noise much.
    assert bt.noise_us([100.0, 110.0, 90.0, 5000.0], long, 2) < 2 * bt.noise_us(short, long, 2)
    extra = {"noise_us": 3.25}
    assert bt.below_noise(3.25, extra) and bt.below_noise(-1.0, extra)
    assert not bt.below_noise(3.3, extra)
    assert bt.noise_text(extra) == "below noise (±3.25 us)"
    assert bt.noise_text({"noise_us": 15700.0}) == "below noise (±15.7 ms)"


def test_every_benchmark_option_has_help():
    """Every option of every script in benchmarks/ says what it does in --help (read from the
    scripts' add_argument calls; help=argparse.SUPPRESS hides internal ones on purpose)."""
    missing = []
    for name in sorted(os.listdir(BENCH_DIR)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(BENCH_DIR, name)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "add_argument"
                    and not any(k.arg == "help" for k in node.keywords)):
                missing.append(f"{name}:{node.lineno} {ast.unparse(node.args[0])}")
    assert missing == [], missing


# ----------------------------------------------------------------------------- peers


@pytest.mark.parametrize("peer_name", ["all_to_all", "ragged_all_to_all"])
def test_peers_match_routing(peer_name, monkeypatch):
    """Each peer delivers exactly the rows docs/api.md routes ("Row order": by source rank,
    ascending tokens), with local expert ids and weights, and combine sums them back."""
    if peer_name == "ragged_all_to_all":
        monkeypatch.setattr(bp.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    devices = jax.devices("cpu")[:8]
    num_ranks, tokens, hidden, experts, topk = len(devices), 16, 256, 32, 4
    mesh = Mesh(np.array(devices), (bm.AXIS,))
    idx, w = bi.random_routing(mesh, 3, tokens, experts, topk)
    x = bi.random_rows(mesh, 4, (num_ranks * tokens, hidden))
    peer = bp.PEER_CLASSES[peer_name](num_ranks, experts, topk)

    def step(x, idx, w):
        recv_x, recv_idx, recv_w = peer.dispatch([x], idx, w)
        return recv_x, recv_idx, recv_w, peer.combine(recv_x, peer.plan(idx))

    recv_x, recv_idx, recv_w, combined = bt.shard_mapped(mesh, step, 3)(x, idx, w)
    xs = np.asarray(x.astype(jnp.float32)).reshape(num_ranks, tokens, hidden)
    ids = np.asarray(idx).reshape(num_ranks, tokens, topk)
    ws = np.asarray(w).reshape(num_ranks, tokens, topk)
    per_rank = experts // num_ranks
    got_x = np.asarray(recv_x.astype(jnp.float32)).reshape(num_ranks, -1, hidden)
    got_idx = np.asarray(recv_idx).reshape(num_ranks, -1, topk)
    got_w = np.asarray(recv_w).reshape(num_ranks, -1, topk)
    for r in range(num_ranks):
        want = [(s, t) for s in range(num_ranks) for t in range(tokens)
                if (ids[s, t] // per_rank == r).any()]
        valid = (got_idx[r] >= 0).any(-1)
        assert valid.sum() == len(want)
        if peer_name == "ragged_all_to_all":  # compacted: the valid rows come first
            assert valid[: len(want)].all()
        rows = np.nonzero(valid)[0]
        for row, (s, t) in zip(rows, want, strict=True):
            np.testing.assert_array_equal(got_x[r, row], xs[s, t])
            here = ids[s, t] // per_rank == r
            np.testing.assert_array_equal(got_idx[r, row], np.where(here, ids[s, t] % per_rank,
                                                                    -1))
            np.testing.assert_array_equal(got_w[r, row], np.where(here, ws[s, t], 0.0))
    copies = np.stack([(ids // per_rank == r).any(-1) for r in range(num_ranks)], -1).sum(-1)
    want_combined = xs * copies[..., None]
    np.testing.assert_allclose(
        np.asarray(combined.astype(jnp.float32)).reshape(want_combined.shape), want_combined,
        rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("op", sorted(bench_ep.SPLIT_OPS))
def test_split_halves_programs_run(op):
    """The programs that time the low-latency halves (GPU only in the benchmark) build and run
    on the reference backend: sends chained with one receive after the last, or pairs."""
    jax_ep, why = bm.import_jax_ep()
    if jax_ep is None:
        pytest.skip(why)
    args = bench_ep.parse_args(["--quick"])
    mesh = bm.make_mesh()
    buf = jax_ep.Buffer(mesh, bm.AXIS, num_experts=args.experts, hidden=args.hidden,
                        max_tokens_per_rank=8, num_topk=args.topk, low_latency=True,
                        backend="reference", report_errors=False)
    inputs = bench_ep.Inputs(mesh, args, 8, jax_ep)
    program = bench_ep.jax_ep_program(
        jax_ep, buf, bench_ep.Case("low_latency", op, "bf16", 8), inputs)
    prologue, body, fixed, sets, *epilogue = program
    assert len(epilogue) == (1 if op.endswith("_send") else 0)
    call_args = (tuple(fixed), tuple(tuple(s) for s in sets))
    run = bt.repeated_program(mesh, body, 2, prologue, *epilogue)
    outputs = jax.block_until_ready(run(*call_args))
    assert outputs
    # Only the last call's outputs (and the epilogue's): the same values, fewer of them.
    last = bt.repeated_program(mesh, body, 2, prologue, *epilogue, outputs="last")
    kept = jax.block_until_ready(last(*call_args))
    assert 0 < len(kept) < len(outputs)
    for got, want in zip(kept, outputs[len(outputs) - len(kept):], strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_byte_counts_follow_deepep():
    """Normal: received rows x 2H (fp8: x (1 + 4/128) / 2); low latency: selections x
    (H + H/32 + 16) for fp8, x 2H for bf16 and combine; peers by received rows in both modes."""
    # 2 ranks, 2 experts each, 2 tokens per rank, top-2.
    idx = np.array([[0, 1], [0, 2],      # rank 0: t0 -> rank 0 only, t1 -> ranks 0 and 1
                    [3, -1], [2, 3]])    # rank 1: t0 -> rank 1, t1 -> rank 1
    stats = bi.routing_stats(idx, 2, 4)
    # received rows: rank 0 gets 2 (both from itself), rank 1 gets 3 (1 remote).
    assert stats["recv_rows"] == 2.5 and stats["remote_recv_rows"] == 0.5
    # selections: rank 0 has 4 (1 remote), rank 1 has 3 (0 remote).
    assert stats["selections"] == 3.5 and stats["remote_selections"] == 0.5
    hidden = 1024
    assert bi.bytes_per_rank("dispatch", "bf16", hidden, stats) == (2.5 * 2048, 0.5 * 2048)
    assert bi.bytes_per_rank("dispatch", "fp8", hidden, stats)[0] == 2.5 * (1024 + 32)
    assert bi.bytes_per_rank("combine", "bf16", hidden, stats)[0] == 2.5 * 2048
    assert bi.bytes_per_rank("low_latency_dispatch", "fp8", hidden, stats)[0] == 3.5 * (
        1024 + 32 + 16)
    assert bi.bytes_per_rank("low_latency_dispatch", "bf16", hidden, stats)[0] == 3.5 * 2048
    assert bi.bytes_per_rank("low_latency_combine", "bf16", hidden, stats)[0] == 3.5 * 2048
    assert bi.bytes_per_rank("layout", "bf16", hidden, stats) == (None, None)
    # Peers move a token once per destination rank in low-latency mode too.
    for op in ("low_latency_dispatch", "low_latency_combine"):
        assert bi.bytes_per_rank(op, "bf16", hidden, stats, peer=True) == (2.5 * 2048, 0.5 * 2048)
    assert bi.bytes_per_rank("low_latency_dispatch", "fp8", hidden, stats,
                             peer=True)[0] == 2.5 * (1024 + 32)



def test_phase_timeline_groups_launches_and_finds_the_last_block():
    """benchmarks/phase_timeline.py's reading of the kernels' printf lines: lines of one launch
    (starts microseconds apart) grouped however they are ordered, the warm-up launch dropped,
    marks not reached left out, and the block that ended last named."""
    import phase_timeline as pt

    lines = []
    for launch in range(3):
        base = launch * 5_000_000
        for block in range(4):
            ends = base + 9_000 + 1_000 * (block == 2)
            reached = f"{base + 2_000 + block}" if block != 3 else "0"
            lines.append(f"jax_ep-timeline ll_combine 3 {block} {base + block} {reached} 0 0 0 0 "
                         f"0 {ends}")
    lines.append("unrelated output")
    launches = pt.parse("\n".join(reversed(lines)))
    assert list(launches) == [("ll_combine", 3)]
    runs = launches[("ll_combine", 3)]
    assert len(runs) == 2 and all(sorted(run) == [0, 1, 2, 3] for run in runs)
    rows, last = pt.summarise(runs)
    by_mark = {row[0]: row[1:] for row in rows}
    assert sorted(by_mark) == [0, 1, 7]
    assert by_mark[1][0] == 3  # block 3 never reached mark 1
    assert by_mark[1][1] == 2.0 and by_mark[1][3] == 2.002
    assert by_mark[7][3] == 10.0
    assert all(block == 2 for block, _ in last)
