#!/usr/bin/env bash
# Builds and runs benchmarks/cublaslt_grouped_probe.cu (cuBLASLt's grouped matmul at the MoE
# expert GEMMs' shape) against the cuBLAS of this Python environment (the
# nvidia-cublas wheel that jax's CUDA plugin installs; else the CUDA toolkit's), on one GPU.
# CUBLAS_ROOT: a folder with include/cublasLt.h and lib/libcublasLt.so* (default: found).
# Output: stdout, $OUT/cublaslt_probe.txt and $OUT/<machine>-<date>-cublaslt_grouped.json (OUT:
# default benchmarks/out/, which git ignores).
set -uo pipefail
R="$(cd "$(dirname "$0")/.." && pwd)"; OUT="${OUT:-$R/benchmarks/out}"; mkdir -p "$OUT"; export R
PATH="/usr/local/cuda/bin:$PATH"
root=${CUBLAS_ROOT:-$(python3 - <<'PY'
import glob, os, site
bases = site.getsitepackages() + [site.getusersitepackages()]
hits = [h for b in bases for h in glob.glob(os.path.join(b, "nvidia", "*", "include", "cublasLt.h"))]
print(os.path.dirname(os.path.dirname(hits[0])) if hits else "/usr/local/cuda")
PY
)}
lib=$(ls "$root"/lib/libcublasLt.so* "$root"/lib64/libcublasLt.so* 2>/dev/null | head -1)
echo "cuBLAS from $root ($lib)" | tee "$OUT/cublaslt_probe.txt"
if ! nvcc -O2 -std=c++17 -arch=sm_90 -I"$root/include" "$R/benchmarks/cublaslt_grouped_probe.cu" \
    -L"$(dirname "$lib")" -l:"$(basename "$lib")" -Xlinker -rpath="$(dirname "$lib")" \
    -o /tmp/cublaslt_probe >> "$OUT/cublaslt_probe.txt" 2>&1; then
  tail -5 "$OUT/cublaslt_probe.txt"; echo "build failed (a cuBLAS without the grouped matmul?)"; exit 1
fi
timeout "${PROBE_S:-120}" /tmp/cublaslt_probe 2>&1 | tee -a "$OUT/cublaslt_probe.txt"
# The results as JSON beside the other benchmarks' (machine, date, commit, command, per product).
PROBE_TEXT="$OUT/cublaslt_probe.txt" python3 - "$OUT" <<'PY'
import os, re, sys
sys.path.insert(0, os.path.join(os.environ.get("R", "."), "benchmarks"))
import bench_records as br  # noqa: E402

text = open(os.environ["PROBE_TEXT"]).read()
rows = [{"product": m[1].strip(), "time_us": float(m[2]), "tflops": float(m[3]),
         "algorithms": int(m[4]), "worst_sampled_error": float(m[5])}
        for m in re.finditer(r"^(.{44}) +([\d.]+) us +([\d.]+) TFLOP/s \((\d+) algorithms, "
                             r"worst sampled error ([\d.e+-]+)\)$", text, re.M)]
header = br.result_header([])
header["command"] = "bash scripts/cublaslt_probe.sh"
path = os.path.join(sys.argv[1], f"{br.machine_name()}-{br.today()}-cublaslt_grouped.json")
br.write_json(path, {**header, "output": text, "results": rows})
print(f"wrote {path}")
PY
