// Division by a divisor fixed for a launch but known only at run time (an expert id by the
// experts per rank), without the ~30 dependent instructions of a 32-bit integer division: the
// host computes a multiplier once (Granlund & Montgomery, "Division by invariant integers using
// multiplication", 1994), the device divides with a multiply-high, a subtract, an add and two
// shifts. Exact for every uint32 numerator and divisor >= 1.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define JAX_EP_DIVISOR_HOST_DEVICE __host__ __device__
#else
#define JAX_EP_DIVISOR_HOST_DEVICE
#endif

namespace jax_ep {

struct FastDivisor {
  uint32_t divisor = 1;
  uint32_t multiplier = 1;  // floor(2^32 * (2^l - d) / d) + 1, l = ceil(log2 d)
  uint32_t shift1 = 0;      // min(l, 1)
  uint32_t shift2 = 0;      // max(l - 1, 0)

  FastDivisor() = default;
  explicit FastDivisor(uint32_t d) : divisor(d) {
    uint32_t l = 0;
    while (l < 32 && (uint64_t{1} << l) < d) ++l;
    multiplier = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << l) - d)) / d + 1);
    shift1 = l < 1 ? l : 1;
    shift2 = l < 1 ? 0 : l - 1;
  }

  JAX_EP_DIVISOR_HOST_DEVICE uint32_t divide(uint32_t n) const {
    const uint32_t high = static_cast<uint32_t>((static_cast<uint64_t>(n) * multiplier) >> 32);
    return (high + ((n - high) >> shift1)) >> shift2;
  }
};

}  // namespace jax_ep

#undef JAX_EP_DIVISOR_HOST_DEVICE
