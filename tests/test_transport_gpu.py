"""Both device transports on a GPU (docs/transport.md), in two layers:

- the transport probe (xla_ffi/testing/probe.h, in the test module jax_ep._C_testing): an
  all-to-all exchange between emulated ranks on one GPU, written once against the transport
  interface, over the mapped transport (the warp's own stores) and the emulated one (rings in
  pinned memory, the host proxy on its thread, copy-engine copies);
- the low-latency dispatch and combine over a transport
  (csrc/kernels/low_latency_put/put_protocol.h) against the NumPy oracle
  (tests/transport_exchange.py).

Every row a receiver sees must be the row that was sent, under many seeds of the proxy's
reordering, tearing and delays; and each mutant that breaks one rule of the protocol
(transport/emulator/mutant.h) must be caught.

The cases run in child processes: a transport that hangs traps after its bounded wait, which
ends the CUDA context, and must not take the rest of the GPU suite with it.
"""

import json
import os
import subprocess
import sys
import tempfile

import pytest
from conftest import require_gpus

from jax_ep.buffer import EMULATED_TRANSPORT_CONNECTIONS
from jax_ep.system.cuda_driver import ENV_MAX_CONNECTIONS

pytestmark = pytest.mark.gpu

SEEDS = range(5)
# Every bound on a wait, scaled: under compute-sanitizer (scripts/sanitize.sh sets
# JAX_EP_TIMEOUT_S=120) instrumented kernels run 10-100x slower.
SLOW = float(os.environ.get("JAX_EP_TIMEOUT_S", "10")) / 10
# The proxy at its harshest: torn rows, random delays, sources compared with their snapshots.
HARSH = {"chunk_bytes": 128, "max_delay_steps": 16, "snapshot_sources": True}
MUTANTS = ("no_fence", "signal_before_data", "reuse_before_quiet", "unregistered_source")


def cases():
    bounds = {"transport_timeout_s": 10 * SLOW, "receive_timeout_s": 2 * SLOW}
    out = {
        "mapped/2": dict(transport="mapped"),
        "mapped/8": dict(transport="mapped", num_ranks=8, warps_per_rank=3, rows=13),
        # The mapped transport's signal is a release: it covers the warp's stores without a fence.
        "mapped/no_fence": dict(transport="mapped", mutant="no_fence"),
        "emulated/8": dict(num_ranks=8, warps_per_rank=3, rows=13, seed=1, **HARSH),
    }
    for ordering in ("unordered", "in_order"):
        for seed in SEEDS:
            out[f"emulated/{ordering}/{seed}"] = dict(ordering=ordering, seed=seed, **HARSH)
    for mutant in MUTANTS:
        for seed in SEEDS:
            out[f"{mutant}/{seed}"] = dict(mutant=mutant, seed=seed, rounds=2, **HARSH)
    for name, kwargs in out.items():
        kwargs.update(bounds)
        if name.startswith(MUTANTS):  # a lost signal gives up sooner
            kwargs["receive_timeout_s"] = 0.5 * SLOW
    return out


CHILD = """
import json, sys
from jax_ep import _C_testing
_C_testing.print_native_stack_on_crash()
for name, kwargs in json.loads(sys.argv[1]).items():
    print(json.dumps({"case": name, **_C_testing.transport_probe(**kwargs)}), flush=True)
"""


def run_child(args, cases, timeout):
    """Runs Python with `args + [json of cases]` and returns {case: its JSON record}; fails
    naming the cases that did report when the child dies (a transport timeout traps the child;
    a crash prints its Python stack). The child runs outside the source tree, so that `-c`
    imports the installed jax_ep (with _C_testing), not the checkout's."""
    require_gpus(1)
    # The proxy's copies must not queue behind the kernel that waits for them (buffer.py).
    env = {**os.environ, ENV_MAX_CONNECTIONS: str(EMULATED_TRANSPORT_CONNECTIONS)}
    proc = subprocess.run([sys.executable, "-X", "faulthandler", *args, json.dumps(cases)],
                          capture_output=True, text=True, timeout=timeout,
                          cwd=tempfile.gettempdir(), env=env)
    got = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            got[record.pop("case")] = record
    assert proc.returncode == 0 and set(got) == set(cases), (
        f"the child (exit {proc.returncode}) failed after {sorted(got)}:\n"
        f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return got


@pytest.fixture(scope="module")
def results():
    return run_child(["-c", CHILD], cases(), timeout=600)


def assert_clean(result, name):
    assert result["cuda_error"] == "", (name, result)
    assert result["proxy_errors"] == [], (name, result)
    assert result["timeouts"] == 0 and result["bad_rows"] == 0, (name, result)


def test_mapped_transport_delivers_every_row(results):
    for name in ("mapped/2", "mapped/8", "mapped/no_fence"):
        assert_clean(results[name], name)


def test_emulated_transport_delivers_every_row_under_every_seed(results):
    names = [n for n in results if n.startswith("emulated/")]
    assert len(names) == 2 * len(SEEDS) + 1
    for name in names:
        assert_clean(results[name], name)


@pytest.mark.parametrize("mutant", ["no_fence", "signal_before_data"])
def test_a_signal_that_can_overtake_its_data_is_caught(results, mutant):
    # Under reordering, some seed lets a receiver read rows that have not landed yet.
    seen = [results[f"{mutant}/{seed}"] for seed in SEEDS]
    assert all(r["cuda_error"] == "" and r["proxy_errors"] == [] for r in seen), seen
    assert sum(r["bad_rows"] for r in seen) > 0, seen


def test_a_slot_reused_before_quiet_is_caught(results):
    for seed in SEEDS:
        r = results[f"reuse_before_quiet/{seed}"]
        reused = [e for e in r["proxy_errors"] if e.startswith("source_reused")]
        assert reused or r["bad_rows"] > 0, (seed, r)


def test_an_unregistered_source_is_refused_and_named(results):
    for seed in SEEDS:
        r = results[f"unregistered_source/{seed}"]
        assert r["proxy_errors"], (seed, r)
        assert all(e.startswith("source_out_of_region") for e in r["proxy_errors"]), (seed, r)
        assert r["bad_rows"] > 0, (seed, r)  # nothing was delivered, the signals were


# The low-latency ops over each transport (tests/transport_exchange.py, one child process).
EXCHANGE_CASES = {
    "mapped": dict(transport="mapped"),
    **{f"emulated/{ordering}/{seed}": dict(transport="emulated", ordering=ordering, seed=seed,
                                           **HARSH)
       for ordering in ("unordered", "in_order") for seed in range(3)},
    # Few slots and warps: combine quiets and reuses its staging slots many times per call.
    "emulated/tight": dict(transport="emulated", warps_per_rank=1, seed=7, **HARSH),
    # A launch per rank on its own stream, as an op launches: ranks start and end apart, and
    # each kernel takes its tag from its own sequence word.
    "mapped/per_rank": dict(transport="mapped", launches="per_rank"),
    "emulated/per_rank": dict(transport="emulated", launches="per_rank", seed=3, **HARSH),
}
for _kwargs in EXCHANGE_CASES.values():
    _kwargs["timeout_s"] = 10 * SLOW


# Each breaks one rule in the kernels: some call of the case must then fail its check, or the
# proxy must report the error. A single warp with two combine slots reuses slots constantly.
EXCHANGE_MUTANTS = {
    f"{mutant}/{seed}": dict(transport="emulated", mutant=mutant, seed=seed, warps_per_rank=1,
                             combine_slots=2, timeout_s=5 * SLOW, **HARSH)
    for mutant in MUTANTS for seed in range(2)}


EXCHANGE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "transport_exchange.py")


@pytest.fixture(scope="module")
def exchanges():
    return run_child([EXCHANGE_SCRIPT], EXCHANGE_CASES, timeout=900)


@pytest.fixture(scope="module")
def mutant_exchanges():
    return run_child([EXCHANGE_SCRIPT], EXCHANGE_MUTANTS, timeout=900)


@pytest.mark.parametrize("case", sorted(EXCHANGE_CASES))
def test_low_latency_ops_over_a_transport_match_the_oracle(exchanges, case):
    result = exchanges[case]
    assert result["ok"], result["error"]
    assert result["proxy_errors"] == [], result["proxy_errors"]


@pytest.mark.parametrize("mutant", MUTANTS)
def test_every_kernel_mutant_is_caught_by_the_emulator(mutant_exchanges, mutant):
    for seed in range(2):
        result = mutant_exchanges[f"{mutant}/{seed}"]
        assert not result["ok"] or result["proxy_errors"], (mutant, seed, result)
        if mutant == "unregistered_source":
            assert any(e.startswith("source_out_of_region") for e in result["proxy_errors"])
