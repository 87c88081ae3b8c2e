// mtp_small_matmul: y[M, N] = x[M, K] @ W + bias for the few rows of a decode or verify step on a CPU
// host, with W pre-packed as [N/16, K, 16] (column panels of 16, each a contiguous stream).
//
// WHY: a batch-1 step with k drafts multiplies k+1 rows by every weight. Paddle's CPU matmul (MKL) is
// fast for one row (a GEMV) and for many, but for 2 to 6 rows its GEMM path packs the weight on every
// call: on a 2-core AMD EPYC host a [3, 256] x [256, 1536] product from a cold cache took ~200 us against
// ~70 us for one row. Here each weight byte comes from memory once whatever M is, so a few rows cost
// little more than one, and the verify pass of speculative decoding stops paying per draft for weight
// traffic.
//
// Each output row is computed by the same code in the same order whatever M is, so a row's result does
// not depend on how many rows share the call: greedy decoding with and without drafts computes the
// same logits for the same position.
//
// Python wrapper: mtpserve.model.small_matmul (it packs weights and decides when this op is used).
#include <cstddef>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define MTP_HAVE_X86 1
#endif

#include "paddle/extension.h"

namespace {

constexpr int kPanel = 16;  // output columns per panel: two 8-float AVX registers
constexpr int kPrefetchRows = 16;  // panel rows (of 64 bytes) read ahead of the FMA loop

struct Operands {
  const float* x;
  const float* panels;
  const float* bias;  // nullptr: none
  float* y;
  int64_t k, n;
};

#if MTP_HAVE_X86
// One row against one panel. Even and odd k go to separate accumulators: with a single chain per
// register the loop waits out the FMA latency on every k (measured: ~40% slower with the weight in
// cache). The panel is read from memory for the first row and from L1 for the others.
__attribute__((target("avx2,fma"))) void RowAvx2(const Operands& op, const float* x, const float* panel,
                                                  float* y, int64_t col) {
  __m256 even0 = _mm256_setzero_ps(), even1 = _mm256_setzero_ps();
  __m256 odd0 = _mm256_setzero_ps(), odd1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 1 < op.k; i += 2) {
    const float* w = panel + i * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchRows * kPanel), _MM_HINT_T0);
    const __m256 a = _mm256_broadcast_ss(x + i);
    const __m256 b = _mm256_broadcast_ss(x + i + 1);
    even0 = _mm256_fmadd_ps(a, _mm256_loadu_ps(w), even0);
    even1 = _mm256_fmadd_ps(a, _mm256_loadu_ps(w + 8), even1);
    odd0 = _mm256_fmadd_ps(b, _mm256_loadu_ps(w + kPanel), odd0);
    odd1 = _mm256_fmadd_ps(b, _mm256_loadu_ps(w + kPanel + 8), odd1);
  }
  if (i < op.k) {  // odd K: the last k joins the even chain
    const __m256 a = _mm256_broadcast_ss(x + i);
    even0 = _mm256_fmadd_ps(a, _mm256_loadu_ps(panel + i * kPanel), even0);
    even1 = _mm256_fmadd_ps(a, _mm256_loadu_ps(panel + i * kPanel + 8), even1);
  }
  __m256 lo = _mm256_add_ps(even0, odd0), hi = _mm256_add_ps(even1, odd1);
  if (op.bias) {
    lo = _mm256_add_ps(lo, _mm256_loadu_ps(op.bias + col));
    hi = _mm256_add_ps(hi, _mm256_loadu_ps(op.bias + col + 8));
  }
  _mm256_storeu_ps(y + col, lo);
  _mm256_storeu_ps(y + col + 8, hi);
}
#endif

// The same arithmetic without AVX2 (any x86-64 or another architecture): slow, but never wrong.
void RowPortable(const Operands& op, const float* x, const float* panel, float* y, int64_t col) {
  float even[kPanel] = {}, odd[kPanel] = {};
  int64_t i = 0;
  for (; i + 1 < op.k; i += 2)
    for (int j = 0; j < kPanel; ++j) {
      even[j] += x[i] * panel[i * kPanel + j];
      odd[j] += x[i + 1] * panel[(i + 1) * kPanel + j];
    }
  if (i < op.k)
    for (int j = 0; j < kPanel; ++j) even[j] += x[i] * panel[i * kPanel + j];
  for (int j = 0; j < kPanel; ++j) y[col + j] = even[j] + odd[j] + (op.bias ? op.bias[col + j] : 0.0f);
}

void Multiply(const Operands& op, int64_t m) {
#if MTP_HAVE_X86
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  for (int64_t col = 0; col < op.n; col += kPanel) {
    const float* panel = op.panels + col * op.k;  // panel col/16 starts at (col/16) * K * 16
    for (int64_t row = 0; row < m; ++row) {
      const float* x = op.x + row * op.k;
      float* y = op.y + row * op.n;
#if MTP_HAVE_X86
      if (avx2) {
        RowAvx2(op, x, panel, y, col);
        continue;
      }
#endif
      RowPortable(op, x, panel, y, col);
    }
  }
}

std::vector<paddle::Tensor> SmallMatmul(const paddle::Tensor& x, const paddle::Tensor& panels,
                                        const paddle::optional<paddle::Tensor>& bias) {
  PD_CHECK(x.is_cpu() && panels.is_cpu(), "mtp_small_matmul runs on CPU tensors");
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32 && panels.dtype() == paddle::DataType::FLOAT32,
           "mtp_small_matmul takes float32");
  const auto& xs = x.shape();
  const auto& ps = panels.shape();
  PD_CHECK(xs.size() == 2 && ps.size() == 3 && ps[2] == kPanel, "x must be [M, K], panels [N/16, K, 16]");
  PD_CHECK(xs[1] == ps[1], "x has ", xs[1], " columns, the weight ", ps[1], " rows");
  const int64_t n = ps[0] * kPanel;
  const paddle::Tensor xc = x.is_contiguous() ? x : x.contiguous();
  const paddle::Tensor pc = panels.is_contiguous() ? panels : panels.contiguous();
  const float* b = nullptr;
  if (bias) {
    PD_CHECK(bias->is_cpu() && bias->dtype() == paddle::DataType::FLOAT32 && bias->numel() == n,
             "bias must be a float32 CPU tensor of N values");
    b = bias->data<float>();
  }
  paddle::Tensor y = paddle::empty({xs[0], n}, paddle::DataType::FLOAT32, x.place());
  Multiply({xc.data<float>(), pc.data<float>(), b, y.data<float>(), xs[1], n}, xs[0]);
  return {y};
}

std::vector<std::vector<int64_t>> SmallMatmulShape(const std::vector<int64_t>& x,
                                                   const std::vector<int64_t>& panels,
                                                   const paddle::optional<std::vector<int64_t>>& bias) {
  return {{x[0], panels[0] * kPanel}};
}

std::vector<paddle::DataType> SmallMatmulDtype(const paddle::DataType& x, const paddle::DataType& panels,
                                               const paddle::optional<paddle::DataType>& bias) {
  return {x};
}

}  // namespace

PD_BUILD_OP(mtp_small_matmul)
    .Inputs({"x", "panels", paddle::Optional("bias")})
    .Outputs({"y"})
    .SetKernelFn(PD_KERNEL(SmallMatmul))
    .SetInferShapeFn(PD_INFER_SHAPE(SmallMatmulShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(SmallMatmulDtype));
