"""NumPy oracle of docs/api.md's semantics and routing generators, for tests, demo, benchmarks.

Arrays here are *global*: a leading ``[R]`` axis holds every rank's per-rank array, as
``jax.shard_map`` with ``in_specs=P(axis)`` on a ``[R*T, ...]`` array would split it.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

# ------------------------------------------------------------------------------------ routing
ROUTINGS = ("uniform", "with_minus_one", "one_hot_expert", "empty_ranks", "all_minus_one",
            "skewed")


def make_routing(kind, rng, num_ranks, num_tokens, num_experts, num_topk):
    """``(topk_idx [R, T, K] int32, topk_weights [R, T, K] float32)`` of one routing kind.

    Ids of one token are always distinct (as top-k produces).
    """
    R, T, E, K = num_ranks, num_tokens, num_experts, num_topk
    scores = rng.random((R, T, E))
    if kind == "one_hot_expert":      # every token picks expert 0 (+ its other top-k)
        scores[..., 0] += 2.0
    elif kind == "empty_ranks":       # experts of the last half of the ranks are never chosen
        keep = max(E // R * max(R // 2, 1), K)
        scores[..., keep:] = -1.0
    elif kind == "skewed":            # Zipf-like popularity
        scores *= (1.0 / np.arange(1, E + 1)) ** 1.5
    idx = np.argsort(-scores, axis=-1)[..., :K].astype(np.int32)
    if kind == "with_minus_one":
        idx = np.where(rng.random(idx.shape) < 0.3, -1, idx).astype(np.int32)
    elif kind == "all_minus_one":
        idx = np.full(idx.shape, -1, np.int32)
    weights = rng.random((R, T, K)).astype(np.float32)
    return idx, weights


def make_node_limited_routing(rng, num_ranks, num_tokens, num_experts, num_topk, num_hosts,
                              max_hosts, group_top=2):
    """``topk_idx [R, T, K] int32`` of DeepSeek-V3's node-limited routing over iid uniform scores.

    The experts are split into ``num_hosts`` equal groups, one a host (expert ``x`` lives on host
    ``x // (E / num_hosts)``). A group scores the sum of its ``group_top`` best expert scores; a
    token keeps its ``max_hosts`` best groups and picks its top-K experts among theirs. With
    ``max_hosts >= num_hosts`` this is uniform top-K (every host kept). Ids of a token are
    distinct. Rank by rank, so that ``[R, T, E]`` scores are never held at once.
    """
    R, T, E, K = num_ranks, num_tokens, num_experts, num_topk
    if E % num_hosts or K > max_hosts * (E // num_hosts) or E // num_hosts < group_top:
        raise ValueError(f"num_experts={E} must split into num_hosts={num_hosts} groups of at "
                         f"least group_top={group_top}, with num_topk={K} <= "
                         f"max_hosts={max_hosts} x group size")
    out = np.empty((R, T, K), np.int32)
    for r in range(R):
        scores = rng.random((T, E))
        if max_hosts < num_hosts:
            groups = scores.reshape(T, num_hosts, E // num_hosts)
            group_score = np.partition(groups, -group_top, axis=-1)[..., -group_top:].sum(-1)
            kept = np.argpartition(-group_score, max_hosts - 1, axis=-1)[:, :max_hosts]
            keep = np.zeros((T, num_hosts), bool)
            np.put_along_axis(keep, kept, True, axis=1)
            groups[~keep] = -1.0  # below every score: never picked
        out[r] = np.argpartition(-scores, K - 1, axis=-1)[:, :K]
    return out


def fold_traffic(traffic, num_ranks, ranks_per_host, field="bytes"):
    """Per source rank, what it sent to other ranks of its host and to other hosts.

    Args:
      traffic: the transport's counts, an iterable of dicts with ``src``, ``dst`` and ``field``
        (the emulated proxy's ``traffic()`` rows, of every rank's proxy), or a ``[R, R]`` array
        indexed ``[src, dst]``.
      num_ranks: R; ranks ``r`` and ``r'`` share a host iff ``r // ranks_per_host ==
        r' // ranks_per_host``.
      field: ``"bytes"``, ``"puts"`` or ``"signals"`` (dict rows only).

    Returns:
      ``(same_host [R], cross_host [R])`` float64: what each rank sent to the other ranks of its
      host, and to ranks of other hosts. What a rank sends to itself is a local copy and counts
      in neither.
    """
    if isinstance(traffic, np.ndarray):
        matrix = np.array(traffic, np.float64)  # a copy: the diagonal is cleared below
        if matrix.shape != (num_ranks, num_ranks):
            raise ValueError(f"traffic matrix shape {matrix.shape}, expected "
                             f"({num_ranks}, {num_ranks})")
    else:
        matrix = np.zeros((num_ranks, num_ranks), np.float64)
        for row in traffic:
            matrix[row["src"], row["dst"]] += row[field]
    if num_ranks % ranks_per_host:
        raise ValueError(f"num_ranks={num_ranks} is not a multiple of "
                         f"ranks_per_host={ranks_per_host}")
    host = np.arange(num_ranks) // ranks_per_host
    same = host[:, None] == host[None, :]
    np.fill_diagonal(matrix, 0.0)
    return (matrix * same).sum(1), (matrix * ~same).sum(1)


# ----------------------------------------------------------------------------------- normal
def _experts_rank(topk_idx, num_experts, num_ranks):
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    return np.where(valid, topk_idx // (num_experts // num_ranks), -1)


def layout(topk_idx, num_experts, num_ranks):
    """Per rank: ``num_tokens_per_rank [R]``, ``num_tokens_per_expert [E]``,
    ``is_token_in_rank [T, R]``."""
    out = []
    for idx in topk_idx:
        expert_rank = _experts_rank(idx, num_experts, num_ranks)
        is_in = np.stack([(expert_rank == r).any(1) for r in range(num_ranks)], axis=1)
        valid = (idx >= 0) & (idx < num_experts)
        per_expert = np.bincount(idx[valid], minlength=num_experts).astype(np.int32)
        out.append(dict(num_tokens_per_rank=is_in.sum(0).astype(np.int32),
                        num_tokens_per_expert=per_expert, is_token_in_rank=is_in))
    return out


def dispatch(x, topk_idx, topk_weights, num_experts, capacity=None, scales=None):
    """Normal dispatch of every rank. Returns one dict per receiving rank with ``recv_x [C,H]``
    (zero past num_recv_tokens), ``recv_scales``, ``recv_topk_idx``, ``recv_topk_weights``,
    ``num_recv_tokens``, ``num_recv_tokens_per_expert``, ``recv_src``, and ``send_pos``
    (``[T, R]`` of that rank as a sender)."""
    R, T = topk_idx.shape[:2]
    E_loc = num_experts // R
    C = R * T if capacity is None else capacity
    expert_rank = [_experts_rank(i, num_experts, R) for i in topk_idx]
    out = []
    for r in range(R):
        rows = [(s, t) for s in range(R) for t in range(T) if (expert_rank[s][t] == r).any()]
        n = len(rows)
        recv_x = np.zeros((C,) + x.shape[2:], x.dtype)
        recv_scales = None if scales is None else np.zeros((C,) + scales.shape[2:], np.float32)
        recv_idx = np.full((C, topk_idx.shape[2]), -1, np.int32)
        recv_w = np.zeros((C, topk_idx.shape[2]), np.float32)
        recv_src = np.full((C,), -1, np.int32)
        for i, (s, t) in enumerate(rows[:C]):
            recv_x[i] = x[s, t]
            if scales is not None:
                recv_scales[i] = scales[s, t]
            mine = expert_rank[s][t] == r
            recv_idx[i] = np.where(mine, topk_idx[s, t] - r * E_loc, -1)
            recv_w[i] = np.where(mine, topk_weights[s, t], 0.0)
            recv_src[i] = s * T + t
        per_expert = np.array([(recv_idx == e).any(1).sum() for e in range(E_loc)], np.int32)
        out.append(dict(recv_x=recv_x, recv_scales=recv_scales, recv_topk_idx=recv_idx,
                        recv_topk_weights=recv_w, num_recv_tokens=n,
                        num_recv_tokens_per_expert=per_expert, recv_src=recv_src))
    for s in range(R):
        send_pos = np.full((T, R), -1, np.int32)
        for r in range(R):
            row = 0
            for s2 in range(R):
                for t in range(T):
                    if (expert_rank[s2][t] == r).any():
                        if s2 == s:
                            send_pos[t, r] = row
                        row += 1
        out[s]["send_pos"] = send_pos
    return out


def combine(y, recv_src, num_tokens):
    """``y [R, C, H]`` rows back to their sources, summed in float64: ``[R, T, H]``."""
    R = y.shape[0]
    out = np.zeros((R, num_tokens) + y.shape[2:], np.float64)
    for r in range(R):
        for i, src in enumerate(recv_src[r]):
            if src >= 0:
                out[src // num_tokens, src % num_tokens] += y[r, i].astype(np.float64)
    return out


def sum_by_host(terms, ranks, rank_hosts=None, *, dtype, partial_dtype=None):
    """Sums of terms in the order and with the roundings of a combine (docs/api.md, "combine").

    Per host, ascending: the host's terms added in float32 in ascending rank order from +0,
    that partial sum rounded to ``partial_dtype``; then the partial sums added in float32 in
    ascending host order from +0, the total rounded to ``dtype``. With one host this is the
    float32 sum over all terms in rank order, rounded once.

    Args:
      terms: ``[N, S, ...]`` the terms of N sums, any float dtype (converted to float32).
      ranks: ``[N, S]`` int: the rank each term comes from; ``-1`` = no term (skipped).
      rank_hosts: host of each rank (ints; hosts are taken in ascending order), or None: one
        host.
      dtype: dtype of the result.
      partial_dtype: what a host's partial sum is rounded to (default ``dtype``; float32 keeps
        it).

    Returns:
      ``[N, ...]`` of ``dtype``.
    """
    terms = np.asarray(terms).astype(np.float32)
    ranks = np.asarray(ranks)
    partial_dtype = dtype if partial_dtype is None else partial_dtype
    valid = ranks >= 0
    if rank_hosts is None:
        host = np.zeros(ranks.shape, np.int64)
    else:
        host = np.asarray(rank_hosts, np.int64)[np.maximum(ranks, 0)]
    last = np.iinfo(np.int64).max  # no term: after every term
    order = np.lexsort((np.where(valid, ranks, last), np.where(valid, host, last)), axis=-1)
    host = np.take_along_axis(np.where(valid, host, last), order, axis=-1)
    valid = np.take_along_axis(valid, order, axis=-1)
    order = order.reshape(order.shape + (1,) * (terms.ndim - 2))
    terms = np.take_along_axis(terms, order, axis=1)
    expand = (slice(None),) + (None,) * (terms.ndim - 2)
    total = np.zeros(terms.shape[:1] + terms.shape[2:], np.float32)
    partial = np.zeros_like(total)
    for j in range(terms.shape[1]):
        partial = np.where(valid[:, j][expand], partial + terms[:, j], partial)
        ends = valid[:, j] & ((j + 1 == terms.shape[1]) or (host[:, j + 1] != host[:, j]))
        sent = partial.astype(partial_dtype).astype(np.float32)
        total = np.where(ends[expand], total + sent, total)
        partial = np.where(ends[expand], np.float32(0), partial)
    return total.astype(dtype)


def combine_in_order(y, recv_src, num_tokens, rank_hosts=None):
    """Normal combine of every rank, bit for bit: ``y [R, C, ...]`` rows back to their sources,
    summed as ``sum_by_host`` does (partial sums rounded to ``y``'s dtype): ``[R, T, ...]`` of
    ``y``'s dtype."""
    y = np.asarray(y)
    R = y.shape[0]
    terms = np.zeros((R * num_tokens, R) + y.shape[2:], np.float32)
    ranks = np.full((R * num_tokens, R), -1, np.int64)
    for r in range(R):
        rows = np.flatnonzero(np.asarray(recv_src[r]) >= 0)
        sources = np.asarray(recv_src[r])[rows]
        terms[sources, r] = y[r, rows].astype(np.float32)
        ranks[sources, r] = r
    out = sum_by_host(terms, ranks, rank_hosts, dtype=y.dtype)
    return out.reshape((R, num_tokens) + y.shape[2:])


# ------------------------------------------------------------------------------ low latency
def low_latency_dispatch(x, topk_idx, num_experts, max_tokens_per_rank):
    """Per receiving rank: ``rows [E_loc][list of (src_rank, token, k)]`` in contract order,
    ``recv_count [E_loc]``, ``recv_src [E_loc, R*T_max]``, the expected ``recv_x`` rows (a list
    per expert of ``x[src, token]``) and ``dropped``: the selections ``(token, k)`` this rank
    sent past the ``T_max`` rows it has at an expert (only when a token repeats an expert)."""
    R, T, K = topk_idx.shape
    E_loc = num_experts // R
    rows = [[[] for _ in range(E_loc)] for _ in range(R)]
    dropped = [[] for _ in range(R)]
    for s in range(R):
        sent = np.zeros(num_experts, np.int64)
        for t in range(T):
            for k in range(K):
                g = topk_idx[s, t, k]
                if not 0 <= g < num_experts:
                    continue
                if sent[g] == max_tokens_per_rank:
                    dropped[s].append((t, k))
                    continue
                sent[g] += 1
                rows[g // E_loc][g % E_loc].append((s, t, k))
    out = []
    for r in range(R):
        recv_src = np.full((E_loc, R * max_tokens_per_rank), -1, np.int32)
        for e in range(E_loc):
            for j, (s, t, _) in enumerate(rows[r][e]):
                recv_src[e, j] = s * max_tokens_per_rank + t
        out.append(dict(rows=rows[r], recv_count=np.array([len(v) for v in rows[r]], np.int32),
                        recv_src=recv_src, dropped=dropped[r],
                        recv_x=[np.stack([x[s, t] for s, t, _ in v]) if v else None
                                for v in rows[r]]))
    return out


def low_latency_combine(y, topk_idx, topk_weights, rows):
    """``y [R, E_loc, R*T_max, H]``, ``rows`` from ``low_latency_dispatch``: ``[R, T, H]``
    float64 weighted sums."""
    R, T, K = topk_idx.shape
    out = np.zeros((R, T, y.shape[-1]), np.float64)
    for r in range(R):
        for e, selections in enumerate(rows[r]["rows"]):
            for j, (s, t, k) in enumerate(selections):
                out[s, t] += float(topk_weights[s, t, k]) * y[r, e, j].astype(np.float64)
    return out


def fp8_cast(x, round_scale=False):
    """Per token, per 128 channels: ``(x / scale, scale)`` in float32 before the e4m3 rounding
    (compare after casting both to float8_e4m3fn)."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, 128)
    scale = np.maximum(np.abs(blocks).max(-1), np.float32(1e-4)) / np.float32(448.0)
    if round_scale:
        scale = np.exp2(np.ceil(np.log2(scale.astype(np.float64)))).astype(np.float32)
    return (blocks / scale[..., None]).reshape(x.shape), scale.astype(np.float32)


# ---------------------------------------------------------------------------- comparisons
# Relative errors, worst case over a binade (8 significant bits for bf16, 4 for e4m3).
BF16_OUT_RTOL = 2.0**-8   # one bf16 rounding (half an ulp)
F32_SUM_RTOL = 2.0**-20   # float32 accumulation of a few terms, in any order
# An e4m3 term: half a step plus the one step DESIGN allows the kernels (1.5 * 2^-3), then the
# bf16 rounding of the dequantised row.
FP8_TERM_RTOL = 1.5 * 2.0**-3 + 2.0**-8


ROW_FLOOR_RTOL = 2.0**-16  # of a row's largest magnitude: results that cancel to ~0


def rounding_rtol(dtype):
    """Half an ulp, relative: one rounding to ``dtype`` (2^-8 for bfloat16, 2^-24 for
    float32)."""
    return float(ml_dtypes.finfo(dtype).eps) / 2


def sum_rtol(num_terms, dtype=np.float32):
    """Error of a sum of ``num_terms`` terms accumulated in ``dtype`` in any order, per unit
    of the terms' absolute sum: twice the classic ``n * eps / 2`` bound, for accumulators
    (tensor cores) that round less often than every addition. 2^-20 (F32_SUM_RTOL) at 8
    float32 terms."""
    return max(int(num_terms), 1) * float(ml_dtypes.finfo(dtype).eps)


def assert_sums_close(got, want, magnitude, *, term_rtol=F32_SUM_RTOL,
                      out_rtol=BF16_OUT_RTOL, row_rtol=ROW_FLOOR_RTOL, what="sum"):
    """Checks every element of a weighted sum against its own tolerance.

    ``want[..., H]`` is the exact sum ``sum_i w_i * y_i`` of each element and
    ``magnitude[..., H]`` the sum of its terms' absolute values ``sum_i |w_i * y_i|`` (the
    oracle run on ``abs(w)``, ``abs(y)``; it grows with the number of summed terms). Element
    ``j`` passes when ``|got - want| <= out_rtol * |want| + term_rtol * magnitude +
    row_rtol * max(magnitude of j's row)``: rounding of the result, rounding of each term
    (e.g. an fp8 cast of every row, or sum_rtol of its accumulation), and a floor from the
    row's own scale for results that cancel to ~0 (the rows of one token, never the maximum
    of the whole tensor: an error in small channels is not hidden by large ones elsewhere).
    Raises AssertionError naming the worst element.
    """
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    magnitude = np.asarray(magnitude, np.float64)
    assert got.shape == want.shape == magnitude.shape, (got.shape, want.shape, magnitude.shape)
    row_floor = row_rtol * magnitude.max(axis=-1, keepdims=True) if got.size else 0.0
    tol = out_rtol * np.abs(want) + term_rtol * magnitude + row_floor
    excess = np.abs(got - want) - tol
    bad = ~(excess <= 0)  # NaN counts as bad
    if bad.any():
        worst = np.unravel_index(np.argmax(np.where(np.isnan(excess), np.inf, excess)),
                                 excess.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements outside their tolerance; worst "
            f"at {tuple(int(i) for i in worst)}: got {got[worst]!r}, want {want[worst]!r}, "
            f"tolerance {tol[worst]!r}")


def assert_combine_close(got, rows, recv_src, num_tokens, *, rank_hosts=None, what="combine"):
    """Normal-mode combine ``got [R, T, ...]`` against the sums of the rows it combines
    (``rows [R, C, ...]``, their sources ``recv_src [R, C]``), per element
    (``assert_sums_close``): each row is a term, summed in float32 (``sum_rtol`` of the most
    rows of one token), the result rounded once to ``got``'s dtype. With ``rank_hosts`` (host
    of each rank) spanning several hosts, each host's partial sum is rounded to ``got``'s dtype
    too: half an ulp of that partial sum, at most of the element's magnitude, per element."""
    rows = np.asarray(rows).astype(np.float64)
    recv_src = np.asarray(recv_src)
    sources = recv_src[recv_src >= 0]
    most = int(np.bincount(sources).max()) if sources.size else 1
    unit = rounding_rtol(np.asarray(got).dtype)
    partials = unit if rank_hosts is not None and len(set(rank_hosts)) > 1 else 0.0
    assert_sums_close(got, combine(rows, recv_src, num_tokens),
                      combine(np.abs(rows), recv_src, num_tokens),
                      term_rtol=sum_rtol(most) + partials, out_rtol=unit, what=what)


def assert_products_close(got, want, magnitude, num_terms, *, operand_rtol=0.0, dtype=None,
                          what="product"):
    """Matmul results (a grouped GEMM's value, dx or dw) per element (``assert_sums_close``):
    ``want`` the product in float32 or wider, ``magnitude`` the same product of the operands'
    absolute values (it grows with the ``num_terms`` each element sums). Each term carries
    ``operand_rtol`` (e.g. a cotangent rounded to bfloat16, or ``want``'s own rounding) and the
    float32 accumulation of ``num_terms`` (``sum_rtol``); the result one rounding to ``dtype``
    (the product's, when ``got`` was cast after it; default ``got``'s)."""
    got = np.asarray(got)
    assert np.isfinite(got.astype(np.float64)).all(), f"{what}: non-finite values"
    assert_sums_close(got, want, magnitude, term_rtol=operand_rtol + sum_rtol(num_terms),
                      out_rtol=rounding_rtol(got.dtype if dtype is None else dtype), what=what)


# A layer of products with a nonlinearity between them (an MoE layer, its experts' swiglu),
# in `dtype` against its float32 reference on the same inputs, counted in roundings of `dtype`:
# a term's own path (x, the weights, the gate and up products, the swiglu, the down product)
# and, of each row's largest magnitude, what the inner products' cancelling sums leave.
LAYER_TERM_ROUNDINGS = 4
LAYER_ROW_ROUNDINGS = 8


def assert_layer_close(got, want, magnitude=None, *, dtype, num_terms, what="layer"):
    """A layer's output or gradient per element (``assert_sums_close``): ``magnitude`` the sum
    of the absolute values of the terms summed last (a token's ``sum_k |gate_k *
    expert_k(x)|``), ``|want|`` where there is no such sum; ``num_terms`` the longest sum
    inside (hidden size, tokens of an expert). The tolerance is per element and per row,
    never from the tensor's maximum: LAYER_TERM_ROUNDINGS roundings to ``dtype`` of the
    element's magnitude, LAYER_ROW_ROUNDINGS of its row's largest magnitude, and ``sum_rtol``
    of ``num_terms`` float32 additions of both."""
    got = np.asarray(got)
    assert np.isfinite(got.astype(np.float64)).all(), f"{what}: non-finite values"
    want = np.asarray(want, np.float64)
    magnitude = np.abs(want) if magnitude is None else magnitude
    unit, accumulation = rounding_rtol(dtype), sum_rtol(num_terms)
    assert_sums_close(got, want, magnitude, term_rtol=LAYER_TERM_ROUNDINGS * unit + accumulation,
                      out_rtol=unit, row_rtol=LAYER_ROW_ROUNDINGS * unit + accumulation,
                      what=what)
