"""benchmarks/compile_time.py runs on CPU (8 host devices, reference backend, tiled matmul) and
records the compile time and the compiled program's counts of each case; its HLO counting is
checked on a hand-written program text with Mosaic GPU kernels."""

import pytest
from bench_scripts import load_record, run_script  # puts benchmarks/ on sys.path


def test_compile_time_quick(tmp_path):
    """Both cases, the stack unrolled and scanned (one layer each way is the same program but
    for the scan), one small Flax configuration; every record has the measured fields."""
    run_script("compile_time.py", tmp_path, "--scan", "--layers", "2", "--no-run",
               "--flax-args", "--layers 1 --hidden 128 --ffn 64 --batch 8 --seq 8 --heads 2",
               "--tag", "t")
    payload = load_record(tmp_path, "8xcpu-*-compile_time-t.json")
    assert payload["errors"] == [], payload["errors"]
    records = {r["case"]: r for r in payload["results"]}
    assert set(records) == {"flax_train_step", "moe_stack_unrolled", "moe_stack_scan"}
    for rec in records.values():
        assert rec["op"] == "compile_time", rec
        assert rec["lower_s"] > 0 and rec["compile_s"] > 0, rec
        assert rec["first_call_s"] is None, rec  # --no-run
        assert rec["num_fusions"] > 0 and rec["num_instructions"] > rec["num_fusions"], rec
        assert rec["num_mosaic_kernels"] == 0 and rec["unique_kernels"] == 0, rec  # no GPU
    assert records["flax_train_step"]["layers"] == 1
    unrolled, scanned = records["moe_stack_unrolled"], records["moe_stack_scan"]
    assert unrolled["layers"] == scanned["layers"] == 2
    assert unrolled["resolved_matmul"] == "tiled" and unrolled["backend"] == "reference"
    # The scanned stack holds the layer once: fewer instructions than two unrolled copies.
    assert scanned["num_instructions"] < unrolled["num_instructions"], (scanned, unrolled)


def _mosaic_call(name, operand, kernel, layer):
    """A Mosaic GPU custom call as XLA prints it (typed FFI: the backend config is a dict)."""
    return (f'  %{name} = bf16[64,128]{{1,0}} custom-call(%{operand}), '
            f'custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI, '
            f'backend_config={{kernel_hash = "\\0{kernel}", module = "m{kernel}", '
            f'use_custom_barrier = false}}, metadata={{op_name="layer{layer}"}}')


MOSAIC_HLO = "\n".join([
    "HloModule jit_step, entry_computation_layout={(bf16[64,128]{1,0})->bf16[64,128]{1,0}}",
    "",
    "%fused_add (p0: bf16[64,128], p1: bf16[64,128]) -> bf16[64,128] {",
    "  %p0 = bf16[64,128]{1,0} parameter(0)",
    "  %p1 = bf16[64,128]{1,0} parameter(1)",
    "  ROOT %add = bf16[64,128]{1,0} add(%p0, %p1)",
    "}",
    "",
    "ENTRY %main (x: bf16[64,128]) -> bf16[64,128] {",
    "  %x = bf16[64,128]{1,0} parameter(0)",
    _mosaic_call("k0", "x", 1, 0),
    _mosaic_call("k1", "k0", 1, 1),  # the same kernel, another layer
    _mosaic_call("k2", "k1", 2, 1),
    '  %d = bf16[64,128]{1,0} custom-call(%k2), custom_call_target="jax_ep_dispatch_v1", '
    "backend_config={num_ranks = 8 : i64}",
    "  ROOT %f = bf16[64,128]{1,0} fusion(%d, %x), kind=kLoop, calls=%fused_add",
    "}",
])


def test_hlo_counts_tell_duplicate_kernels_apart():
    """Three Mosaic GPU calls of two kernel bodies (the same kernel_hash twice, whatever the
    call's metadata), one other custom call, one fusion."""
    import compile_time

    counts = compile_time.hlo_counts(MOSAIC_HLO)
    assert counts == {
        "num_instructions": 9, "num_fusions": 1, "num_custom_calls": 4,
        "custom_call_targets": {"jax_ep_dispatch_v1": 1, "mosaic_gpu_v2": 3},
        "num_mosaic_kernels": 3, "num_triton_kernels": 0, "unique_kernels": 2}


@pytest.mark.parametrize(("argv", "message"), [(["--cases", "flax,nope"], "unknown case"),
                                                (["--layers", "0"], "at least 1")])
def test_compile_time_refuses_bad_flags(argv, message, capsys):
    import compile_time

    with pytest.raises(SystemExit):
        compile_time.parse_args(argv)
    assert message in capsys.readouterr().err
