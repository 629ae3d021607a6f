// Host-side helpers of the kernel launchers (included by .cu files only).
#pragma once

#include <cuda_runtime.h>

namespace jax_ep {

// Launchers return the first failing CUDA status (the handler turns it into an ffi::Error).
#define CUDA_RETURN_IF_ERROR(expr)              \
  do {                                          \
    const cudaError_t status_ = (expr);         \
    if (status_ != cudaSuccess) return status_; \
  } while (0)

template <typename T>
constexpr T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

// Launches `kernel` cooperatively: every block is resident at once, so blocks may wait for words
// that other blocks of the same launch write. The grid must fit the device (at most one block
// per SM for kernels that fill an SM); the launch fails otherwise.
template <typename Args>
cudaError_t launch_cooperative(void (*kernel)(Args), int num_blocks, int num_threads,
                               size_t smem_bytes, cudaStream_t stream, const Args& args) {
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeCooperative;
  attribute.val.cooperative = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(num_blocks);
  config.blockDim = dim3(num_threads);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, args);
}

// Multiprocessors of the context's device (ctx.num_sms when the runtime filled it in).
inline cudaError_t device_num_sms(int device, int known, int* num_sms) {
  *num_sms = known;
  if (known > 0) return cudaSuccess;
  return cudaDeviceGetAttribute(num_sms, cudaDevAttrMultiProcessorCount, device);
}

}  // namespace jax_ep
