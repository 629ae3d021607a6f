// What one custom call costs a jitted program by the kind of kernel it launches, to tell XLA's
// own per-call cost from what our launches add (benchmarks/launch_floor.py builds this and
// times chains of calls). Every handler copies its [n] float32 input to its output with one
// kernel; they differ only in the launch:
//   LaunchFloorTiny      <<<ceil(n/256), 256>>>, 8 bytes of arguments
//   LaunchFloorWide      <<<blocks, 512>>>, the low-latency kernels' shape, plain launch
//   LaunchFloorCoop      the same, cooperative (cudaLaunchAttributeCooperative), as ours
//   LaunchFloorCoopArgs  cooperative with a 1 KiB __grid_constant__ argument (ours: ~350 B)
// All are command-buffer compatible, as our handlers are.
#include <cuda_runtime.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct BigArgs {
  const float* in;
  float* out;
  int n;
  char padding[1024 - 2 * sizeof(void*) - sizeof(int)];
};

__global__ void copy_kernel(const float* in, float* out, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    out[i] = in[i];
  }
}

__global__ void copy_kernel_big(const __grid_constant__ BigArgs args) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < args.n; i += gridDim.x * blockDim.x) {
    args.out[i] = args.in[i];
  }
}

int wide_blocks() {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return sms > 16 ? sms - 8 : sms;  // as low_latency_grid_size
}

void launch_config(bool cooperative, int blocks, int threads, cudaStream_t stream,
                   cudaLaunchConfig_t* config, cudaLaunchAttribute* attribute) {
  attribute->id = cudaLaunchAttributeCooperative;
  attribute->val.cooperative = 1;
  *config = {};
  config->gridDim = dim3(blocks);
  config->blockDim = dim3(threads);
  config->stream = stream;
  config->attrs = cooperative ? attribute : nullptr;
  config->numAttrs = cooperative ? 1 : 0;
}

enum class Kind { kTiny, kWide, kCoop, kCoopArgs };

template <Kind kKind>
ffi::Error copy(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  const int n = static_cast<int>(x.element_count());
  const float* in = x.typed_data();
  float* out = y->typed_data();
  cudaLaunchConfig_t config;
  cudaLaunchAttribute attribute;
  cudaError_t err = cudaSuccess;
  if constexpr (kKind == Kind::kTiny) {
    copy_kernel<<<(n + 255) / 256, 256, 0, stream>>>(in, out, n);
    err = cudaGetLastError();
  } else if constexpr (kKind == Kind::kCoopArgs) {
    launch_config(true, wide_blocks(), 512, stream, &config, &attribute);
    BigArgs args = {};
    args.in = in;
    args.out = out;
    args.n = n;
    err = cudaLaunchKernelEx(&config, copy_kernel_big, args);
  } else {
    launch_config(kKind == Kind::kCoop, wide_blocks(), 512, stream, &config, &attribute);
    err = cudaLaunchKernelEx(&config, copy_kernel, in, out, n);
  }
  if (err != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

#define LAUNCH_FLOOR_HANDLER(name, kind)                                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, copy<kind>,                             \
                                ffi::Ffi::Bind()                              \
                                    .Ctx<ffi::PlatformStream<cudaStream_t>>() \
                                    .Arg<ffi::Buffer<ffi::F32>>()             \
                                    .Ret<ffi::Buffer<ffi::F32>>(),            \
                                {ffi::Traits::kCmdBufferCompatible});

LAUNCH_FLOOR_HANDLER(LaunchFloorTiny, Kind::kTiny)
LAUNCH_FLOOR_HANDLER(LaunchFloorWide, Kind::kWide)
LAUNCH_FLOOR_HANDLER(LaunchFloorCoop, Kind::kCoop)
LAUNCH_FLOOR_HANDLER(LaunchFloorCoopArgs, Kind::kCoopArgs)
