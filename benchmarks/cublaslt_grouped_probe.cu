// Probe of cuBLASLt's grouped matmul (CUBLASLT_BATCH_MODE_GROUPED, experimental in cuBLAS 13)
// as a candidate for the MoE expert GEMMs: its group shapes and matrix pointers are
// device arrays, so data-dependent group sizes need no host round trip, unlike
// cublasGemmGroupedBatchedEx, whose m/n/k arrays live on the host.
//
//   nvcc -O2 -std=c++17 -arch=sm_90 -I<cublas include> benchmarks/cublaslt_grouped_probe.cu \
//        -L<cublas lib> -lcublasLt -o /tmp/probe && /tmp/probe
//   (scripts/cublaslt_probe.sh finds cuBLAS in the Python environment and runs it)
//
// The products of one forward + backward step of bench_moe_layer's expert GEMMs at EP=1
// (N = T*K = 32768 rows in G = 64 groups, H = 2048, F = 1024, gate and up fused): each is one
// grouped matmul, timed with CUDA events (kernel time, median of 20), checked on sampled
// entries against a float reference on the host. Row-major operands are read as
// column-major transposes. Prints one line per product and the step's total TFLOP/s.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>

#define CUDA_CHECK(x)                                                                      \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

namespace {

constexpr int kGroups = 64, kRows = 32768, kHidden = 2048, kFfn = 1024;

struct Matrix {  // row-major [rows, cols] bf16 on the device, and its host copy
  int rows = 0, cols = 0;
  __nv_bfloat16* device = nullptr;
  std::vector<__nv_bfloat16> host;
};

// Uniform in [-scale, scale) from a xorshift generator (hundreds of millions of values: a
// std::normal_distribution would take most of the probe's run).
Matrix random_matrix(int rows, int cols, uint64_t seed, float scale) {
  Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.host.resize(static_cast<size_t>(rows) * cols);
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& v : m.host) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    const float unit = static_cast<float>(state >> 40) / static_cast<float>(1ull << 24);
    v = __float2bfloat16((2.0f * unit - 1.0f) * scale);
  }
  CUDA_CHECK(cudaMalloc(&m.device, m.host.size() * sizeof(__nv_bfloat16)));
  CUDA_CHECK(cudaMemcpy(m.device, m.host.data(), m.host.size() * sizeof(__nv_bfloat16),
                        cudaMemcpyHostToDevice));
  return m;
}

template <typename T>
T* to_device(const std::vector<T>& v) {
  T* d = nullptr;
  CUDA_CHECK(cudaMalloc(&d, v.size() * sizeof(T)));
  CUDA_CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// One grouped operand in column-major terms: per group g a (rows[g] x cols[g]) matrix with
// leading dimension ld[g] at pointers[g].
struct Grouped {
  std::vector<int32_t> rows, cols, ld;
  std::vector<const void*> pointers;
  cublasLtMatrixLayout_t layout = nullptr;
  const void** device_pointers = nullptr;

  void add(int num_rows, int num_cols, int lead, const void* pointer) {
    rows.push_back(num_rows);
    cols.push_back(num_cols);
    ld.push_back(lead);
    pointers.push_back(pointer);
  }
};

cublasStatus_t make_layout(Grouped& g) {
  int32_t* rows = to_device(g.rows);
  int32_t* cols = to_device(g.cols);
  int32_t* ld = to_device(g.ld);
  g.device_pointers = to_device(g.pointers);
  return cublasLtGroupedMatrixLayoutCreate(&g.layout, CUDA_R_16BF, kGroups, rows, cols, ld);
}

float bf(const __nv_bfloat16& v) { return __bfloat162float(v); }

struct Product {
  const char* name;
  double flops;
  Grouped a, b, d;
  cublasOperation_t trans_a, trans_b;
  // Reference of D's column-major entry (i, j) of group g, from the host matrices.
  std::function<float(int g, int i, int j)> reference;
};

}  // namespace

int main() {
  int device = 0;
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  std::printf("device %s (sm_%d%d), cuBLASLt %zu\n", prop.name, prop.major, prop.minor,
              cublasLtGetVersion());

  std::mt19937 rng(7);
  // Group sizes: a random split of kRows over kGroups (multinomial-like, like a router's).
  std::vector<int32_t> sizes(kGroups, 0);
  std::uniform_int_distribution<int> pick(0, kGroups - 1);
  for (int r = 0; r < kRows; ++r) ++sizes[pick(rng)];
  std::vector<int64_t> starts(kGroups, 0);
  for (int g = 1; g < kGroups; ++g) starts[g] = starts[g - 1] + sizes[g - 1];

  // Row-major operands: x [N, H], w_gu [G, H, 2F], h [N, F] (the SwiGLU's output), w_down
  // [G, F, H], dy [N, H] (cotangent of the layer output), dgu [N, 2F].
  Matrix x = random_matrix(kRows, kHidden, 1, 1.0f);
  Matrix w_gu = random_matrix(kGroups * kHidden, 2 * kFfn, 2, 0.05f);
  Matrix h = random_matrix(kRows, kFfn, 3, 1.0f);
  Matrix w_down = random_matrix(kGroups * kFfn, kHidden, 4, 0.05f);
  Matrix dy = random_matrix(kRows, kHidden, 5, 1.0f);
  Matrix dgu = random_matrix(kRows, 2 * kFfn, 6, 1.0f);
  __nv_bfloat16* out = nullptr;  // every product's D, up to [G, H, 2F] elements
  const size_t out_elems = std::max(static_cast<size_t>(kRows) * 2 * kFfn,
                                    static_cast<size_t>(kGroups) * kHidden * 2 * kFfn);
  CUDA_CHECK(cudaMalloc(&out, out_elems * sizeof(__nv_bfloat16)));

  auto rows_of = [&](const Matrix& m, int g) { return m.device + starts[g] * m.cols; };
  auto weight_of = [&](const Matrix& w, int g, int k) {
    return w.device + static_cast<size_t>(g) * k * w.cols;
  };

  std::vector<Product> products;
  // Row kernel: Y[N, M] = X[N, K] @ W_g[K, M], column-major D (M x n_g) = W_g (M x K) * X_g (K x
  // n_g). transpose_w: Y = X @ W_g^T with W_g [M, K] row-major (the dx products).
  auto row_product = [&](const char* name, const Matrix& xm, const Matrix& w, int k, int m,
                         bool transpose_w) {
    Product p;
    p.name = name;
    p.flops = 2.0 * kRows * k * m;
    p.trans_a = transpose_w ? CUBLAS_OP_T : CUBLAS_OP_N;
    p.trans_b = CUBLAS_OP_N;
    for (int g = 0; g < kGroups; ++g) {
      // A: W_g as stored: row-major [K, M] = column-major (M x K), ld M; transposed: row-major
      // [M, K] = column-major (K x M), ld K, read with op T.
      if (transpose_w) {
        p.a.add(k, m, k, weight_of(w, g, m));
      } else {
        p.a.add(m, k, m, weight_of(w, g, k));
      }
      p.b.add(k, sizes[g], k, rows_of(xm, g));
      p.d.add(m, sizes[g], m, out + starts[g] * m);
    }
    const Matrix* xp = &xm;
    const Matrix* wp = &w;
    p.reference = [=, &starts](int g, int i, int j) {  // D(i, j) = Y[start + j, i]
      double acc = 0;
      for (int kk = 0; kk < k; ++kk) {
        const float xv = bf(xp->host[(starts[g] + j) * static_cast<size_t>(k) + kk]);
        const float wv = transpose_w ? bf(wp->host[(static_cast<size_t>(g) * m + i) * k + kk])
                                     : bf(wp->host[(static_cast<size_t>(g) * k + kk) * m + i]);
        acc += static_cast<double>(xv) * wv;
      }
      return static_cast<float>(acc);
    };
    products.push_back(std::move(p));
  };
  // Contraction kernel: dW_g[K, M] = X_g^T @ DY_g, row-major [K, M] = column-major (M x K) =
  // DY_g (M x n_g, column-major view of row-major [n_g, M]) * X_g^T (n_g x K: X_g's column-major
  // view (K x n_g), op T).
  auto contract_product = [&](const char* name, const Matrix& xm, const Matrix& dym, int k, int m) {
    Product p;
    p.name = name;
    p.flops = 2.0 * kRows * k * m;
    p.trans_a = CUBLAS_OP_N;
    p.trans_b = CUBLAS_OP_T;
    for (int g = 0; g < kGroups; ++g) {
      p.a.add(m, sizes[g], m, rows_of(dym, g));
      p.b.add(k, sizes[g], k, rows_of(xm, g));
      p.d.add(m, k, m, out + static_cast<size_t>(g) * k * m);
    }
    const Matrix* xp = &xm;
    const Matrix* dp = &dym;
    p.reference = [=, &starts, &sizes](int g, int i, int j) {  // D(i, j) = dW_g[j, i]
      double acc = 0;
      for (int r = 0; r < sizes[g]; ++r) {
        const size_t row = starts[g] + r;
        acc += static_cast<double>(bf(xp->host[row * k + j])) * bf(dp->host[row * m + i]);
      }
      return static_cast<float>(acc);
    };
    products.push_back(std::move(p));
  };
  row_product("forward gate_up [N,2048]x[G,2048,2048]", x, w_gu, kHidden, 2 * kFfn, false);
  row_product("forward down    [N,1024]x[G,1024,2048]", h, w_down, kFfn, kHidden, false);
  row_product("dx down         [N,2048]x[G,1024,2048]^T", dy, w_down, kHidden, kFfn, true);
  contract_product("dw down         [N,1024]^T[N,2048]", h, dy, kFfn, kHidden);
  row_product("dx gate_up      [N,2048]x[G,2048,2048]^T", dgu, w_gu, 2 * kFfn, kHidden, true);
  contract_product("dw gate_up      [N,2048]^T[N,2048]", x, dgu, kHidden, 2 * kFfn);

  cublasLtHandle_t handle;
  if (cublasLtCreate(&handle) != CUBLAS_STATUS_SUCCESS) {
    std::printf("cublasLtCreate failed\n");
    return 1;
  }
  const size_t workspace_bytes = 256ull << 20;
  void* workspace = nullptr;
  CUDA_CHECK(cudaMalloc(&workspace, workspace_bytes));
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));

  double total_us = 0, total_flops = 0;
  bool all_ran = true;
  for (Product& p : products) {
    cublasStatus_t st = make_layout(p.a);
    if (st == CUBLAS_STATUS_SUCCESS) st = make_layout(p.b);
    if (st == CUBLAS_STATUS_SUCCESS) st = make_layout(p.d);
    if (st != CUBLAS_STATUS_SUCCESS) {
      std::printf("%-44s grouped layout: status %d\n", p.name, static_cast<int>(st));
      all_ran = false;
      continue;
    }
    cublasLtMatmulDesc_t desc;
    cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &p.trans_a,
                                   sizeof(p.trans_a));
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &p.trans_b,
                                   sizeof(p.trans_b));
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                         &workspace_bytes, sizeof(workspace_bytes));
    const uint32_t avg_rows = static_cast<uint32_t>(p.d.rows[0]);
    const uint32_t avg_cols =
        static_cast<uint32_t>(p.d.cols[0] == p.d.cols[1] ? p.d.cols[0] : kRows / kGroups);
    const uint32_t avg_k =
        static_cast<uint32_t>(p.trans_b == CUBLAS_OP_T ? kRows / kGroups : p.b.rows[0]);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_GROUPED_DESC_D_AVERAGE_ROWS,
                                         &avg_rows, sizeof(avg_rows));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_GROUPED_DESC_D_AVERAGE_COLS,
                                         &avg_cols, sizeof(avg_cols));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_GROUPED_AVERAGE_REDUCTION_DIM,
                                         &avg_k, sizeof(avg_k));
    cublasLtMatmulHeuristicResult_t results[8] = {};
    int found = 0;
    st = cublasLtMatmulAlgoGetHeuristic(handle, desc, p.a.layout, p.b.layout, p.d.layout,
                                        p.d.layout, pref, 8, results, &found);
    if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
      std::printf("%-44s heuristic: status %d, %d algorithms\n", p.name, static_cast<int>(st),
                  found);
      all_ran = false;
      continue;
    }
    const float alpha = 1.0f, beta = 0.0f;
    auto run = [&](int algo) {
      return cublasLtMatmul(handle, desc, &alpha, p.a.device_pointers, p.a.layout,
                            p.b.device_pointers, p.b.layout, &beta, p.d.device_pointers, p.d.layout,
                            p.d.device_pointers, p.d.layout, &results[algo].algo, workspace,
                            workspace_bytes, stream);
    };
    // The fastest of the heuristic's algorithms (median of 20 runs each).
    float best_us = 1e30f;
    int best = -1;
    for (int algo = 0; algo < found; ++algo) {
      if (run(algo) != CUBLAS_STATUS_SUCCESS) continue;
      std::vector<float> times;
      for (int i = 0; i < 20; ++i) {
        CUDA_CHECK(cudaEventRecord(start, stream));
        run(algo);
        CUDA_CHECK(cudaEventRecord(stop, stream));
        CUDA_CHECK(cudaEventSynchronize(stop));
        float ms = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
        times.push_back(ms * 1000.0f);
      }
      std::sort(times.begin(), times.end());
      if (times[10] < best_us) {
        best_us = times[10];
        best = algo;
      }
    }
    if (best < 0) {
      std::printf("%-44s every algorithm failed to run\n", p.name);
      all_ran = false;
      continue;
    }
    // Check sampled entries of D (the best algorithm's output) against the host reference.
    CUDA_CHECK(run(best) == CUBLAS_STATUS_SUCCESS ? cudaSuccess : cudaErrorUnknown);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    double worst = 0;
    std::uniform_int_distribution<int> any_group(0, kGroups - 1);
    for (int s = 0; s < 24; ++s) {
      const int g = any_group(rng);
      if (p.d.cols[g] == 0) continue;
      const int i = static_cast<int>(rng() % p.d.rows[g]);
      const int j = static_cast<int>(rng() % p.d.cols[g]);
      __nv_bfloat16 got;
      const auto* base = static_cast<const __nv_bfloat16*>(p.d.pointers[g]);
      CUDA_CHECK(cudaMemcpy(&got, base + static_cast<size_t>(j) * p.d.ld[g] + i, sizeof(got),
                            cudaMemcpyDeviceToHost));
      const float want = p.reference(g, i, j);
      worst = std::max(worst, std::fabs(bf(got) - want) / (std::fabs(want) + 1.0));
    }
    std::printf("%-44s %8.1f us %6.1f TFLOP/s (%d algorithms, worst sampled error %.2g)\n", p.name,
                best_us, p.flops / best_us * 1e-6, found, worst);
    total_us += best_us;
    total_flops += p.flops;
  }
  if (all_ran) {
    std::printf("step (6 products): %.1f us, %.1f TFLOP/s\n", total_us,
                total_flops / total_us * 1e-6);
  }
  return 0;
}
