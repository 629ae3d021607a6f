"""Child process of tests/test_transport_gpu.py: the low-latency dispatch and combine over a
device transport (jax_ep._C_testing.LowLatencyTransportForTests, every rank on this GPU) against the
NumPy oracle. argv[1]: JSON {case name: constructor keyword arguments}. Each case runs every
routing of test_low_latency.py with every (use_fp8, round_scale), at T_max and at fewer tokens,
one call after another on one object (so tags, parities and staging slots are reused), and
prints one JSON line: {"case", "ok", "error", "proxy_errors"}. A case stops at its first failed
check (a mutant case is expected to).
"""

import json
import os
import sys
import traceback
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from test_low_latency import (  # noqa: E402
    FP8_MODES,
    HIDDEN,
    ROUTINGS,
    T_MAX,
    E,
    K,
    check_low_latency_dispatch,
    routed_inputs,
    weighted_copies,
)

from jax_ep import _C_testing  # noqa: E402
from jax_ep import testing as oracle  # noqa: E402

R = 8


def run_case(kwargs, rng, record):
    """Runs the case; the proxies' errors go into ``record`` also when a check fails."""
    ll = _C_testing.LowLatencyTransportForTests(R, E, K, T_MAX, HIDDEN, **kwargs)
    local = E // R
    try:
        for routing in ROUTINGS:
            for use_fp8, round_scale in FP8_MODES:
                for idx, w, x in routed_inputs(rng, routing, R):
                    T = x.shape[1]
                    got = ll.dispatch(x.tobytes(), idx.astype(np.int32).tobytes(), T, use_fp8,
                                      round_scale)
                    dtype = ml_dtypes.float8_e4m3fn if use_fp8 else ml_dtypes.bfloat16
                    recv_x = np.frombuffer(got["recv_x"], dtype).reshape(
                        R, local, R * T_MAX, HIDDEN)
                    recv_scales = np.frombuffer(got["recv_scales"], np.float32).reshape(
                        R, local, R * T_MAX, HIDDEN // 128)
                    out = types.SimpleNamespace(
                        recv_x=recv_x, recv_scales=recv_scales,
                        recv_count=np.frombuffer(got["recv_count"], np.int32).reshape(R, local),
                        recv_src=np.frombuffer(got["recv_src"], np.int32).reshape(
                            R, local, R * T_MAX))
                    check_low_latency_dispatch(out, x, idx, T_MAX, use_fp8, round_scale, "cuda")
                    # Combine the received rows (dequantised): sum_k w * x, fp8 rounding aside.
                    y = recv_x.astype(np.float32)
                    if use_fp8:
                        y = y * np.repeat(recv_scales, 128, axis=-1)
                    y = y.astype(ml_dtypes.bfloat16)
                    combined = np.frombuffer(
                        ll.combine(y.tobytes(), idx.astype(np.int32).tobytes(),
                                   w.astype(np.float32).tobytes(), T),
                        ml_dtypes.bfloat16).reshape(R, T, HIDDEN)
                    want, magnitude = weighted_copies(x, idx, w)
                    oracle.assert_sums_close(
                        combined, want, magnitude, what=f"combine ({routing}, fp8 {use_fp8})",
                        term_rtol=oracle.FP8_TERM_RTOL if use_fp8 else oracle.F32_SUM_RTOL)
    finally:
        record["proxy_errors"] = ll.close()


def main():
    _C_testing.print_native_stack_on_crash()
    for name, kwargs in json.loads(sys.argv[1]).items():
        rng = np.random.default_rng(1234)
        record = {"case": name, "ok": True, "error": "", "proxy_errors": []}
        try:
            run_case(kwargs, rng, record)
        except Exception:  # noqa: BLE001 - reported to the parent, next case
            record["ok"] = False
            record["error"] = traceback.format_exc()[-3000:]
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
