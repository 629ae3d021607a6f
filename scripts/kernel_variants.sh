#!/usr/bin/env bash
# Kernel-time comparison of source variants in one run (one GPU): each variant is a copy
# of this tree with some `sed -i` edits, built for one architecture and installed in turn, then
# measured by the same command. For bisecting a kernel-time change without a commit per guess.
#   VARIANTS="name|file|sed expression[|file|sed expression...];..."  (none: the tree as it is;
#            the pair "patch|path/to.diff" applies a patch instead, e.g. `git diff HEAD <old>`
#            saved untracked in the tree to measure an older commit's kernels)
#   MEASURE="python3 benchmarks/profile_ops.py --ll-tokens 128 --ops ll_combine,ll_combine_split"
#   ARCH=90 (default)
# Example (the fused combine's arrival fence, 8 vs 4 rows in flight):
#   VARIANTS="head;rows4|csrc/kernels/low_latency/combine.cu|s/kOwnerRowsInFlight = 8/kOwnerRowsInFlight = 4/"
# Each variant's output goes to $OUT/<name>.log (its --out files to $OUT/<name>/); a summary of
# the lines matching SUMMARY (default "op span|us x") is printed last.
set -uo pipefail
R="$PWD"; OUT="${OUT:-$R/gpu_out}"; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PATH="/usr/local/cuda/bin:$PATH"
MEASURE="${MEASURE:-python3 benchmarks/profile_ops.py --ll-tokens 128 --ops ll_dispatch_bf16,ll_combine}"
IFS=';' read -ra variants <<< "${VARIANTS:?VARIANTS=\"name|file|sed expression;...\"}"
for v in "${variants[@]}"; do
  IFS='|' read -ra fields <<< "$v"; name=${fields[0]}
  dir="/tmp/variant-$name"; rm -rf "$dir"; mkdir -p "$dir" "$OUT/$name"
  tar --exclude=./.git --exclude=./build --exclude=./.venv --exclude=./.whl -cf - . | tar -xf - -C "$dir"
  ok=1
  for ((i = 1; i + 1 < ${#fields[@]}; i += 2)); do
    file=${fields[i]}; expr=${fields[i + 1]}
    if [[ $file == patch ]]; then
      (cd "$dir" && { git apply "$R/$expr" 2>/dev/null || patch -s -p1 < "$R/$expr"; }) ||
        { echo "$name: $expr does not apply"; ok=0; }
      continue
    fi
    before=$(md5sum "$dir/$file"); sed -i "$expr" "$dir/$file"
    [[ "$before" != "$(md5sum "$dir/$file")" ]] || { echo "$name: '$expr' changed nothing in $file"; ok=0; }
  done
  [[ $ok == 1 ]] || continue
  (cd "$dir" && timeout 200 env JAX_EP_CUDA_ARCHS="${ARCH:-90}" python3 -m pip install -q \
     --no-build-isolation --no-deps --force-reinstall . -C build-dir="/tmp/build-$name") \
     > "$OUT/$name.log" 2>&1 || { echo "$name: build failed"; tail -5 "$OUT/$name.log"; continue; }
  # Measured from /tmp, so that `import jax_ep` finds the variant just installed.
  (cd /tmp && timeout "${MEASURE_S:-120}" ${MEASURE/benchmarks\//$R/benchmarks/} --out "$OUT/$name") \
    >> "$OUT/$name.log" 2>&1
  echo "$name rc=$?"
done
for v in "${variants[@]}"; do
  name=${v%%|*}; echo "== $name"; grep -h -E "${SUMMARY:-op span|us x}" "$OUT/$name.log" 2>/dev/null | cut -c1-110
done
