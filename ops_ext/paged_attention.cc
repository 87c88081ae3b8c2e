// mtp_paged_attention: grouped-query attention of each request's new tokens over its KV cache, read in
// place through the block table, on CPU hosts. One op for decode rows, verify windows and prefill chunks.
//
// WHY: the Paddle-op version gathers every request's keys and values into padded [B, K, KVH, D] copies
// and adds a [B, Q, K] mask, per layer; at 600 tokens of context that was three quarters of a rank's
// time. Here each key and value row is read once from the cache per (request, KV head), and a query
// only looks at the keys it may see.
//
// Inputs (T new tokens of B requests, the cache holds S rows of KVH heads of D floats):
//   q            [T, H, D] float32
//   k_cache      [S, KVH, D] float32 or float16, v_cache the same
//   block_tables [B, M] int32: cache blocks of each request; an entry < 0 reads the scratch block
//   cu_seqlens_q [B+1] int32: request b owns tokens cu[b] .. cu[b+1]-1
//   seq_lens_kv  [B] int32: keys 0 .. seq_lens_kv[b]-1 hold KV (this step's tokens included)
//   positions    [T] int64: a token at position p sees keys 0 .. p (and only those with KV)
//   key_starts   [B] int32, optional: request b's keys before key_starts[b] are not seen (a multiple of
//                block_size; an MTP depth run over a prompt's last positions only wrote none before them)
// Output: [T, H, D] float32; query head h reads KV head h / (H / KVH). Rows that see no key are 0.
//
// Python wrapper: mtpserve.model.attention_context.PagedContext (CPU hosts).
//
// Speed: the (request, KV head) groups are independent; a large call spreads them over a small pool of
// worker threads (one per extra CPU), each group whole on one thread, so results do not depend on the
// thread count. Keys go in blocks of 8 whose dot products one query row finishes together with a tree
// of vector adds, and values are summed a block at a time into the row's output; compiled for AVX2
// and for the baseline and picked when first called (attend_group.inc).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <limits>
#include <vector>

#include "paddle/extension.h"
#include "paged_attention.h"
#include "vector_math.h"
#include "worker_pool.h"

namespace {

using mtp::Cache;

// Below this many multiply-adds a call runs on the calling thread: waking a worker costs more.
constexpr double kParallelWork = 1 << 20;

// The cache row of each of a request's first `n` keys, block by block (no division per key).
void KeyRows(const int32_t* table, int64_t n, const Cache& c, std::vector<int64_t>& rows) {
  rows.resize(static_cast<size_t>(n));
  for (int64_t j = 0, entry = 0; j < n; ++entry) {
    const int64_t block = table[entry] < 0 ? c.scratch_block : table[entry];
    for (int64_t o = 0; o < c.block_size && j < n; ++o, ++j) rows[j] = (block * c.block_size + o) * c.kv_heads;
  }
}

}  // namespace

// NOTE: attend_group.inc says why it is compiled twice.
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define MTP_ATTEND_F16C 1
namespace attend_avx2 {
#include "attend_group.inc"
}  // namespace attend_avx2
#undef MTP_ATTEND_F16C
#pragma GCC pop_options
#endif
#define MTP_ATTEND_F16C 0
namespace attend_baseline {
#include "attend_group.inc"
}  // namespace attend_baseline
#undef MTP_ATTEND_F16C

namespace {

template <typename T>
using AttendGroupFn = decltype(&attend_baseline::AttendGroup<T>);

bool HasAvx2() {
#if defined(__x86_64__) && defined(__GNUC__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

template <typename T>
AttendGroupFn<T> PickAttendGroup() {
#if defined(__x86_64__) && defined(__GNUC__)
  if (HasAvx2()) return attend_avx2::AttendGroup<T>;
#endif
  return attend_baseline::AttendGroup<T>;
}

}  // namespace

float mtp::HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1fu) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf, nan
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);  // 112 = 127 - 15
  } else {
    const float sub = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // subnormal: m * 2^-24
    std::memcpy(&bits, &sub, sizeof bits);
    bits |= sign;
  }
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

uint16_t mtp::FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return sign | 0x7e00u;  // nan
  if (x >= 0x477ff000u) return sign | 0x7c00u;  // 65520 and above round to inf
  if (x < 0x38800000u) {  // below 2^-14: a subnormal half, m * 2^-24 with m rounded to even
    float scaled;
    std::memcpy(&scaled, &x, sizeof scaled);
    return sign | static_cast<uint16_t>(std::nearbyint(scaled * 16777216.0f));
  }
  // a normal half: rebias the exponent (127 - 15 = 112), round the mantissa's 13 dropped bits to even
  const uint32_t rounded = x + 0xfffu + ((x >> 13) & 1u);
  return sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13);
}

void mtp::StoreRow(void* data, bool half, int64_t offset, const float* src, int64_t n) {
  if (!half) {
    std::memcpy(static_cast<float*>(data) + offset, src, sizeof(float) * static_cast<size_t>(n));
    return;
  }
  uint16_t* dst = static_cast<uint16_t*>(data) + offset;
  for (int64_t i = 0; i < n; ++i) dst[i] = FloatToHalf(src[i]);
}

void mtp::PagedAttend(const AttentionBatch& a, const Cache& c) {
  const int64_t dim = c.dim, kv_heads = c.kv_heads, group = a.heads / kv_heads;
  for (int64_t t = 0; t < a.tokens; ++t) std::fill_n(a.out + t * a.out_stride, a.heads * dim, 0.0f);
  double work = 0;
  for (int64_t b = 0; b < a.num_seqs; ++b)
    work += static_cast<double>(a.cu_seqlens_q[b + 1] - a.cu_seqlens_q[b]) *
            std::min<int64_t>(a.seq_lens_kv[b], a.max_blocks * c.block_size);
  work *= 2.0 * a.heads * dim;
  auto attend = [&](int64_t item) {
    const int64_t b = item / kv_heads, kvh = item % kv_heads;
    const int64_t first = a.cu_seqlens_q[b], nq = a.cu_seqlens_q[b + 1] - first;
    if (nq == 0) return;
    const int64_t num_keys = std::max<int64_t>(0, std::min<int64_t>(a.seq_lens_kv[b], a.max_blocks * c.block_size));
    // NOTE: at most the last whole block's start, so that the table is never read past its keys
    const int64_t key_start =
        a.key_starts == nullptr ? 0 : std::min<int64_t>(a.key_starts[b], num_keys / c.block_size * c.block_size);
    static const AttendGroupFn<float> attend_f32 = PickAttendGroup<float>();
    static const AttendGroupFn<uint16_t> attend_f16 = PickAttendGroup<uint16_t>();
    (c.half ? attend_f16 : attend_f32)(a.q + first * a.q_stride, a.q_stride, a.out + first * a.out_stride,
                                       a.out_stride, a.positions + first, nq, group, kvh,
                                       a.block_tables + b * a.max_blocks, num_keys, key_start, c);
  };
  const int64_t items = a.num_seqs * kv_heads;
  if (work < kParallelWork) {
    for (int64_t item = 0; item < items; ++item) attend(item);
  } else {
    mtp::ParallelFor(items, attend);
  }
}

mtp::Cache mtp::CheckedCache(const paddle::Tensor& k_cache, const paddle::Tensor& v_cache, int64_t heads,
                             int block_size) {
  PD_CHECK(k_cache.is_cpu() && v_cache.is_cpu(), "the KV cache must be on the CPU");
  const bool half = k_cache.dtype() == paddle::DataType::FLOAT16;
  PD_CHECK((half || k_cache.dtype() == paddle::DataType::FLOAT32) && v_cache.dtype() == k_cache.dtype(),
           "the KV cache must be float32 or float16, K and V alike");
  PD_CHECK(k_cache.shape().size() == 3 && v_cache.shape() == k_cache.shape(), "caches must be [S, KVH, D], K and V alike");
  PD_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t kv_heads = k_cache.shape()[1];
  PD_CHECK(kv_heads > 0 && heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  PD_CHECK(block_size > 0 && k_cache.shape()[0] % block_size == 0 && k_cache.shape()[0] >= block_size,
           "the cache must hold whole blocks, the last one the scratch block");
  return {k_cache.data(), v_cache.data(), half, k_cache.shape()[0], kv_heads, k_cache.shape()[2], block_size,
          k_cache.shape()[0] / block_size - 1};
}

mtp::AttentionBatch mtp::CheckedBatch(const float* q, int64_t q_stride, float* out, int64_t out_stride,
                                      int64_t tokens, int64_t heads, const paddle::Tensor& k_cache,
                                      const paddle::Tensor& block_tables, const paddle::Tensor& cu_seqlens_q,
                                      const paddle::Tensor& seq_lens_kv, const paddle::Tensor& positions,
                                      int block_size, const paddle::optional<paddle::Tensor>& key_starts) {
  PD_CHECK(block_tables.dtype() == paddle::DataType::INT32 && cu_seqlens_q.dtype() == paddle::DataType::INT32 &&
               seq_lens_kv.dtype() == paddle::DataType::INT32, "tables and lengths are int32");
  PD_CHECK(positions.dtype() == paddle::DataType::INT64, "positions are int64");
  PD_CHECK(block_tables.shape().size() == 2, "block_tables must be [B, M]");
  const int64_t num_seqs = block_tables.shape()[0], max_blocks = block_tables.shape()[1];
  PD_CHECK(cu_seqlens_q.numel() == num_seqs + 1 && seq_lens_kv.numel() == num_seqs, "one entry per request");
  PD_CHECK(positions.numel() == tokens, "one position per token");
  const int64_t scratch_block = k_cache.shape()[0] / block_size - 1;
  const int32_t* tables = block_tables.data<int32_t>();
  for (int64_t i = 0; i < block_tables.numel(); ++i)
    PD_CHECK(tables[i] <= scratch_block, "a block table entry is outside the cache");
  const int32_t* cu = cu_seqlens_q.data<int32_t>();
  for (int64_t b = 0; b < num_seqs; ++b)
    PD_CHECK(cu[b] >= 0 && cu[b] <= cu[b + 1] && cu[b + 1] <= tokens, "cu_seqlens_q out of range");
  const int32_t* starts = nullptr;
  if (key_starts) {
    PD_CHECK(key_starts->dtype() == paddle::DataType::INT32 && key_starts->numel() == num_seqs,
             "key_starts must be int32 [B]");
    starts = key_starts->data<int32_t>();
    for (int64_t b = 0; b < num_seqs; ++b)
      PD_CHECK(starts[b] >= 0 && starts[b] % block_size == 0, "a key start must be a block start");
  }
  return {q, q_stride, out, out_stride, tokens, heads, tables, num_seqs, max_blocks, cu,
          seq_lens_kv.data<int32_t>(), positions.data<int64_t>(), starts};
}

namespace {

std::vector<paddle::Tensor> PagedAttention(const paddle::Tensor& q, const paddle::Tensor& k_cache,
                                           const paddle::Tensor& v_cache, const paddle::Tensor& block_tables,
                                           const paddle::Tensor& cu_seqlens_q, const paddle::Tensor& seq_lens_kv,
                                           const paddle::Tensor& positions,
                                           const paddle::optional<paddle::Tensor>& key_starts, int block_size) {
  PD_CHECK(q.is_cpu() && q.dtype() == paddle::DataType::FLOAT32, "mtp_paged_attention takes float32 CPU tensors");
  PD_CHECK(q.shape().size() == 3, "q must be [T, H, D]");
  const int64_t tokens = q.shape()[0], heads = q.shape()[1], dim = q.shape()[2];
  const mtp::Cache cache = mtp::CheckedCache(k_cache, v_cache, heads, block_size);
  PD_CHECK(cache.dim == dim, "cache rows must be [KVH, D]");
  const paddle::Tensor qc = q.is_contiguous() ? q : q.contiguous();
  paddle::Tensor out = paddle::empty({tokens, heads, dim}, paddle::DataType::FLOAT32, q.place());
  mtp::PagedAttend(mtp::CheckedBatch(qc.data<float>(), heads * dim, out.data<float>(), heads * dim, tokens, heads,
                                     k_cache, block_tables, cu_seqlens_q, seq_lens_kv, positions, block_size,
                                     key_starts),
                   cache);
  return {out};
}

std::vector<std::vector<int64_t>> PagedAttentionShape(
    const std::vector<int64_t>& q, const std::vector<int64_t>& k_cache, const std::vector<int64_t>& v_cache,
    const std::vector<int64_t>& block_tables, const std::vector<int64_t>& cu_seqlens_q,
    const std::vector<int64_t>& seq_lens_kv, const std::vector<int64_t>& positions,
    const paddle::optional<std::vector<int64_t>>& key_starts, int block_size) {
  return {q};
}

std::vector<paddle::DataType> PagedAttentionDtype(
    const paddle::DataType& q, const paddle::DataType& k_cache, const paddle::DataType& v_cache,
    const paddle::DataType& block_tables, const paddle::DataType& cu_seqlens_q,
    const paddle::DataType& seq_lens_kv, const paddle::DataType& positions,
    const paddle::optional<paddle::DataType>& key_starts) {
  return {paddle::DataType::FLOAT32};
}

}  // namespace

PD_BUILD_OP(mtp_paged_attention)
    .Inputs({"q", "k_cache", "v_cache", "block_tables", "cu_seqlens_q", "seq_lens_kv", "positions",
             paddle::Optional("key_starts")})
    .Outputs({"out"})
    .Attrs({"block_size: int"})
    .SetKernelFn(PD_KERNEL(PagedAttention))
    .SetInferShapeFn(PD_INFER_SHAPE(PagedAttentionShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PagedAttentionDtype));
