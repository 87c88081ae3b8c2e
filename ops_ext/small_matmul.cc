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
// Each output row is summed in the same order (even and odd k apart, then added) whatever M is and
// whichever tile it falls in, so a row's result does not depend on how many rows share the call: greedy decoding with and without drafts computes the
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

constexpr int kRowTile = 3;  // rows sharing each weight load: 12 accumulators + 2 weights + 1 input

#if MTP_HAVE_X86
// Up to three rows against one panel. Even and odd k go to separate accumulators: with one chain per
// register the loop would wait out the FMA latency on every k. Only one half-panel's two weight
// registers are live at a time, so the 12 accumulators stay in registers (every loop over the rows
// must be unrolled for that: one rolled loop and GCC keeps the arrays on the stack).
template <int Rows>
__attribute__((target("avx2,fma"))) void TileAvx2(const Operands& op, const float* x, const float* panel,
                                                   float* y, int64_t col) {
  const __m256 zero = _mm256_setzero_ps();
  __m256 even[3][2] = {{zero, zero}, {zero, zero}, {zero, zero}};
  __m256 odd[3][2] = {{zero, zero}, {zero, zero}, {zero, zero}};
  int64_t i = 0;
  for (; i + 1 < op.k; i += 2) {
    const float* w = panel + i * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchRows * kPanel), _MM_HINT_T0);
    __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
#pragma GCC unroll 3
    for (int r = 0; r < Rows; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * op.k + i);
      even[r][0] = _mm256_fmadd_ps(a, w0, even[r][0]);
      even[r][1] = _mm256_fmadd_ps(a, w1, even[r][1]);
    }
    w0 = _mm256_loadu_ps(w + kPanel);
    w1 = _mm256_loadu_ps(w + kPanel + 8);
#pragma GCC unroll 3
    for (int r = 0; r < Rows; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * op.k + i + 1);
      odd[r][0] = _mm256_fmadd_ps(a, w0, odd[r][0]);
      odd[r][1] = _mm256_fmadd_ps(a, w1, odd[r][1]);
    }
  }
  if (i < op.k) {  // odd K: the last k joins the even chain
    const __m256 w0 = _mm256_loadu_ps(panel + i * kPanel), w1 = _mm256_loadu_ps(panel + i * kPanel + 8);
#pragma GCC unroll 3
    for (int r = 0; r < Rows; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * op.k + i);
      even[r][0] = _mm256_fmadd_ps(a, w0, even[r][0]);
      even[r][1] = _mm256_fmadd_ps(a, w1, even[r][1]);
    }
  }
  const __m256 b0 = op.bias ? _mm256_loadu_ps(op.bias + col) : zero;
  const __m256 b1 = op.bias ? _mm256_loadu_ps(op.bias + col + 8) : zero;
#pragma GCC unroll 3
  for (int r = 0; r < Rows; ++r) {
    _mm256_storeu_ps(y + r * op.n + col, _mm256_add_ps(_mm256_add_ps(even[r][0], odd[r][0]), b0));
    _mm256_storeu_ps(y + r * op.n + col + 8, _mm256_add_ps(_mm256_add_ps(even[r][1], odd[r][1]), b1));
  }
}
#endif

// The same arithmetic without AVX2 (any x86-64 or another architecture): slow, but never wrong.
template <int Rows>
void TilePortable(const Operands& op, const float* x, const float* panel, float* y, int64_t col) {
  for (int r = 0; r < Rows; ++r) {
    const float* xr = x + r * op.k;
    float even[kPanel] = {}, odd[kPanel] = {};
    int64_t i = 0;
    for (; i + 1 < op.k; i += 2)
      for (int j = 0; j < kPanel; ++j) {
        even[j] += xr[i] * panel[i * kPanel + j];
        odd[j] += xr[i + 1] * panel[(i + 1) * kPanel + j];
      }
    if (i < op.k)
      for (int j = 0; j < kPanel; ++j) even[j] += xr[i] * panel[i * kPanel + j];
    for (int j = 0; j < kPanel; ++j) y[r * op.n + col + j] = even[j] + odd[j] + (op.bias ? op.bias[col + j] : 0.0f);
  }
}

template <int Rows>
void Tile(bool avx2, const Operands& op, int64_t row, int64_t col) {
  const float* x = op.x + row * op.k;
  const float* panel = op.panels + col * op.k;  // panel col/16 starts at (col/16) * K * 16
  float* y = op.y + row * op.n;
#if MTP_HAVE_X86
  if (avx2) return TileAvx2<Rows>(op, x, panel, y, col);
#endif
  TilePortable<Rows>(op, x, panel, y, col);
}

void Multiply(const Operands& op, int64_t m) {
#if MTP_HAVE_X86
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  constexpr bool avx2 = false;
#endif
  for (int64_t col = 0; col < op.n; col += kPanel) {
    int64_t row = 0;
    for (; row + kRowTile <= m; row += kRowTile) Tile<kRowTile>(avx2, op, row, col);
    if (m - row == 2) Tile<2>(avx2, op, row, col);
    if (m - row == 1) Tile<1>(avx2, op, row, col);
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
