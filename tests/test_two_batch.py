"""Two micro-batches (jax_ep.moe.two_batch) and the asynchronous ops under them.

CPU (reference backend): the two-micro-batch layer computes what one batch per half computes,
forward and backward, normal and low-latency; the schedule's data dependences, read from the
program lowered for the CUDA backend (no GPU needed), put every compute op of an overlapped
pair between its communication's start and its wait, also through jax.export; mutants of the
dependences are caught.
GPU: the same layer on a Buffer(overlap=True) is bit for bit the layer on a serial Buffer, and
a wait left out (the mutant) gives wrong rows.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ep_mesh, require_extension, require_gpus
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import moe
from jax_ep.backends import cuda, deferred

T, H, E, K, F = 16, 128, 8, 2, 64


def _inputs(rng, mesh, dtype=jnp.float32):
    R = mesh.shape["ep"]
    x = jnp.asarray(rng.standard_normal((R * T, H)), dtype)
    idx = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(R * T)]),
                      jnp.int32)
    w = jnp.asarray(rng.random((R * T, K)), jnp.float32)
    weights = [jnp.asarray(rng.standard_normal(s) * 0.05, dtype)
               for s in ((E, H, F), (E, H, F), (E, F, H))]
    return x, idx, w, weights


def _layer(buf, mesh, micro_batches, matmul="tiled"):
    def body(x, idx, w, wg, wu, wd):
        return moe.moe_ffn(buf, x, idx, w, wg, wu, wd, matmul=matmul, micro_batches=micro_batches)
    return jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))


def _grads(layer, x, idx, w, weights):
    def loss(x, w, *weights):
        return jnp.sum(layer(x, idx, w, *weights).astype(jnp.float32) ** 2)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(x, w, *weights)


def _buffer(mesh, backend, **kw):
    return jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=T, num_topk=K,
                         backend=backend, report_errors=False, **kw)


def test_two_micro_batches_compute_what_each_half_computes(rng):
    mesh = ep_mesh("reference", 2)
    buf = _buffer(mesh, "reference", dtype=jnp.float32)
    x, idx, w, weights = _inputs(rng, mesh)
    one, two = _layer(buf, mesh, 1), _layer(buf, mesh, 2)
    np.testing.assert_array_equal(jax.jit(two)(x, idx, w, *weights),
                                  jax.jit(one)(x, idx, w, *weights))
    g_two = _grads(two, x, idx, w, weights)
    # Per half on its own (rows [0, T/2) and [T/2, T) of each rank): the two-batch layer's
    # token gradients are the halves', and its weight gradients their sum (one add).
    halves = [(slice(r * T + h * T // 2, r * T + (h + 1) * T // 2)) for h in (0, 1)
              for r in range(2)]

    def half(h):
        rows = np.concatenate([np.arange(T * 2)[s] for s in halves[2 * h:2 * h + 2]])
        return _grads(one, x[rows], idx[rows], w[rows], weights), rows

    (g_a, rows_a), (g_b, rows_b) = half(0), half(1)
    for i in (0, 1):  # d x, d topk_weights
        np.testing.assert_array_equal(g_two[i][rows_a], g_a[i])
        np.testing.assert_array_equal(g_two[i][rows_b], g_b[i])
    for i in (2, 3, 4):  # the experts' weights
        np.testing.assert_array_equal(g_two[i], g_b[i] + g_a[i])


def test_a_dropped_micro_batch_fails_the_comparison(rng):
    """The comparison above bites: the two-batch layer with B's combine left out (B's rows
    zero) differs."""
    mesh = ep_mesh("reference", 2)
    buf = _buffer(mesh, "reference", dtype=jnp.float32)
    x, idx, w, weights = _inputs(rng, mesh)
    stages = [moe.dispatch_stage(buf),
              moe.expert_stage(buf, lambda p, xs, g: moe.swiglu_experts(xs, g, *p,
                                                                        matmul="tiled")),
              moe.combine_stage(buf)]

    def body(x, idx, w, *weights):
        half = T // 2
        (a, _), (b, _) = moe.two_batch(stages, tuple(weights), ((x[:half], idx[:half],
                                                                  w[:half]), None),
                                       ((x[half:], idx[half:], w[half:]), None))
        return jnp.concatenate([a[0], jnp.zeros_like(b[0])])
    broken = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    assert not np.array_equal(broken(x, idx, w, *weights),
                              jax.jit(_layer(buf, mesh, 1))(x, idx, w, *weights))


def _decode_layer(buf, mesh, micro_batches, use_fp8=False):
    def body(x, idx, w, *weights):
        return moe.low_latency_moe_ffn(
            buf, x, idx, w, lambda p, xs, g: moe.swiglu_experts(xs, g, *p, matmul="tiled"),
            tuple(weights), use_fp8=use_fp8, micro_batches=micro_batches)
    return jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))


@pytest.mark.parametrize("use_fp8", [False, True])
def test_decode_two_micro_batches_equal_one(rng, use_fp8):
    mesh = ep_mesh("reference", 2)
    buf = _buffer(mesh, "reference", low_latency=True)
    x, idx, w, weights = _inputs(rng, mesh, jnp.bfloat16)
    one, two = (jax.jit(_decode_layer(buf, mesh, m, use_fp8))(x, idx, w, *weights)
                for m in (1, 2))
    np.testing.assert_array_equal(two, one)
    # Against the normal-mode layer (same experts, another path): bf16 roundings apart.
    normal = jax.jit(_layer(_buffer(mesh, "reference"), mesh, 1))(x, idx, w, *weights)
    scale = np.abs(np.asarray(normal, np.float32)).max(axis=-1, keepdims=True)
    err = np.abs(np.asarray(one, np.float32) - np.asarray(normal, np.float32))
    assert (err <= (0.1 if use_fp8 else 0.02) * scale).all()


def test_decode_stages_have_no_backward(rng):
    mesh = ep_mesh("reference", 2)
    buf = _buffer(mesh, "reference", low_latency=True)
    x, idx, w, weights = _inputs(rng, mesh, jnp.bfloat16)

    def loss(x):
        out = _decode_layer(buf, mesh, 2)(x, idx, w, *weights)
        return jnp.sum(out.astype(jnp.float32))
    with pytest.raises(ValueError, match="without a backward"):
        jax.jit(jax.grad(loss))(x)


def test_bad_arguments_are_named(rng):
    mesh = ep_mesh("reference", 2)
    buf = _buffer(mesh, "reference")
    x, idx, w, weights = _inputs(rng, mesh, jnp.bfloat16)
    with pytest.raises(ValueError, match="micro_batches must be 1 or 2"):
        jax.jit(_layer(buf, mesh, 3))(x, idx, w, *weights)
    with pytest.raises(ValueError, match="even number of tokens"):
        jax.jit(_layer(buf, mesh, 2))(x[:2 * (T - 1)], idx[:2 * (T - 1)], w[:2 * (T - 1)],
                                      *weights)
    with pytest.raises(ValueError, match="alternate"):
        moe.two_batch([moe.dispatch_stage(buf), moe.combine_stage(buf)], (), None, None)
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="num_sms must be a positive integer"):
            _buffer(mesh, "reference", num_sms=bad)


# --------------------------------------------------- the schedule's dependences (lowered)
def _overlap_pair():
    """One overlapped pair over a CUDA Buffer(overlap=True) that only lowers: B's dispatch
    beside a matmul. Returns the jitted step and its argument shapes."""
    require_extension()  # the suite's rule for a missing _C
    mesh = ep_mesh("reference", 1)
    buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=T, num_topk=K,
                        backend="cuda", lowering_only=True, overlap=True)
    stage = moe.dispatch_stage(buf)

    def body(x, idx, w, a):
        (flow, _), product = deferred.overlap(lambda: stage.forward(((x, idx, w), None))[0],
                                              lambda a: a @ a.T, a)
        return flow[0], product
    args = (jax.ShapeDtypeStruct((T, H), jnp.bfloat16), jax.ShapeDtypeStruct((T, K), jnp.int32),
            jax.ShapeDtypeStruct((T, K), jnp.float32), jax.ShapeDtypeStruct((T, T), jnp.float32))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))), args


def _lowered_overlap():
    """StableHLO of the overlapped pair, lowered for platform cuda on any machine."""
    f, args = _overlap_pair()
    return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _exported_overlap():
    """The pair through jax.export, serialised and read back (as another process gets it)."""
    f, args = _overlap_pair()
    return jax.export.deserialize(jax_ep.export_step(f, *args).serialize()).mlir_module()


def _dependence_problems(text):
    """What the lowered program lacks of the overlap's order: the matmul must depend on the
    async start, the wait on the matmul; the dispatch results returned must be the wait's."""
    uses, defs = {}, {}
    for line in text.splitlines():
        m = re.match(r"\s*(%[\w.]+)(?::\d+)? = (.*)", line)
        if m:
            defs[m.group(1)] = m.group(2)
            uses[m.group(1)] = set(re.findall(r"(%[\w.]+)(?:#\d+)?", m.group(2)))

    def find(pattern):
        return [name for name, rhs in defs.items() if re.search(pattern, rhs)]

    def reaches(src, dst, seen=None):
        seen = set() if seen is None else seen
        if src == dst:
            return True
        seen.add(dst)
        return any(reaches(src, u, seen) for u in uses.get(dst, ()) if u not in seen)

    start = find(r"custom_call @jax_ep_dispatch_async_")
    wait = find(r"custom_call @jax_ep_wait_")
    dot = find(r"dot_general")
    if not (start and wait and dot):
        return [f"missing ops: start {start}, wait {wait}, dot {dot}"]
    problems = []
    if not reaches(start[0], dot[0]):
        problems.append("the matmul does not depend on the async start")
    if not reaches(dot[0], wait[0]):
        problems.append("the wait does not depend on the matmul")
    if not reaches(start[0], wait[0]):
        problems.append("the wait does not take the start's results")
    problems += _aliased_and_read(text)
    returned = re.findall(r"return (.*?) :", text)
    if returned and not reaches(wait[0], re.findall(r"%[\w.]+", returned[-1])[0]):
        problems.append("the returned rows are not the wait's")
    return problems


def _aliased_and_read(text):
    """Waits that alias an operand whose value another of their operands also carries (directly
    or through an optimization barrier): XLA then copies it on its stream, before the wait."""
    passes = {}  # barrier result -> its input
    for m in re.finditer(r"(%[\w.]+):\d+ = stablehlo.optimization_barrier (.*?) :", text):
        for i, value in enumerate(v.strip() for v in m.group(2).split(",")):
            passes[f"{m.group(1)}#{i}"] = value

    def source(value):
        while value in passes:
            value = passes[value]
        return value
    problems = []
    for m in re.finditer(r"custom_call @jax_ep_wait_\w+\((.*?)\).*?output_operand_aliases = "
                         r"(.*)", text):
        operands = [source(v.strip()) for v in m.group(1).split(",")]
        for index in map(int, re.findall(r"operand_index = (\d+)", m.group(2))):
            if operands.count(operands[index]) > 1:
                problems.append(f"a wait aliases {operands[index]} and reads it again")
    return problems


def test_overlap_pins_compute_between_start_and_wait():
    assert _dependence_problems(_lowered_overlap()) == []


@pytest.mark.parametrize("mutant", ["no_barrier", "no_after", "no_wait", "aliased_tie"])
def test_a_missing_dependence_is_caught(monkeypatch, mutant):
    """Each dependence the schedule relies on, removed in turn, is reported."""
    require_extension()  # the suite's rule for a missing _C
    pins = {}
    if mutant == "no_barrier":
        pins = {"compute_after_starts": False}
    elif mutant == "aliased_tie":  # the tie also aliased: a copy before the wait would read it
        real = cuda.CudaBackend.wait
        monkeypatch.setattr(cuda.CudaBackend, "wait",
                            lambda self, raw, operands, after=(), unaliased=():
                            real(self, raw, operands, after))
    elif mutant == "no_after":
        real = cuda.CudaBackend.wait
        monkeypatch.setattr(cuda.CudaBackend, "wait",
                            lambda self, raw, operands, after=(), unaliased=():
                            real(self, raw, operands))
    else:
        monkeypatch.setattr(cuda.CudaBackend, "wait",
                            lambda self, raw, operands, after=(), unaliased=(): raw)
    with deferred.pins(**pins):
        assert _dependence_problems(_lowered_overlap()) != []
        assert _dependence_problems(_exported_overlap()) != []


def test_unpinned_waits_follow_their_starts():
    """``deferred.pins(waits_after_compute=False)`` (bench_overlap's --unpinned): each op waits
    right after its start, so the matmul neither follows the start nor precedes the wait."""
    with deferred.pins(waits_after_compute=False):
        problems = _dependence_problems(_lowered_overlap())
    assert "the matmul does not depend on the async start" in problems, problems
    assert "the wait does not depend on the matmul" in problems, problems
    assert _dependence_problems(_lowered_overlap()) == []  # the pins hold again after it


def test_an_exported_overlap_step_keeps_its_dependences():
    """jax.export (serialised and read back, as another process gets it) keeps the pair's
    order; a two-micro-batch training layer exports with every start waited for."""
    assert _dependence_problems(_exported_overlap()) == []

    mesh = ep_mesh("reference", 1)
    buf = _buffer(mesh, "cuda", lowering_only=True, overlap=True)
    layer = _layer(buf, mesh, 2)

    def train_step(x, idx, w, *weights):
        def loss(x, w, *weights):
            return jnp.sum(layer(x, idx, w, *weights).astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(x, w, *weights)
    shapes = [jax.ShapeDtypeStruct(s, d) for s, d in (
        ((T, H), jnp.bfloat16), ((T, K), jnp.int32), ((T, K), jnp.float32),
        ((E, H, F), jnp.bfloat16), ((E, H, F), jnp.bfloat16), ((E, F, H), jnp.bfloat16))]
    text = jax.export.deserialize(
        jax_ep.export_step(jax.jit(train_step), *shapes).serialize()).mlir_module()
    starts = re.findall(r"custom_call @jax_ep_(\w+)_async_", text)
    waits = re.findall(r"custom_call @jax_ep_wait_", text)
    # Forward: two dispatches and two combines; backward: a combine for each dispatch and a
    # cached dispatch for each combine.
    assert sorted(starts) == ["cached_dispatch"] * 2 + ["combine"] * 4 + ["dispatch"] * 2, starts
    assert len(waits) == len(starts)


def _attention_stages(buf):
    """Stages in which each parameter is read by some stages only: an attention stand-in
    before and after the layer, the experts between."""
    return [moe.Compute(lambda p, s: ((jnp.tanh(s[0][0] @ p["attention"]), *s[0][1:]), s[1])),
            moe.dispatch_stage(buf),
            moe.expert_stage(buf, lambda p, xs, g: moe.swiglu_experts(
                xs, g, *p["experts"], matmul="tiled")),
            moe.combine_stage(buf),
            moe.Compute(lambda p, s: ((s[0][0] @ p["attention"],), s[1]))]


def _attention_train_step(buf, mesh, micro_batches):
    """The gradient of a loss of ``_attention_stages`` w.r.t. (params, x)."""
    stages = _attention_stages(buf)

    def body(params, x, idx, w):
        def loss(params, x):
            if micro_batches == 1:
                state = (x, idx, w)
                for stage in stages:
                    if isinstance(stage, moe.Compute):
                        state, _ = stage.fn(params, (state, None))
                    else:
                        (state, _), _ = stage.forward((state, None))
                return jnp.sum(state[0].astype(jnp.float32) ** 2)
            half = x.shape[0] // 2
            ((a,), _), ((b,), _) = moe.two_batch(
                stages, params, ((x[:half], idx[:half], w[:half]), None),
                ((x[half:], idx[half:], w[half:]), None))
            return jnp.sum(jnp.concatenate([a, b]).astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1))(params, x)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


def test_parameters_read_by_some_stages_get_the_halves_gradients(rng):
    """Each parameter's gradient is the sum of the halves' (zero for one no stage reads)."""
    mesh = ep_mesh("reference", 2)
    buf = _buffer(mesh, "reference", dtype=jnp.float32)
    x, idx, w, weights = _inputs(rng, mesh)
    params = {"attention": jnp.asarray(rng.standard_normal((2 * H, H)) * H ** -0.5, jnp.float32),
              "experts": tuple(weights), "unread": jnp.ones((2, 4), jnp.float32)}
    g_params, g_x = _attention_train_step(buf, mesh, 2)(params, x, idx, w)
    one = _attention_train_step(buf, mesh, 1)
    rows = [np.arange(2 * T).reshape(2, 2, T // 2)[:, h].ravel() for h in (0, 1)]
    (g_a, gx_a), (g_b, gx_b) = (one(params, x[r], idx[r], w[r]) for r in rows)
    np.testing.assert_array_equal(g_x[rows[0]], gx_a)
    np.testing.assert_array_equal(g_x[rows[1]], gx_b)
    np.testing.assert_array_equal(g_params["unread"], 0)
    assert float(jnp.abs(g_params["attention"]).max()) > 0
    for got, a, b in zip(jax.tree.leaves(g_params), jax.tree.leaves(g_a), jax.tree.leaves(g_b),
                         strict=True):
        np.testing.assert_allclose(got, a + b, rtol=1e-5, atol=1e-6 * float(jnp.abs(a).max()))


def _wait_operand_types(text):
    """The types of every wait's operands, from the custom calls' signatures."""
    return [t for m in re.finditer(r"custom_call @jax_ep_wait_\w+\(.*?\) \{.*\} : \((.*?)\) ->",
                                   text)
            for t in re.findall(r"tensor<([^>]*)>", m.group(1))]


def test_the_waits_take_no_parameter_sized_operand():
    """In an overlapped pair the waits take the compute's state, not its gradients of the
    parameters: a wait's operand is a buffer XLA writes out whole, so a weight gradient there
    (or the zeros of one for a stage that does not read that weight) is stored and read back
    where XLA would otherwise fuse it into the micro-batches' sum (docs/overlap.md, "Where the
    training step lost")."""
    require_extension()  # the suite's rule for a missing _C
    mesh = ep_mesh("reference", 1)
    buf = _buffer(mesh, "cuda", lowering_only=True, overlap=True)
    S = jax.ShapeDtypeStruct
    params = {"attention": S((H, H), jnp.bfloat16),
              "experts": (S((E, H, F), jnp.bfloat16), S((E, H, F), jnp.bfloat16),
                          S((E, F, H), jnp.bfloat16))}
    text = _attention_train_step(buf, mesh, 2).trace(
        params, S((T, H), jnp.bfloat16), S((T, K), jnp.int32), S((T, K), jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()
    operands = _wait_operand_types(text)
    assert len(re.findall(r"custom_call @jax_ep_wait_", text)) == 8 and operands
    weight_shapes = {f"{H}x{H}xbf16", f"{E}x{H}x{F}xbf16", f"{E}x{F}x{H}xbf16"}
    assert weight_shapes.isdisjoint(operands), sorted(weight_shapes & set(operands))


# ---------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("num_sms", [None, 16])
def test_overlap_buffer_gives_the_serial_buffers_bits(rng, num_sms):
    require_gpus(1)
    mesh = ep_mesh("cuda")
    x, idx, w, weights = _inputs(rng, mesh, jnp.bfloat16)
    serial = _buffer(mesh, "cuda")
    overlapped = _buffer(mesh, "cuda", overlap=True, num_sms=num_sms)
    for matmul in ("tiled", "auto"):
        want = jax.jit(_layer(serial, mesh, 2, matmul))(x, idx, w, *weights)
        got = jax.jit(_layer(overlapped, mesh, 2, matmul))(x, idx, w, *weights)
        np.testing.assert_array_equal(got, want)
        for g, h in zip(_grads(_layer(overlapped, mesh, 2, matmul), x, idx, w, weights),
                        _grads(_layer(serial, mesh, 2, matmul), x, idx, w, weights),
                        strict=True):
            np.testing.assert_array_equal(g, h)
    # Without command buffers too (the async ops never enter them; the rest does not either).
    f = jax.jit(_layer(overlapped, mesh, 2)).lower(x, idx, w, *weights).compile(
        compiler_options={"xla_gpu_enable_command_buffer": ""})
    np.testing.assert_array_equal(f(x, idx, w, *weights),
                                  jax.jit(_layer(serial, mesh, 2))(x, idx, w, *weights))
    overlapped.close()
    serial.close()


@pytest.mark.gpu
def test_a_left_out_wait_reads_rows_before_they_arrive(rng, monkeypatch):
    """The mutant: results taken from the async start without its wait, and summed at once on
    XLA's stream, while one SM still copies them: the sums differ from the serial ones."""
    require_gpus(1)
    mesh = ep_mesh("cuda", 1)
    tokens, hidden = 4096, 7168
    buf = jax_ep.Buffer(mesh, "ep", num_experts=64, hidden=hidden, max_tokens_per_rank=tokens,
                        num_topk=8, backend="cuda", overlap=True, num_sms=1)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16)
    idx = jnp.asarray(np.stack([rng.choice(64, 8, replace=False) for _ in range(tokens)]),
                      jnp.int32)
    w = jnp.asarray(rng.random((tokens, 8)), jnp.float32)
    stage = moe.dispatch_stage(buf)

    def body(x, idx, w):
        (flow, _), _ = deferred.overlap(lambda: stage.forward(((x, idx, w), None))[0],
                                        lambda a: a + 1, w)
        return jnp.sum(flow[0].astype(jnp.float32), axis=1)
    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    want = np.asarray(program(x, idx, w))
    monkeypatch.setattr(cuda.CudaBackend, "wait",
                        lambda self, raw, operands, after=(), unaliased=(): raw)
    got = np.asarray(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"),
                                           out_specs=P("ep")))(x, idx, w))
    assert not np.array_equal(got, want)
    buf.close()
