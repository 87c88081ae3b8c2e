// mtp_small_matmul: y[M, N] = x[M, K] @ W + bias on a CPU host, with W pre-packed as [N/32, K, 32]
// (column panels of 32, each a contiguous stream) in float32 or float16. Also mtp::PanelMatmul for other
// kernels.
//
// WHY: a batch-1 step with k drafts multiplies k+1 rows by every weight. Paddle's CPU matmul (MKL) packs
// the weight on every GEMM call, and runs on one thread in a rank: on a 2-core AMD EPYC host a
// [3, 256] x [256, 1536] product from a cold cache took ~200 us against ~70 us for one row. Here each
// weight byte comes from memory once per three rows, so a few rows cost little more than one and the
// verify pass of speculative decoding stops paying per draft for weight traffic; large products split
// their panels over the CPU kernels' workers (worker_pool.h), which beat MKL at every row count measured.
//
// Each output row is summed in the same order (bias, then k ascending, one chain per column) whatever
// M is, whichever tile it falls in and whichever thread computes its panel, so a row's result does not
// depend on how many rows share the call: greedy decoding with and without drafts computes the same
// logits for the same position.
//
// Python wrapper: mtpserve.model.small_matmul (it packs weights).
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define MTP_HAVE_X86 1
#endif

#include "paddle/extension.h"
#include "paged_attention.h"
#include "small_matmul.h"
#include "worker_pool.h"

namespace {

constexpr int kPanel = mtp::kPanelColumns;  // output columns per panel: four 8-float AVX registers
constexpr int kRowTile = 3;  // rows sharing each weight load: 12 accumulators + 1 input register
constexpr int kPrefetchRows = 16;  // panel rows (of 128 bytes) read ahead of the FMA loop
// Products of at least this many multiply-adds split their panels over the worker threads: below it,
// handing out the halves costs more than they save (a [1, 256] x [256, 128] product is 32k).
constexpr double kParallelWork = 32 * 1024;

struct Operands {
  const float* x;
  const void* panels;  // float, or uint16_t (float16 bits) when `half`
  bool half;
  const float* bias;  // nullptr: none
  float* y;
  int64_t k, n;
  int64_t first_col = 0;  // the output column `panels` starts at
};

#if MTP_HAVE_X86
// Eight weights of a panel row as floats: float16 panels are widened by F16C as they are read, so a
// float16 weight costs half the memory traffic and the same FMAs.
__attribute__((target("avx2,fma,f16c"))) inline __m256 Load8(const float* w) { return _mm256_loadu_ps(w); }
__attribute__((target("avx2,fma,f16c"))) inline __m256 Load8(const uint16_t* w) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
}

// Up to three rows against one 32-column panel: per k, four weight loads feed 4 * Rows FMAs into
// independent accumulators (12 chains at three rows, enough to hide the FMA latency). Every loop over
// rows or registers must be unrolled: one rolled loop and GCC keeps the accumulators on the stack.
template <int Rows, typename W>
__attribute__((target("avx2,fma,f16c"))) void TileAvx2(const Operands& op, const float* x, const W* panel,
                                                        float* y, int64_t col) {
  // NOTE: 128 bytes of float32 panel rows, 64 of float16 ones: read ahead the same distance in bytes
  constexpr int64_t kAhead = kPrefetchRows * kPanel * static_cast<int64_t>(sizeof(float) / sizeof(W));
  __m256 acc[Rows][4];
#pragma GCC unroll 3
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j)
      acc[r][j] = op.bias ? _mm256_loadu_ps(op.bias + col + 8 * j) : _mm256_setzero_ps();
  for (int64_t i = 0; i < op.k; ++i) {
    const W* w = panel + i * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(w + kAhead), _MM_HINT_T0);
    if (sizeof(W) == sizeof(float)) _mm_prefetch(reinterpret_cast<const char*>(w + kAhead + 16), _MM_HINT_T0);
    __m256 wv[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) wv[j] = Load8(w + 8 * j);
#pragma GCC unroll 3
    for (int r = 0; r < Rows; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * op.k + i);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_fmadd_ps(a, wv[j], acc[r][j]);
    }
  }
#pragma GCC unroll 3
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(y + r * op.n + col + 8 * j, acc[r][j]);
}
#endif

inline float Widen(float w) { return w; }
inline float Widen(uint16_t w) { return mtp::HalfToFloat(w); }

#if MTP_HAVE_X86
__attribute__((target("avx2,fma,f16c"))) void WidenF16C(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, Load8(src + i));
  for (; i < n; ++i) dst[i] = mtp::HalfToFloat(src[i]);
}
#endif

// n float16 values as floats (exact either way).
void Widen(bool avx2, const uint16_t* src, float* dst, int64_t n) {
#if MTP_HAVE_X86
  if (avx2) return WidenF16C(src, dst, n);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = mtp::HalfToFloat(src[i]);
}

// The same arithmetic without AVX2 (any x86-64 or another architecture): slow, but never wrong.
template <int Rows, typename W>
void TilePortable(const Operands& op, const float* x, const W* panel, float* y, int64_t col) {
  for (int r = 0; r < Rows; ++r) {
    float acc[kPanel];
    for (int j = 0; j < kPanel; ++j) acc[j] = op.bias ? op.bias[col + j] : 0.0f;
    for (int64_t i = 0; i < op.k; ++i)
      for (int j = 0; j < kPanel; ++j) acc[j] += x[r * op.k + i] * Widen(panel[i * kPanel + j]);
    std::memcpy(y + r * op.n + col, acc, sizeof(acc));
  }
}

template <int Rows, typename W>
void Tile(bool avx2, const Operands& op, int64_t row, int64_t col) {
  const float* x = op.x + row * op.k;
  // NOTE: panel col/32 starts at (col/32) * K * 32 (counted from the first panel the operands hold)
  const W* panel = static_cast<const W*>(op.panels) + (col - op.first_col) * op.k;
  float* y = op.y + row * op.n;
#if MTP_HAVE_X86
  if (avx2) return TileAvx2<Rows>(op, x, panel, y, col);
#endif
  TilePortable<Rows>(op, x, panel, y, col);
}

// Panels [first, last) of the product.
template <typename W>
void MultiplyPanels(bool avx2, const Operands& op, int64_t m, int64_t first, int64_t last) {
  for (int64_t col = first * kPanel; col < last * kPanel; col += kPanel) {
    int64_t row = 0;
    for (; row + kRowTile <= m; row += kRowTile) Tile<kRowTile, W>(avx2, op, row, col);
    if (m - row == 2) Tile<2, W>(avx2, op, row, col);
    if (m - row == 1) Tile<1, W>(avx2, op, row, col);
  }
}

// Float16 panels for more rows than one tile: each panel is widened once into a float32 copy (exact, so
// the sums are the ones the float16 tiles would make) that every tile then reads from L2; widening it
// in every tile would add a conversion per weight load to a loop that is then compute-bound.
void MultiplyWidened(bool avx2, const Operands& op, int64_t m, int64_t first, int64_t last) {
  thread_local std::vector<float> panel;
  panel.resize(static_cast<size_t>(op.k * kPanel));
  Operands wide = op;
  wide.half = false;
  const auto* halves = static_cast<const uint16_t*>(op.panels);
  for (int64_t p = first; p < last; ++p) {
    Widen(avx2, halves + p * op.k * kPanel, panel.data(), op.k * kPanel);
    wide.panels = panel.data();
    wide.first_col = p * kPanel;
    MultiplyPanels<float>(avx2, wide, m, p, p + 1);
  }
}

void Multiply(const Operands& op, int64_t m, int64_t first, int64_t last) {
#if MTP_HAVE_X86
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
#else
  constexpr bool avx2 = false;
#endif
  if (op.half && m > kRowTile) return MultiplyWidened(avx2, op, m, first, last);
  if (op.half) return MultiplyPanels<uint16_t>(avx2, op, m, first, last);
  MultiplyPanels<float>(avx2, op, m, first, last);
}

}  // namespace

void mtp::PanelMatmul(const float* x, int64_t m, int64_t k, const void* panels, bool half, int64_t n,
                      const float* bias, float* y) {
  const Operands op{x, panels, half, bias, y, k, n};
  const int64_t num_panels = n / kPanel;
  const int64_t parts = std::min<int64_t>(num_panels, mtp::CpuThreads());
  if (parts < 2 || static_cast<double>(m) * k * n < kParallelWork) return Multiply(op, m, 0, num_panels);
  // NOTE: whole panels per item, each computed as it would be alone: results do not depend on the split
  mtp::ParallelFor(parts, [&](int64_t part) {
    Multiply(op, m, num_panels * part / parts, num_panels * (part + 1) / parts);
  });
}

namespace {

std::vector<paddle::Tensor> SmallMatmul(const paddle::Tensor& x, const paddle::Tensor& panels,
                                        const paddle::optional<paddle::Tensor>& bias) {
  PD_CHECK(x.is_cpu() && panels.is_cpu(), "mtp_small_matmul runs on CPU tensors");
  const bool half = panels.dtype() == paddle::DataType::FLOAT16;
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32 && (half || panels.dtype() == paddle::DataType::FLOAT32),
           "mtp_small_matmul takes float32 x and float32 or float16 panels");
  const auto& xs = x.shape();
  const auto& ps = panels.shape();
  PD_CHECK(xs.size() == 2 && ps.size() == 3 && ps[2] == kPanel, "x must be [M, K], panels [N/32, K, 32]");
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
  mtp::PanelMatmul(xc.data<float>(), xs[0], xs[1], pc.data(), half, n, b, y.data<float>());
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
