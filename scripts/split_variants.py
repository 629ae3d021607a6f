"""Which sequences of low-latency calls in one program finish on the GPUs, each run in its own
process (a timeout traps the context). It reproduced the split-call hang that XLA's dynamic-slice
fusion caused (NOTES.md, issue 4; fixed: the split tests with the same pattern pass since) and
stays as a quick check:

    python scripts/split_variants.py HIDDEN KINDS DTYPE
    # KINDS: comma list of split (send/recv dispatch + send/recv combine), splitd (split
    #        dispatch only), fused; DTYPE: bf16, fp8 or alt (fp8 on odd calls)
    # e.g. 128 split,split bf16 (failed at the second receive before the fix)

Prints ``VARIANT ... ok`` or ``VARIANT ... FAIL <error>`` and the Buffer's timeout records.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from harness import run_sharded  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep import testing as oracle  # noqa: E402

E, K, T = 32, 4, 8


def main(hidden, kinds, dtype):
    mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))
    R = mesh.shape["ep"]
    buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=hidden, max_tokens_per_rank=T,
                        num_topk=K, low_latency=True, backend="cuda", timeout_s=3.0)

    def use_fp8(i):
        return {"bf16": False, "fp8": True, "alt": i % 2 == 1}[dtype]

    def step(x, idx, w):
        outs = []
        for i, kind in enumerate(kinds):
            options = dict(use_fp8=use_fp8(i))
            if kind in ("split", "splitd"):
                d = jax_ep.low_latency_dispatch_recv(
                    buf, jax_ep.low_latency_dispatch_send(buf, x[i], idx[i], **options))
            else:
                d = jax_ep.low_latency_dispatch(buf, x[i], idx[i], **options)
            y = (jax_ep.per_token_cast_from_fp8(d.recv_x, d.recv_scales) if use_fp8(i)
                 else d.recv_x)
            if kind == "split":
                out = jax_ep.low_latency_combine_recv(
                    buf, jax_ep.low_latency_combine_send(buf, y, idx[i], w[i], d.handle))
            elif kind == "splitd":
                out = y.sum()
            else:
                out = jax_ep.low_latency_combine(buf, y, idx[i], w[i], d.handle)
            outs.append((d.recv_count, out))
        return outs

    rng = np.random.default_rng(0)
    routings = [oracle.make_routing("uniform", rng, R, T, E, K) for _ in kinds]
    idx = np.stack([r[0] for r in routings], 1)
    w = np.stack([r[1] for r in routings], 1)
    x = rng.standard_normal((R, len(kinds), T, hidden)).astype(ml_dtypes.bfloat16)
    name = f"VARIANT {hidden} {','.join(kinds)} {dtype}"
    try:
        for _ in range(2):
            run_sharded(mesh, step, x, idx, w)
        print(name, "ok", flush=True)
    except Exception as e:  # noqa: BLE001 - report and keep the process exit clean
        print(name, "FAIL", str(e)[:300].replace("\n", " "), flush=True)
        print("ERRORS", buf.errors(), flush=True)
    os._exit(0)  # after a trap the CUDA context is gone: skip JAX's teardown


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3])
