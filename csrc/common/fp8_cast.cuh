// In-kernel cast of bf16 activations to e4m3fn with one float32 scale per 128 channels
// (docs/api.md, "FP8 scales").
//
// Work unit: one thread holds a "piece" of 16 consecutive channels (two 16-byte vectors of bf16)
// and produces 16 bytes of e4m3. Eight consecutive lanes of a warp, starting at a lane that is a
// multiple of 8, hold the 128 channels of one scale group; fp8_group_amax reduces over them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "common/limits.h"

namespace jax_ep {

constexpr int kFp8ChannelsPerPiece = 16;
constexpr int kFp8PiecesPerScale = kChannelsPerScale / kFp8ChannelsPerPiece;  // 8 lanes
constexpr float kFp8E4m3Max = 448.0f;
// Floor on a group's amax, so an all-zero group still gets a finite, nonzero scale.
constexpr float kFp8MinAmax = 1e-4f;

static_assert(kFp8PiecesPerScale == 8 && kWarpSize % kFp8PiecesPerScale == 0,
              "a scale group is 8 aligned lanes of one warp");

// max |x| over the 16 bf16 of one piece.
__device__ __forceinline__ float bf16_piece_amax(const int4& lo, const int4& hi) {
  const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(&lo);
  const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&hi);
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 fa = __bfloat1622float2(a[i]);
    const float2 fb = __bfloat1622float2(b[i]);
    amax = fmaxf(amax, fmaxf(fmaxf(fabsf(fa.x), fabsf(fa.y)), fmaxf(fabsf(fb.x), fabsf(fb.y))));
  }
  return amax;
}

// Reduces a per-piece amax over the 8 aligned lanes of its scale group. Every lane of the warp
// must call it (full-mask shuffles); lanes without data pass 0.
__device__ __forceinline__ float fp8_group_amax(float amax) {
#pragma unroll
  for (int mask = kFp8PiecesPerScale / 2; mask > 0; mask >>= 1) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, mask));
  }
  return amax;
}

// scale = max(amax, 1e-4) / 448; with round_scale the next power of two >= that value, computed
// exactly on the bits (a normal positive float: clear the mantissa, bump the exponent if it was
// nonzero), so it never depends on the rounding of a log2.
__device__ __forceinline__ float fp8_scale_from_amax(float amax, bool round_scale) {
  float scale = fmaxf(amax, kFp8MinAmax) / kFp8E4m3Max;
  if (round_scale) {
    constexpr uint32_t kMantissaMask = 0x007fffffu;
    constexpr uint32_t kExponentOne = 0x00800000u;
    uint32_t bits = __float_as_uint(scale);
    if (bits & kMantissaMask) bits = (bits & ~kMantissaMask) + kExponentOne;
    scale = __uint_as_float(bits);
  }
  return scale;
}

// 16 bf16 * inv_scale -> 16 e4m3fn (saturating to +-448), in channel order.
__device__ __forceinline__ int4 bf16_piece_to_e4m3(const int4& lo, const int4& hi,
                                                   float inv_scale) {
  const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(&lo);
  const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&hi);
  uint32_t packed[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162* src = i < 2 ? a + 2 * i : b + 2 * (i - 2);
    float2 f0 = __bfloat1622float2(src[0]);
    float2 f1 = __bfloat1622float2(src[1]);
    f0.x *= inv_scale;
    f0.y *= inv_scale;
    f1.x *= inv_scale;
    f1.y *= inv_scale;
    const uint32_t q0 = __nv_cvt_float2_to_fp8x2(f0, __NV_SATFINITE, __NV_E4M3);
    const uint32_t q1 = __nv_cvt_float2_to_fp8x2(f1, __NV_SATFINITE, __NV_E4M3);
    packed[i] = q0 | (q1 << 16);
  }
  return make_int4(static_cast<int>(packed[0]), static_cast<int>(packed[1]),
                   static_cast<int>(packed[2]), static_cast<int>(packed[3]));
}

}  // namespace jax_ep
