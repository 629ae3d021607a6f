"""Prints the tables of docs/scaling.md: memory and traffic of jax_ep at 2..256 ranks, and the
traffic by host (same host, cross host) of the flat and hierarchical schemes at 2..32 hosts of 8.

Runs on a CPU (no GPU, no JAX needed; NumPy for the node-limited Monte Carlo). Our workspace
sizes are the formulas of csrc/kernels/normal/workspace.h and csrc/kernels/low_latency/layout.cuh
transcribed to Python.
tests/test_scaling_numbers.py checks the transcription against `jax_ep._C.workspace_bytes` for
every R of the tables (exact equality); so does this script where `jax_ep._C` imports.
DeepEP's sizes are its V1 size-hint formulas (csrc/config.hpp) transcribed, with its recommended
configs.

Usage: python docs/scaling_numbers.py   (run from outside the repo root if you want the _C check
to use the installed, compiled package).
"""

from __future__ import annotations

from functools import cache
from math import comb

# ------------------------------------------------------- shapes (docs/api.md, "Measuring")
H = 7168                 # hidden
K = 8                    # top-k
E = 256                  # experts
T_NORMAL = 4096          # tokens per rank, normal mode (T = T_max)
T_LL = 128               # tokens per rank, low-latency mode (T = T_max)
RANKS = (2, 8, 16, 64, 256)
GPUS_PER_NODE = 8

# ------------------------------------------------------------------ link rates
NVLINK_BPS = 283e9       # measured: H200 NV18 peer copy, each way, both directions (api.md)
RDMA_BPS = 50e9          # assumed: one 400 Gb/s NIC per GPU, line rate, each way

# ------------------------------------------------------------------ our constants (C++ headers)
CHANNELS_PER_SCALE = 128
VEC = 16                 # kBytesPerVector
NORMAL_FIELD_ALIGN = 256
NORMAL_DATA_ALIGN = 4096
LL_ALIGN = 256
PLAN_TOKENS_PER_BLOCK = 256  # kPlanTokensPerBlock (normal/workspace.h)
WINDOW_ROWS = 65536      # kDefaultNormalWindowRows (normal/windows.h)
MAX_ROUNDS = 64          # kNormalMaxRounds
ROUND_UNIT = 32          # kNormalRoundUnit
LL_CONTROL_BYTES = 48    # LowLatencyControl: 6 x 8 bytes


def align_up(value, alignment):
    return (value + alignment - 1) // alignment * alignment


def region_row_bytes(payload_bytes, aux_words):
    return align_up(payload_bytes + 4 * aux_words, VEC)


def dispatch_row_bytes(payload_bytes, num_scales):
    """Normal dispatch row: payload, scales, K local ids, K weights, source index."""
    return region_row_bytes(payload_bytes, num_scales + 2 * K + 1)


def combine_row_bytes(num_w=0):
    """Normal combine row: H bf16 (+ num_w float32 weights)."""
    return region_row_bytes(2 * H, num_w)


def window_rows(extent, budget):
    """normal_window_rows() of normal/windows.h: region rows for calls of up to `extent` rows
    within `budget` rows (raised so that no call takes more than MAX_ROUNDS rounds)."""
    if extent <= budget:
        return extent
    unit = 2 * ROUND_UNIT
    rows_per_round = -(-2 * extent // MAX_ROUNDS)  # ceiling division
    fewest = -(-rows_per_round // unit) * unit
    return max(budget // unit * unit, fewest, unit)


def normal_layout(num_ranks, t_max, capacity, dtype_bytes=2, budget=WINDOW_ROWS):
    """normal_layout() of normal/workspace.h; returns (signal bytes, data bytes, total)."""
    offset = 0

    def take(nbytes):
        nonlocal offset
        offset = align_up(offset + nbytes, NORMAL_FIELD_ALIGN)

    take(8)                               # seq
    take(4 * (3 + MAX_ROUNDS))            # counters
    take(4 * (1 + 4 * num_ranks))         # NormalPlan words
    take(8 * 2 * num_ranks * num_ranks)   # count_matrix
    take(8 * num_ranks)                   # barrier
    take(8 * num_ranks * MAX_ROUNDS)      # credits
    take(4 * num_ranks * (MAX_ROUNDS + 1))  # round_bounds
    take(4 * MAX_ROUNDS)                  # round_levels
    take(8 * num_ranks * t_max)           # row_flags
    take(4 * num_ranks * t_max)           # send_tokens
    take(t_max)                           # token_masks
    take(8 * num_ranks * max(1, -(-t_max // PLAN_TOKENS_PER_BLOCK)))  # plan_counts
    data = align_up(offset, NORMAL_DATA_ALIGN)
    hidden_bytes = H * dtype_bytes
    dispatch = (window_rows(capacity, budget)
                * dispatch_row_bytes(hidden_bytes, H // CHANNELS_PER_SCALE))
    combine = (num_ranks * window_rows(t_max, budget // num_ranks)
               * region_row_bytes(hidden_bytes, K))
    data_bytes = align_up(max(dispatch, combine), NORMAL_DATA_ALIGN)
    return data, data_bytes, data + data_bytes


LL_CHANNELS = 2  # kLowLatencyNumChannels: fused calls, split send/receive pairs


def low_latency_bytes(num_ranks, t_max):
    """make_low_latency_layout() of low_latency/layout.cuh times the channels; returns the
    region's total bytes."""
    e_loc = E // num_ranks
    offset = 0
    for nbytes in (
        LL_CONTROL_BYTES,
        2 * e_loc * num_ranks * 8,                   # dispatch_counts
        2 * num_ranks * 8,                           # combine_flags
        2 * e_loc * num_ranks * t_max * 8,           # dispatch_meta (int2)
        2 * e_loc * num_ranks * t_max * 8,           # dispatch_row_flags
        2 * e_loc * (num_ranks - 1) * t_max * 2 * H,  # dispatch_rows (2H bytes per slot)
        t_max * 2 * H,                               # dispatch_own_rows (one copy)
        2 * t_max * K * 2 * H,                       # combine_rows
    ):
        offset = align_up(offset + nbytes, LL_ALIGN)
    return LL_CHANNELS * offset


def workspace_bytes(num_ranks, t_max, capacity, dtype_bytes, low_latency):
    """kernels/api.cc workspace_bytes(): normal region, then the low-latency region if asked."""
    total = normal_layout(num_ranks, t_max, capacity, dtype_bytes)[2]
    if low_latency:
        total = align_up(total, LL_ALIGN) + low_latency_bytes(num_ranks, t_max)
    return total


def check_against_extension():
    try:
        import jax_ep._C as ext  # noqa: PLC0415 - optional

        from jax_ep.backends.cuda import buffer_config  # noqa: PLC0415
    except ImportError:
        return "jax_ep._C not importable: formulas transcribed from the C++ headers, unchecked"
    checked = 0
    for r in sorted({1, 2, 4, 8, *RANKS}):
        for t_max, ll in ((T_NORMAL, False), (T_LL, True), (1000, True)):
            for dtype_bytes in (2, 4):
                for cap in (r * t_max, max(1, r * t_max // 3)):
                    ours = workspace_bytes(r, t_max, cap, dtype_bytes, ll)
                    theirs = ext.workspace_bytes(buffer_config(
                        ext, num_ranks=r, num_experts=E, hidden=H, max_tokens_per_rank=t_max,
                        num_topk=K, capacity=cap, dtype_bytes=dtype_bytes, low_latency=ll))
                    assert ours == theirs, (r, t_max, ll, dtype_bytes, cap, ours, theirs)
                    checked += 1
    return (f"transcription == jax_ep._C.workspace_bytes for {checked} configurations, R up to "
            f"{max(RANKS)}")


# ------------------------------------------------------------------ routing expectations
def p_group_missed(group_experts):
    """P(a uniform top-K subset of E experts misses a given group of `group_experts`)."""
    return comb(E - group_experts, K) / comb(E, K)


def routing(num_ranks):
    """Expected per-token counts under uniform top-K without replacement."""
    nodes = max(1, num_ranks // GPUS_PER_NODE)
    node_size = min(num_ranks, GPUS_PER_NODE)
    hit_rank = 1 - p_group_missed(E // num_ranks)
    hit_node = 1 - p_group_missed(E // nodes)
    return {
        "ranks": num_ranks * hit_rank,                  # distinct destination ranks (self incl.)
        "remote_ranks": (num_ranks - 1) * hit_rank,     # excluding self
        "offnode_ranks": (num_ranks - node_size) * hit_rank,
        "onnode_ranks": (node_size - 1) * hit_rank,
        "remote_nodes": (nodes - 1) * hit_node,         # distinct other nodes
        # hierarchical NVLink rows out of one GPU: own node + forwarding (derivation in the doc)
        "hier_nvl_rows": (node_size - 1) * hit_rank * nodes,
    }


# ------------------------------------------------------------ traffic by host (counted traffic)
# Per rank per call: one dispatch and one combine, split into bytes to the other ranks of the
# rank's host (same host) and to other hosts (cross host). R = hosts x G, e = E/R experts a rank.
TRAFFIC_HOSTS = (2, 4, 8, 32)
TRAFFIC_MODES = ("normal", "low_latency")
TRAFFIC_SCHEMES = ("flat", "hierarchical")
TRAFFIC_ROUTINGS = ("uniform", "node_limited")
NODE_LIMITED_MAX_HOSTS = 4   # DeepSeek-V3: a token's experts lie on at most 4 groups (hosts)
NODE_LIMITED_GROUP_TOP = 2   # DeepSeek-V3: a group scores the sum of its 2 best expert scores
MC_TOKENS = 1 << 16          # node-limited expectations: Monte Carlo sample (tokens), seed 0
MC_SEED = 0


def traffic_tokens(mode):
    return T_NORMAL if mode == "normal" else T_LL


def traffic_row_bytes(mode, hidden=H):
    """(dispatch, combine) bytes of one row of `hidden` channels on the wire: normal bf16
    dispatch rows (payload, K ids, K weights, source index) and 2H combine rows; low-latency fp8
    rows with one f32 scale per 128 channels and 2H combine rows."""
    if mode == "normal":
        return dispatch_row_bytes(2 * hidden, 0), 2 * hidden
    return hidden + 4 * (hidden // CHANNELS_PER_SCALE), 2 * hidden


def uniform_destinations(hosts, ranks_per_host=GPUS_PER_NODE):
    """Per token under uniform top-K: expected distinct destination ranks and hosts, the
    token's own rank and host included: R (1 - miss(E/R)), n (1 - miss(E/n))."""
    num_ranks = hosts * ranks_per_host
    return (num_ranks * (1 - p_group_missed(E // num_ranks)),
            hosts * (1 - p_group_missed(E // hosts)))


def node_limited_sample(hosts, ranks_per_host=GPUS_PER_NODE, tokens=MC_TOKENS, seed=MC_SEED):
    """DeepSeek-V3's node-limited routing over iid uniform(0, 1) scores: a host's experts form one
    group, a group scores the sum of its NODE_LIMITED_GROUP_TOP best scores, a token keeps its
    NODE_LIMITED_MAX_HOSTS best groups and picks its top-K experts among theirs. Returns
    (distinct ranks [tokens], distinct hosts [tokens]) of `tokens` sampled tokens."""
    import numpy as np  # noqa: PLC0415 - the Monte Carlo only; the rest is standard library

    num_ranks = hosts * ranks_per_host
    group = E // hosts
    scores = np.random.default_rng(seed).random((tokens, hosts, group))
    top = NODE_LIMITED_GROUP_TOP
    group_score = np.partition(scores, group - top, axis=-1)[..., group - top:].sum(-1)
    kept = np.argpartition(-group_score, NODE_LIMITED_MAX_HOSTS - 1, axis=-1)
    keep = np.zeros((tokens, hosts), bool)
    np.put_along_axis(keep, kept[:, :NODE_LIMITED_MAX_HOSTS], True, axis=1)
    scores[~keep] = -1.0                                 # dropped groups: never picked
    experts = np.argpartition(-scores.reshape(tokens, E), K - 1, axis=-1)[:, :K]
    ranks = np.sort(experts // (E // num_ranks), axis=-1)
    host_ids = np.sort(experts // group, axis=-1)
    return (1 + (np.diff(ranks, axis=-1) != 0).sum(-1),
            1 + (np.diff(host_ids, axis=-1) != 0).sum(-1))


@cache
def node_limited_destinations(hosts, ranks_per_host=GPUS_PER_NODE):
    """(distinct ranks, distinct hosts, standard error of each) per token under node-limited
    routing. With hosts <= NODE_LIMITED_MAX_HOSTS every host is kept: uniform, exact (error 0).
    Else the mean of node_limited_sample (MC_TOKENS tokens, seed MC_SEED)."""
    if hosts <= NODE_LIMITED_MAX_HOSTS:
        return (*uniform_destinations(hosts, ranks_per_host), 0.0, 0.0)
    d_rank, d_host = node_limited_sample(hosts, ranks_per_host)
    return (d_rank.mean(), d_host.mean(), d_rank.std() / len(d_rank) ** 0.5,
            d_host.std() / len(d_host) ** 0.5)


def destinations(routing_name, hosts, ranks_per_host=GPUS_PER_NODE):
    if routing_name == "uniform":
        return uniform_destinations(hosts, ranks_per_host)
    return node_limited_destinations(hosts, ranks_per_host)[:2]


def traffic_rows(mode, scheme, hosts, d_rank, d_host, ranks_per_host=GPUS_PER_NODE, tokens=None):
    """(same-host rows, cross-host rows) one rank sends per dispatch (as many come back in the
    combine), from the per-token distinct ranks d_rank and hosts d_host (own included).

    The routing does not depend on the source and treats experts alike, so each of the other
    R - 1 ranks is a destination of a token with probability d_rank / R, each other host with
    d_host / n, and each selection lies on a given rank with probability 1 / R.
      normal, flat: a row per (token, destination rank);
      low latency, flat: a row per (token, selection), not deduplicated;
      hierarchical (DeepEP's): a row per (token, destination host) crosses the network, to the
        GPU with the source's local index there, which forwards it over NVLink to the other
        destinations on its host (normal: the distinct ranks; low latency: the selections);
        its own host's destinations get their rows directly. A forwarding GPU is itself the
        destination of a given row with probability 1/G, so the forwarded rows are (G - 1)/G of
        the flat cross-host rows.
    """
    g = ranks_per_host
    num_ranks = hosts * g
    t = traffic_tokens(mode) if tokens is None else tokens
    per_dest = d_rank if mode == "normal" else K   # rows a token sends to all R ranks
    same = t * per_dest * (g - 1) / num_ranks
    cross = t * per_dest * (num_ranks - g) / num_ranks
    if scheme == "flat":
        return same, cross
    return same + cross * (g - 1) / g, t * d_host * (hosts - 1) / hosts


def traffic_bytes(mode, scheme, hosts, routing_name, ranks_per_host=GPUS_PER_NODE, tokens=None,
                  hidden=H):
    """(same-host bytes, cross-host bytes) per rank for one dispatch and one combine."""
    d_rank, d_host = destinations(routing_name, hosts, ranks_per_host)
    same, cross = traffic_rows(mode, scheme, hosts, d_rank, d_host, ranks_per_host, tokens)
    row = sum(traffic_row_bytes(mode, hidden))
    return same * row, cross * row


# ------------------------------------------------------------------ DeepEP V1 (config.hpp)
DEEPEP_NUM_SMS = 20      # deep_ep.Buffer.num_sms default; channels = SMs / 2
DEEPEP_DISPATCH = {2: (24, 256, 6, 128), 8: (6, 256, 6, 128), 16: (16, 288, 20, 128),
                   64: (20, 288, 28, 128), 160: (28, 720, 12, 128)}
DEEPEP_COMBINE = {2: (10, 256, 6, 128), 8: (4, 256, 6, 128), 16: (2, 288, 28, 128),
                  64: (1, 288, 20, 128), 160: (2, 720, 8, 128)}


def deepep_config(table, num_ranks):
    return table[num_ranks if num_ranks in table else 160]   # 256: not in DeepEP's table


def deepep_normal_bytes(num_ranks, hidden_bytes=2 * H):
    """max over dispatch/combine configs of get_nvl/get_rdma_buffer_size_hint."""
    channels = DEEPEP_NUM_SMS // 2
    nvl_ranks = min(num_ranks, 8)
    rdma_ranks = max(num_ranks // 8, 1)
    meta, max_topk, max_scales = 8, 128, 128
    nvl = rdma = 0
    for table in (DEEPEP_DISPATCH, DEEPEP_COMBINE):
        _, nvl_recv, rdma_send, rdma_recv = deepep_config(table, num_ranks)
        per_token = hidden_bytes + meta + max_topk * 8 + max_topk * 4 + max_scales * 4
        n = channels * nvl_ranks * (2 * rdma_ranks + 3) * 4
        n += channels * nvl_ranks * nvl_recv * per_token
        nvl = max(nvl, align_up(n, 128))
        if num_ranks > 8:
            rdma_recv = align_up(rdma_recv, rdma_send)
            n = channels * rdma_ranks * (8 * 2 + 2) * 2 * 4
            n += channels * rdma_ranks * rdma_recv * (per_token + 16) * 2
            n += 1 << 20
            rdma = max(rdma, align_up(n, 128))
    return nvl, rdma


def deepep_low_latency_bytes(t_max):
    """get_low_latency_rdma_size_hint (V1: combine message = 2H bytes)."""
    num_scales = H // 128
    dispatch_msg = 16 + max(2 * H, H + 4 * num_scales)
    combine_msg = 2 * H
    send = max(t_max * dispatch_msg, E * t_max * combine_msg)
    recv = max(E * t_max * dispatch_msg, E * t_max * combine_msg)
    signal = align_up(E * 4, 128)
    return 2 * (send + recv + signal)


RING_TOKENS_PER_PEER = 10 * 256   # design (a): 10 channels x 256-token rings per peer (assumed)


# ------------------------------------------------------------------ printing
def gb(nbytes):
    return f"{nbytes / 1e9:.2f}"


def us(seconds):
    return f"{seconds * 1e6:,.0f}"


def table(header, rows):
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(" --- " for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    print()


def main():
    print(check_against_extension(), "\n")
    row_bf16 = dispatch_row_bytes(2 * H, 0)
    row_fp8 = dispatch_row_bytes(H, H // 128)
    row_comb = combine_row_bytes(0)
    row_ll_fp8 = H + 4 * (H // 128)
    print(f"wire rows: normal dispatch bf16 {row_bf16} B, fp8 {row_fp8} B, combine {row_comb} B; "
          f"low-latency dispatch fp8 {row_ll_fp8} B (+8 B meta, +8 B flag), combine {2 * H} B\n")

    print("## Memory per rank (GB = 1e9 bytes)\n")
    rows = []
    for r in RANKS:
        sig, data, total = normal_layout(r, T_NORMAL, r * T_NORMAL)
        ll_total = workspace_bytes(r, T_LL, r * T_LL, 2, True)
        ll_region = low_latency_bytes(r, T_LL)
        ring = r * RING_TOKENS_PER_PEER * row_bf16
        nvl, rdma = deepep_normal_bytes(r)
        dispatch_window = window_rows(r * T_NORMAL, WINDOW_ROWS)
        combine_slots = window_rows(T_NORMAL, WINDOW_ROWS // r)
        rows.append([r, f"{r * T_NORMAL:,}", f"{dispatch_window:,} / {r * combine_slots:,}",
                     f"{sig / 1e6:.2f}", gb(total), gb(ring),
                     f"{gb(nvl)} + {gb(rdma)}", gb(ll_region), gb(ll_total),
                     gb(deepep_low_latency_bytes(T_LL))])
    table(["R", "rows of a call at C = R*T_max", "window rows dispatch / combine", "signals MB",
           "normal total", "(a) ring", "(b) DeepEP NVL + RDMA", "LL region", "LL Buffer total",
           "DeepEP LL"],
          rows)

    print("## Rounds of a normal call (T = T_max = 4096, C = R*T_max, uniform top-8 of 256)\n")
    rows = []
    for r in RANKS:
        received = T_NORMAL * routing(r)["ranks"]
        dispatch_window = window_rows(r * T_NORMAL, WINDOW_ROWS)
        dispatch_round = (dispatch_window if dispatch_window >= r * T_NORMAL
                          else dispatch_window // 2)
        combine_slots = window_rows(T_NORMAL, WINDOW_ROWS // r)
        combine_round = combine_slots if combine_slots >= T_NORMAL else combine_slots // 2
        rows.append([r, f"{received:,.0f}", -(-int(received) // dispatch_round),
                     -(-(r * T_NORMAL) // dispatch_round), -(-T_NORMAL // combine_round)])
    table(["R", "rows received (expected)", "dispatch rounds (expected)",
           "dispatch rounds (all to one rank)", "combine rounds"], rows)

    print("## Routing expectations per token (uniform top-8 of 256)\n")
    rows = []
    for r in RANKS:
        g = routing(r)
        rows.append([r, f"{g['ranks']:.3f}", f"{g['remote_ranks']:.3f}",
                     f"{g['offnode_ranks']:.3f}", f"{g['remote_nodes']:.3f}",
                     f"{g['offnode_ranks'] / max(g['remote_nodes'], 1e-9):.2f}"
                     if r > 8 else "-"])
    table(["R", "distinct ranks", "remote ranks", "off-node ranks", "distinct remote nodes",
           "dedup factor"], rows)

    print("## Normal mode traffic per rank per call (T=4096), flat (ours) vs hierarchical (b)\n")
    rows = []
    for r in RANKS:
        g = routing(r)
        t = T_NORMAL
        nvl_rows, off_rows = t * g["onnode_ranks"], t * g["offnode_ranks"]
        h_rdma, h_nvl = t * g["remote_nodes"], t * g["hier_nvl_rows"]
        frac = off_rows / (nvl_rows + off_rows)
        flat_floor = max(nvl_rows * row_bf16 / NVLINK_BPS, off_rows * row_bf16 / RDMA_BPS)
        hier_floor = max(h_nvl * row_bf16 / NVLINK_BPS, h_rdma * row_bf16 / RDMA_BPS)
        flat_fp8 = max(nvl_rows * row_fp8 / NVLINK_BPS, off_rows * row_fp8 / RDMA_BPS)
        comb = max(nvl_rows * row_comb / NVLINK_BPS, off_rows * row_comb / RDMA_BPS)
        hier_comb = max(h_nvl * row_comb / NVLINK_BPS, h_rdma * row_comb / RDMA_BPS)
        rows.append([r, f"{nvl_rows:,.0f}", f"{off_rows:,.0f}", f"{frac:.0%}",
                     gb((nvl_rows + off_rows) * row_bf16), gb(off_rows * row_bf16),
                     us(flat_floor), us(flat_fp8), us(comb),
                     f"{h_rdma:,.0f}", f"{h_nvl:,.0f}", gb(h_rdma * row_bf16),
                     us(hier_floor), us(hier_comb)])
    table(["R", "rows NVLink", "rows off-node", "off-node share", "GB sent bf16",
           "GB off-node bf16", "floor us disp bf16", "floor us disp fp8", "floor us comb",
           "(b) RDMA rows", "(b) NVLink rows", "(b) GB RDMA bf16", "(b) floor us disp bf16",
           "(b) floor us comb"], rows)

    print("## Traffic by host per rank per call: one dispatch + one combine (GB = 1e9 bytes)\n")
    for h in TRAFFIC_HOSTS:
        if h > NODE_LIMITED_MAX_HOSTS:
            d_rank, d_host, se_rank, se_host = node_limited_destinations(h)
            print(f"node-limited, {h} x {GPUS_PER_NODE}: {d_rank:.4f} +- {se_rank:.4f} distinct "
                  f"ranks, {d_host:.4f} +- {se_host:.4f} distinct hosts per token "
                  f"(Monte Carlo, {MC_TOKENS} tokens, seed {MC_SEED}; +- one standard error)")
    print()
    rows = []
    for mode in TRAFFIC_MODES:
        for routing_name in TRAFFIC_ROUTINGS:
            for h in TRAFFIC_HOSTS:
                d_rank, d_host = destinations(routing_name, h)
                flat_same, flat_cross = traffic_bytes(mode, "flat", h, routing_name)
                hier_same, hier_cross = traffic_bytes(mode, "hierarchical", h, routing_name)
                rows.append([mode, routing_name, f"{h} x {GPUS_PER_NODE}", traffic_tokens(mode),
                             f"{d_rank:.3f}", f"{d_host:.3f}",
                             f"{flat_cross / 1e9:.4f}", f"{flat_same / 1e9:.4f}",
                             f"{hier_cross / 1e9:.4f}", f"{hier_same / 1e9:.4f}",
                             f"{flat_cross / hier_cross:.2f}"])
    table(["mode", "routing", "hosts x G", "T", "distinct ranks / token",
           "distinct hosts / token", "flat GB cross-host", "flat GB same-host",
           "hier. GB cross-host", "hier. GB same-host", "flat / hier. cross-host"], rows)

    print("## Normal mode messages per rank per call (ours, flat)\n")
    rows = []
    for r in RANKS:
        g = routing(r)
        remote_rows = T_NORMAL * g["remote_ranks"]
        rows.append([r, f"{r * (r - 1):,}", f"{8 * r * (r - 1) / 1e3:,.1f}",
                     f"{16 * r * r / 1e6:.3f}", f"{remote_rows:,.0f}", r - 1,
                     f"{r - 1}", f"{2 * (r - 1)}"])
    table(["R", "count stores (8 B)", "count KB sent", "count matrix MB", "row flags",
           "barrier stores", "count puts if row-contiguous", "count puts, column scheme"], rows)

    print("## Low-latency traffic per rank per call (T=128, fp8 dispatch / bf16 combine)\n")
    rows = []
    for r in RANKS:
        node = min(r, GPUS_PER_NODE)
        remote_sel = T_LL * K * (r - 1) / r
        off_sel = T_LL * K * (r - node) / r
        on_sel = remote_sel - off_sel
        d_floor = max(on_sel * row_ll_fp8 / NVLINK_BPS, off_sel * row_ll_fp8 / RDMA_BPS)
        c_floor = max(on_sel * 2 * H / NVLINK_BPS, off_sel * 2 * H / RDMA_BPS)
        rdma_only_d = remote_sel * (row_ll_fp8 + 16) / RDMA_BPS
        rdma_only_c = remote_sel * 2 * H / RDMA_BPS
        e_loc = E // r
        rows.append([r, f"{remote_sel:,.0f}", f"{off_sel:,.0f}",
                     f"{remote_sel * row_ll_fp8 / 1e6:.2f}", f"{remote_sel * 2 * H / 1e6:.2f}",
                     us(d_floor), us(c_floor), us(rdma_only_d), us(rdma_only_c),
                     E - e_loc, f"{3 * remote_sel:,.0f}", r - 1])
    table(["R", "remote selections", "off-node", "MB disp", "MB comb", "floor us disp",
           "floor us comb", "all-RDMA us disp", "all-RDMA us comb", "count words",
           "row+meta+flag stores", "combine flags"], rows)

    print("## Capacity-bounded normal regions (proposal), bf16, T_max=4096\n")
    rows = []
    for r in RANKS:
        g = routing(r)
        expected = T_NORMAL * g["ranks"]
        cap = min(align_up(int(1.5 * expected), 128), r * T_NORMAL)
        dispatch = cap * dispatch_row_bytes(2 * H, H // 128)
        combine = T_NORMAL * min(K, r) * region_row_bytes(2 * H, K)
        signals = 8 * r * r * 2 + 8 * cap + 4 * T_NORMAL * min(K, r)
        rows.append([r, f"{expected:,.0f}", f"{cap:,}", gb(dispatch), gb(combine),
                     gb(max(dispatch, combine) + signals),
                     gb(normal_layout(r, T_NORMAL, r * T_NORMAL)[2])])
    table(["R", "expected recv rows", "C = 1.5x", "dispatch region", "combine min(K,R)*T_max",
           "total", "today"], rows)


if __name__ == "__main__":
    main()
