"""benchmarks/bench_overlap.py runs on CPU (--quick) and writes records with the fields the
overlap figures need; its peers' segment computes what jax_ep's does."""

import json
import re

import bench_scripts
import jax
import jax.numpy as jnp
import numpy as np

import jax_ep
from jax_ep import testing

bm = bench_scripts.bm
bench_overlap = bench_scripts.bench_module("bench_overlap")

def test_quick_run_writes_the_overlap_records(tmp_path):
    out = bench_scripts.run_script("bench_overlap.py", tmp_path, "--cases",
                                   "train:bench,decode:bench", "--steps", "1", "--repeats", "1",
                                   "--unpinned", "--note", "test")
    for mode in ("train", "decode"):
        (path,) = tmp_path.glob(f"*-overlap-{mode}-bench.json")
        record = json.loads(path.read_text())
        for key in ("op", "mode", "ranks", "tokens", "hidden", "serial_us", "overlapped_us",
                    "compute_us", "comm_us", "hidden_fraction", "commit", "command", "note"):
            assert key in record, key
        assert record["op"] == "overlap_step" and record["mode"] == mode
        assert record["ranks"] >= 2 and record["note"] == "test"
        assert all(record[k] > 0 for k in ("serial_us", "overlapped_us", "compute_us",
                                           "comm_us"))
        unpinned = record["programs"]["unpinned"]
        assert unpinned["wall_us"] > 0 and "largest_us" in unpinned, unpinned
        peers = record["peers"]
        assert peers["all_to_all"]["wall_us"] > 0, peers
        # XLA:CPU has no ragged_all_to_all: its row says so.
        assert peers["ragged_all_to_all"] == "not run: XLA:CPU has no ragged_all_to_all", peers
    # Progress rounded; on CPU the table says what its times are worth and leaves out the
    # figures that need a GPU's trace and streams.
    assert "us/step" in out and not re.search(r"\d\.\d{3,} us/step", out), out
    assert "say nothing about GPU speed" in out.splitlines()[0], out
    assert "saved/comm" in out and "hidden: the share of jax_ep's kernel time" in out
    for line in out.splitlines():
        if line.endswith("num_sms=24"):
            assert line.split()[-3:-1] == ["-", "-"], line


def test_the_peers_segment_computes_the_jax_ep_segment():
    """The all_to_all peer's two micro-batches (XLA's own overlap) and jax_ep's two_batch stages
    compute one segment: the same forward bits and, for training, gradients within bfloat16
    roundings (the router's too: the weights travel as data)."""
    mesh = bm.make_mesh(2)
    shape, ranks = bench_overlap.QUICK, 2
    params = jax.device_put(bench_overlap.make_params(shape, ranks, jax.random.key(0)),
                            bm.sharded(mesh))
    x = jax.device_put(jax.random.normal(jax.random.key(1), (ranks * shape["train"],
                                                            shape["hidden"])).astype(jnp.bfloat16),
                       bm.sharded(mesh))
    inputs = (params, x, *bench_overlap.routing_for(mesh, params, x, shape["topk"]))
    buf = jax_ep.Buffer(mesh, "ep", num_experts=shape["experts"], hidden=shape["hidden"],
                        max_tokens_per_rank=shape["train"] // 2, num_topk=shape["topk"])
    ours = bench_overlap.two_batch_segment(
        bench_overlap.make_stages("ep", buf, shape, "auto", ranks))
    peer = bench_overlap.peer_segment("all_to_all", shape, "auto", ranks)

    def run(segment, mode, **kw):
        return bench_overlap.build_program(mesh, segment, inputs, mode, **kw)(*inputs)
    np.testing.assert_array_equal(np.asarray(run(peer, "decode", check_vma=False)),
                                  np.asarray(run(ours, "decode")))
    want = jax.tree.leaves(run(ours, "train"))
    got = jax.tree.leaves(run(peer, "train", check_vma=False))
    assert len(got) == len(want) == 6
    for n, (g, w) in enumerate(zip(got, want, strict=True)):
        testing.assert_layer_close(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   dtype=jnp.bfloat16, num_terms=shape["hidden"],
                                   what=f"gradient {n}")
