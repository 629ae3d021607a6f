#!/usr/bin/env bash
# An older GPU's code path on a newer GPU: builds jax_ep with PTX only (default compute_80, the
# A100's: __CUDA_ARCH__ 800, software fp8 casts), which the driver JIT-compiles for the GPU here,
# checks that the module carries nothing else and that the driver runs code compiled through that
# PTX, then runs the GPU suite. Run from the repository root; reinstall the usual build after.
#   PTX_ARCH (default 80), PTX_TESTS (default "-m gpu", pytest arguments)
set -euo pipefail
arch="${PTX_ARCH:-80}"
export PATH="/usr/local/cuda/bin:$PATH"
JAX_EP_CUDA_ARCHS="${arch}-virtual" python3 -m pip install --no-build-isolation --no-deps \
  --force-reinstall -C build-dir="/tmp/jax_ep-ptx-$arch" . > "/tmp/jax_ep-ptx-$arch.log" 2>&1 ||
  { tail -30 "/tmp/jax_ep-ptx-$arch.log"; exit 1; }
(cd /tmp && python3 - "$arch" << 'EOF'
import sys

import jax_ep._C as C

arch = sys.argv[1]
built = C.cuda_architectures()
print(f"built: {built!r} (CMake {C.cmake_cuda_architectures()!r}, CUDA {C.cuda_runtime_version()})")
assert built == f"compute_{arch}", f"expected PTX compute_{arch} only, got {built!r}"
image = C.kernel_image(0)
print(f"device 0 runs: {image}")
assert image["ptx_version"] == int(arch), image
EOF
)
(cd /tmp && python3 -m jax_ep.env --no-free-memory | sed -n '/^CUDA extension/,/^$/p;/^Buffer(backend/,$p')
# shellcheck disable=SC2086
pytest -q -p no:cacheprovider ${PTX_TESTS:--m gpu}  # the installed jax_ep (not ./jax_ep)
