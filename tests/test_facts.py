"""The facts C++ and Python share have one source.

The CUDA backend's facts (target names, wait phases, rank limit) are read from jax_ep._C, so
here we check that what Python asks for exists there. The fp8 scale block is needed without
_C too: Python and the kernels keep one constant each, and they must agree.
"""

import ast
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from jax_ep import Buffer, buffer, env, fp8
from jax_ep.backends import cuda
from jax_ep.buffer import describe_timeout, emulated_transport_hint
from jax_ep.system import config

# None where the extension is missing: the `extension` fixture (conftest's rule) then fails each
# test where nvcc or a GPU is found, and skips it elsewhere, before the test touches _C. The
# test module is built and installed with _C.
_C, _ = cuda.load_extension()
try:
    from jax_ep import _C_testing
except ImportError:
    _C_testing = None
pytestmark = pytest.mark.usefixtures("extension")

CUDA_BACKEND = Path(cuda.__file__)
OP_CALLS = ("_call", "_low_latency_dispatch_call")


def _ops_the_backend_calls():
    """The op names CudaBackend passes to its custom-call helpers (string literals)."""
    ops = set()
    for node in ast.walk(ast.parse(CUDA_BACKEND.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in OP_CALLS and node.args
                and isinstance(node.args[0], ast.Constant)):
            ops.add(node.args[0].value)
    return ops


def test_every_op_the_backend_calls_has_a_target():
    ops = _ops_the_backend_calls()
    assert len(ops) == 10, ops  # the scan still sees every call
    # Each op has an async twin (Buffer(overlap=True)), joined by the wait target.
    assert set(_C.target_names()) == ops | {f"{op}_async" for op in ops} | {"wait"}


def test_target_names_are_the_registered_ones_with_one_version():
    names = _C.target_names()
    assert set(_C.registrations()) == set(names.values())
    versions = {re.fullmatch(rf"jax_ep_{op}_(v\d+)", name).group(1) for op, name in names.items()}
    assert len(versions) == 1, names
    checks = cuda.export_safety_checks()
    assert len(checks) == len(names)


def test_wait_phase_names_cover_every_phase_once():
    names = _C.wait_phase_names()
    assert sorted(names) == list(range(len(names))) and len(names) >= 7
    assert len(set(names.values())) == len(names) and "unknown" not in names.values()
    record = dict(rank=0, device=0, timeout_peer=1, seq=3, timeout_phase=1)
    assert names[1] in describe_timeout(record)


def test_a_timeout_names_the_hosts_of_both_ranks():
    """Across hosts a wait that outlasted its bound names the host, rank and phase of both ends
    (the hosts gathered when the Buffer was made: no collective after a peer died)."""
    record = dict(rank=0, device=0, timeout_peer=9, seq=3, timeout_phase=1)
    text = describe_timeout(record, {0: "node-a", 9: "node-b"}.get)
    assert text.startswith("rank 0 on host node-a (device 0) waited for rank 9 on host node-b in "
                           f"{_C.wait_phase_names()[1]} (call 3)"), text


def test_a_timeout_over_the_emulated_transport_with_few_hardware_queues_says_why():
    """Over the emulated transport, fewer CUDA connections than it wants may stall its copies
    behind the waiting kernel: a timeout then says so (any other transport, or enough
    connections: nothing to add)."""
    emulated = {"JAX_EP_DEVICE_TRANSPORT": "emulated"}
    assert "CUDA_DEVICE_MAX_CONNECTIONS=8 (CUDA's default), under 32" in emulated_transport_hint(
        emulated)
    assert "=20, under 32" in emulated_transport_hint(
        dict(emulated, CUDA_DEVICE_MAX_CONNECTIONS="20"))
    assert emulated_transport_hint(dict(emulated, CUDA_DEVICE_MAX_CONNECTIONS="32")) == ""
    assert emulated_transport_hint({"JAX_EP_DEVICE_TRANSPORT": "nvshmem"}) == ""
    assert emulated_transport_hint({}) == ""


def test_the_probe_reports_the_kernels_rank_limit():
    assert cuda.max_ranks() == _C.max_ranks() >= 2
    assert env.probe_extension().max_ranks == _C.max_ranks()


def test_fp8_scale_block_agrees_with_the_kernels():
    assert fp8.CHANNELS_PER_SCALE == _C.channels_per_scale()


def test_buffer_config_is_one_struct_filled_by_name():
    """Python hands C++ one BufferConfig, its fields set by name: a misspelled field fails, and
    a CUDA Buffer's workspace size is the struct's, each field reaching C++ (the low-latency
    region, the capacity)."""
    with pytest.raises(AttributeError, match="num_rank"):
        cuda.buffer_config(_C, num_rank=2)
    mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("ep",))
    fields = dict(num_experts=8, hidden=1024, max_tokens_per_rank=64, num_topk=2)
    sizes = {}
    for low_latency, capacity in ((False, None), (True, None), (False, 8)):
        buf = Buffer(mesh, "ep", **fields, low_latency=low_latency, capacity=capacity,
                     backend="cuda", lowering_only=True)
        config = cuda.buffer_config(_C, num_ranks=2, **fields, capacity=capacity or 128,
                                    dtype_bytes=2, low_latency=low_latency, timeout_s=10.0)
        assert buf.workspace_bytes == _C.workspace_bytes(config) > 0
        sizes[low_latency, capacity] = buf.workspace_bytes
    assert len(set(sizes.values())) == 3, sizes


@pytest.mark.parametrize(("ranks", "experts", "tokens", "hidden", "topk"), [
    (1, 4, 1, 128, 1), (2, 8, 64, 1024, 2), (8, 256, 128, 7168, 8), (3, 6, 5, 384, 3)])
def test_low_latency_regions_neither_overlap_nor_overrun(ranks, experts, tokens, hidden, topk):
    """Each region of the low-latency layout starts after the last element of the one before
    (as the kernels' index helpers place it), 256-aligned, and the last one ends inside
    total_bytes: an accessor or a carve size off by one element fails."""
    layout = _C_testing.low_latency_layout(num_ranks=ranks, num_experts=experts, hidden=hidden,
                                           max_tokens_per_rank=tokens, num_topk=topk)
    names, starts, ends = layout["names"], layout["starts"], [*layout["ends"]]
    assert starts[0] == 0 and all(s % 256 == 0 for s in starts), starts
    bounds = [*starts[1:], layout["total_bytes"]]
    for name, start, end, bound in zip(names, starts, ends, bounds, strict=True):
        empty = name == "dispatch_rows" and ranks == 1  # no remote sources
        assert (start == end) if empty else (start < end), (name, start, end)
        assert end <= bound and bound - end < 256, (name, end, bound)


def test_topk_limit_and_error_counters_agree_with_the_kernels():
    """Both backends need the top-k limit and the error counters' names (the keys of
    ``errors()``), so Python keeps them; the kernels' must be the same."""
    assert config.MAX_TOPK == _C.max_topk()
    assert config.MAX_LOW_LATENCY_HIDDEN == _C.max_low_latency_hidden()
    assert list(buffer.ERROR_COUNTERS) == _C.error_counter_names()


def test_fast_divisor_divides_exactly():
    """The kernels map expert ids to ranks (and work units to rows) with FastDivisor's
    multiply-high; it must equal integer division for every 32-bit numerator and divisor."""
    rng = np.random.default_rng(0)
    edges = [0, 1, 2, 3, 255, 256, 257, 2**16 - 1, 2**16, 2**31 - 1, 2**31, 2**32 - 2,
             2**32 - 1]
    divisors = [*range(1, 300), 2**31 - 1, 2**31, 2**31 + 1, 2**32 - 1,
                *rng.integers(1, 2**32, 200).tolist()]
    for d in divisors:
        numerators = [*edges, *range(0, 3 * d + 3 if d < 1000 else 1000),
                      *rng.integers(0, 2**32, 200).tolist()]
        got = _C_testing.fast_divide(d, numerators)
        want = [n // d for n in numerators]
        assert got == want, (d, [(n, g, w) for n, g, w in zip(numerators, got, want,
                                                               strict=True) if g != w][:5])
    with pytest.raises(ValueError, match="divisor"):
        _C_testing.fast_divide(0, [1])
