// Host-side helpers of the kernel launchers.
#pragma once

#include <cuda_runtime_api.h>

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

}  // namespace jax_ep
