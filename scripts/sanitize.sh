#!/usr/bin/env bash
# compute-sanitizer's tools over the op suite, at EP=1 (one process) and with two
# processes sharing one GPU (`jax_ep.launch --processes-per-gpu 2`: the multi-process protocol
# with CUDA IPC peers). Only jax_ep's kernels are instrumented (their names end in `_kernel`;
# XLA's run as usual, which keeps a run within minutes). Run from the repository root with
# jax_ep installed; logs under $OUT/sanitize/, one summary line per run in
# $OUT/sanitize/summary.txt.
#   TOOLS     default "memcheck racecheck synccheck initcheck"
#   MODES     default "ep1 shared"; "shared-rank0": the same two processes, rank 0 alone under
#             the tool (compute-sanitizer 2025.3 crashes when both processes run under it)
#   SAN_S     seconds per run (default 240)
#   SAN_TESTS test files (default: the adversarial routings through every op, with invalid ids,
#             repeated experts and overflow, and the chains of split halves).
#             tests/test_transport_gpu.py (MODES=ep1): the transport probe and the low-latency
#             ops over a transport, in the child processes it starts (its waits scale with
#             JAX_EP_TIMEOUT_S)
#   SAN_TAG   a name for this run's logs and summary lines (runs split into chunks: shared mode,
#             where the tool dies ~70 s into a run)
#   SAN_K     pytest -k expression (default: all but the Buffer-cycle test)
#   SAN_FILTER 0: instrument every kernel (XLA's too). initcheck needs it to see XLA's writes:
#             with the filter, reads of an XLA-written operand are reported as uninitialised.
#             Use it on tests whose XLA work reads no unspecified row, e.g.
#             SAN_TESTS=tests/test_split_chains.py SAN_K=every_slot_written
#   SAN_EACH  1: one run per selected test id (logs and summary lines named by it). The tool
#             itself (compute-sanitizer 2025.3.1) can die (SIGSEGV) early in a run, with our
#             kernels alone instrumented too: a run that ends before that gets its summary
set -uo pipefail
R="$PWD"; OUT="${OUT:-$R/gpu_out}"; LOGS="$OUT/sanitize"; mkdir -p "$LOGS"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PATH="/usr/local/cuda/bin:$PATH"
# Instrumented kernels run 10-100x slower: a peer's bounded waits must outlast that.
export JAX_EP_TIMEOUT_S="${JAX_EP_TIMEOUT_S:-120}"
# XLA's own allocator hides out-of-bounds accesses inside its pool; the platform allocator gives
# every buffer its own allocation, so memcheck sees each one's bounds.
export XLA_PYTHON_CLIENT_ALLOCATOR=platform PYTHONFAULTHANDLER=1  # a crash shows every thread
TOOLS="${TOOLS:-memcheck racecheck synccheck initcheck}"
MODES="${MODES:-ep1 shared}"
SAN_TESTS="${SAN_TESTS:-tests/test_faults.py tests/test_split_chains.py}"
SAN_K="${SAN_K:-not hundred_buffers}"
# The low-latency backward passes use XLA's all_to_all, which NCCL refuses on a shared GPU.
SHARED_DESELECT=(--deselect tests/test_gradients.py::test_low_latency_gradients
  --deselect tests/test_low_latency_split.py::test_gradients_through_send_and_recv_equal_fused)
compute-sanitizer --version | tail -1 > "$LOGS/version.txt"
filter=()
# Not `--help | grep -q`: under pipefail grep's early exit kills the writer with SIGPIPE and the
# test fails, which would leave every kernel (XLA's too) instrumented.
help=$(compute-sanitizer --help 2>&1)
[[ $help == *--kernel-name* && ${SAN_FILTER:-1} != 0 ]] && filter=(--kernel-name kns=_kernel)
summary="$LOGS/summary.txt"  # appended to: several runs may each run some of the tools
# What each run selects: the whole selection, or with SAN_EACH=1 one test id per run (the tool
# crashes 15-25 s into a run: a short run ends with its summary).
selections=("-k|$SAN_K|$SAN_TESTS")
if [[ ${SAN_EACH:-0} == 1 ]]; then
  # shellcheck disable=SC2086
  mapfile -t ids < <(pytest -m "gpu or stress" -q --collect-only -p no:cacheprovider -k "$SAN_K" $SAN_TESTS \
    2>/dev/null | grep '::')
  selections=(); for id in "${ids[@]}"; do selections+=("id|$id|"); done
fi
for mode in $MODES; do
  for tool in $TOOLS; do
    san=(compute-sanitizer --tool "$tool" "${filter[@]}" --report-api-errors no
      --target-processes all --error-exitcode 9 --print-limit 50)
    # racecheck and initcheck are the slowest by far: their first launches of our kernels cover
    # every op and routing kind. initcheck checks kernels' reads only: the tests copy whole
    # outputs to the host, rows the contract leaves unspecified included.
    [[ $tool == racecheck || $tool == initcheck ]] && san+=(--launch-count "${SLOW_LAUNCHES:-300}")
    [[ $tool == initcheck ]] && san+=(--check-api-memory-access no)
    for selection in "${selections[@]}"; do
      IFS='|' read -r kind value files <<< "$selection"
      if [[ $kind == id ]]; then
        select_args=("$value"); tag="${SAN_TAG:+$SAN_TAG-}$(basename "${value//::/-}" | tr -c 'A-Za-z0-9_.-' _)"
      else
        # shellcheck disable=SC2206
        select_args=(-k "$value" $files); tag="${SAN_TAG:-}"
      fi
      if [[ $mode == ep1 ]]; then
        cmd=("${san[@]}" pytest -m "gpu or stress" -v -p no:cacheprovider "${select_args[@]}")
      else
        pytest_cmd=(pytest -m "gpu or stress" -v -p no:cacheprovider "${SHARED_DESELECT[@]}" "${select_args[@]}")
        launch=(python3 -m jax_ep.launch -n 2 --processes-per-gpu 2 --timeout "$((${SAN_S:-240} - 10))" --)
        if [[ $mode == shared ]]; then
          cmd=("${launch[@]}" "${san[@]}" "${pytest_cmd[@]}")
        else  # shared-rank0
          # shellcheck disable=SC2016
          cmd=("${launch[@]}" bash -c 'if [[ $JAX_EP_PROCESS_ID == 0 ]]; then exec "$@"; fi
            while [[ $1 != pytest ]]; do shift; done; exec "$@"' _ "${san[@]}" "${pytest_cmd[@]}")
        fi
      fi
      log="$LOGS/$mode-$tool${tag:+-$tag}.log"; s=$(date +%s)
      echo "+ ${cmd[*]}" > "$log"  # which filter and tests this log is of
      timeout "${SAN_S:-240}" "${cmd[@]}" >> "$log" 2>&1; rc=$?
      # One "ERROR SUMMARY" (racecheck: "RACECHECK SUMMARY") per process, and pytest's last line.
      errs=$(grep -hoE "(ERROR|RACECHECK) SUMMARY: [0-9]+ (error|hazard)s?[^=]*" "$log" | sort | uniq -c | tr -s ' ' | paste -sd ';')
      tests=$(grep -E "[0-9]+ (passed|failed)" "$log" | tail -2 | tr -s ' ' | paste -sd ';')
      echo "$mode $tool${tag:+ ($tag)} rc=$rc $(( $(date +%s) - s ))s | ${errs:-no sanitizer summary} | ${tests:-no pytest summary}" | tee -a "$summary"
    done
  done
done
