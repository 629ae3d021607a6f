// 16-byte vector loads/stores and the warp-wide row movers built on them.
//
// Rows are moved by one warp: lane l handles vectors l, l+32, ...; each lane keeps kCopyUnroll
// loads in flight before it stores, which is what makes a warp reach memory bandwidth.
#pragma once

#include <cstdint>

#include "common/limits.h"

namespace jax_ep {

// Loads in flight per lane in the row movers (16 bytes each).
constexpr int kCopyUnroll = 8;

// Read-only inputs of this call (XLA operands): non-coherent path, not kept in L1.
__device__ __forceinline__ int4 ld_nc_v4(const int4* ptr) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

// Data a peer wrote during this kernel (after an acquire of its flag): L2 only, never a stale L1.
__device__ __forceinline__ int4 ld_cg_v4(const int4* ptr) {
  int4 v;
  asm volatile("ld.global.cg.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr)
               : "memory");
  return v;
}

__device__ __forceinline__ void st_v4(int4* ptr, const int4& v) {
  asm volatile("st.global.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

__device__ __forceinline__ int ld_cg_s32(const int* ptr) {
  int v;
  asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

__device__ __forceinline__ float ld_cg_f32(const float* ptr) {
  return __int_as_float(ld_cg_s32(reinterpret_cast<const int*>(ptr)));
}

// Asynchronous 16-byte copy of a read-only input to shared memory (L2 only, no register): the
// thread goes on; cp_async_wait_all() waits for all of its copies. Before sm_80 (no cp.async)
// a plain load and store.
__device__ __forceinline__ void cp_async_v4(void* smem_dst, const void* src) {
#if __CUDA_ARCH__ >= 800
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
#else
  *static_cast<int4*>(smem_dst) = ld_nc_v4(static_cast<const int4*>(src));
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;");
#endif
}

__device__ __forceinline__ void cp_async_wait_all() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// Copies `num_vectors` 16-byte vectors from src to dst with the whole warp. kSourceIsInput: src
// is a read-only XLA operand (else it is memory a peer wrote during this kernel).
template <bool kSourceIsInput>
__device__ __forceinline__ void warp_copy_vectors(int4* dst, const int4* src, int64_t num_vectors,
                                                  int lane) {
  for (int64_t base = lane; base < num_vectors; base += kWarpSize * kCopyUnroll) {
    int4 v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t idx = base + u * kWarpSize;
      if (idx < num_vectors) v[u] = kSourceIsInput ? ld_nc_v4(src + idx) : ld_cg_v4(src + idx);
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t idx = base + u * kWarpSize;
      if (idx < num_vectors) st_v4(dst + idx, v[u]);
    }
  }
}

__device__ __forceinline__ void warp_zero_vectors(int4* dst, int64_t num_vectors, int lane) {
  const int4 zero = make_int4(0, 0, 0, 0);
  for (int64_t idx = lane; idx < num_vectors; idx += kWarpSize) st_v4(dst + idx, zero);
}

}  // namespace jax_ep
