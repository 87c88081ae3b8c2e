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
//   k_cache      [S, KVH, D] float32, v_cache the same
//   block_tables [B, M] int32: cache blocks of each request; an entry < 0 reads the scratch block
//   cu_seqlens_q [B+1] int32: request b owns tokens cu[b] .. cu[b+1]-1
//   seq_lens_kv  [B] int32: keys 0 .. seq_lens_kv[b]-1 hold KV (this step's tokens included)
//   positions    [T] int64: a token at position p sees keys 0 .. p (and only those with KV)
// Output: [T, H, D] float32; query head h reads KV head h / (H / KVH). Rows that see no key are 0.
//
// Python wrapper: mtpserve.model.attention_context.PagedContext (CPU hosts).
//
// Speed: the (request, KV head) groups are independent; a large call spreads them over a small pool of
// worker threads (one per extra CPU), each group whole on one thread, so results do not depend on the
// thread count. The dot products keep 16 partial sums, which the compiler turns into vector lanes
// (x86-64: AVX-512, AVX2 or SSE clones chosen at load time), since float sums are not reassociated
// without them.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>

#include "paddle/extension.h"
#include "paged_attention.h"

namespace {

using mtp::Cache;

// The cache row of key j of a request whose block table row is `table` (M entries).
inline int64_t KeyRow(const int32_t* table, int64_t j, const Cache& c) {
  int64_t block = table[j / c.block_size];
  if (block < 0) block = c.scratch_block;
  return block * c.block_size + j % c.block_size;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MTP_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MTP_VECTOR_CLONES
#endif

constexpr int kLanes = 16;

inline float Dot(const float* a, const float* b, int64_t d) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += a[i + l] * b[i + l];
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  for (; i < d; ++i) sum += a[i] * b[i];
  return sum;
}

// exp(x) for x <= 0 in plain arithmetic, so a loop of it vectorises (std::exp is a libm call per
// element): Cephes' expf, x = n ln2 + r with |r| <= ln2/2, a degree-6 polynomial for e^r, times 2^n
// built in the exponent bits; relative error about 1e-7. Below -87 it returns ~1e-38 instead of less.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Workers for the groups of one call; the calling thread works too. Threads sleep between calls.
class Pool {
 public:
  static Pool& Get() {
    // NOTE: never destroyed: its workers wait on its condition variable until the process ends
    static Pool* pool = new Pool(std::max(1u, std::thread::hardware_concurrency()) - 1);
    return *pool;
  }

  // fn(i) for i in [0, n), each on one thread, returning when all are done.
  void Run(int64_t n, const std::function<void(int64_t)>& fn) {
    if (workers_.empty() || n < 2) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    std::unique_lock<std::mutex> call(call_mu_);  // NOTE: one call at a time (one device thread anyway)
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = &fn;
      size_ = n;
      next_.store(0);
      pending_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    wake_.notify_all();
    Work(fn, n);
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return pending_ == 0; });
    job_ = nullptr;
  }

 private:
  explicit Pool(unsigned num_workers) {
    for (unsigned w = 0; w < num_workers; ++w) workers_.emplace_back([this] { Loop(); });
    for (auto& t : workers_) t.detach();  // NOTE: lives as long as the process
  }

  void Work(const std::function<void(int64_t)>& fn, int64_t n) {
    for (int64_t i = next_.fetch_add(1); i < n; i = next_.fetch_add(1)) fn(i);
  }

  void Loop() {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int64_t)>* job;
      int64_t n;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        job = job_;
        n = size_;
      }
      Work(*job, n);
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex call_mu_, mu_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t)>* job_ = nullptr;
  int64_t size_ = 0;
  std::atomic<int64_t> next_{0};
  int pending_ = 0;
  uint64_t generation_ = 0;
};

// Below this many multiply-adds a call runs on the calling thread: waking a worker costs more.
constexpr double kParallelWork = 1 << 20;

// One request and one KV head: the `group` query heads of its `nq` tokens.
MTP_VECTOR_CLONES
void AttendGroup(const float* q, int64_t q_stride, float* out, int64_t out_stride, const int64_t* positions,
                 int64_t nq, int64_t group, int64_t kvh, const int32_t* table, int64_t num_keys, const Cache& c,
                 std::vector<float>& scores) {
  const int64_t d = c.dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  int64_t max_seen = 0;
  for (int64_t t = 0; t < nq; ++t) max_seen = std::max(max_seen, std::min(num_keys, positions[t] + 1));
  const int64_t rows = nq * group;
  scores.assign(static_cast<size_t>(rows * max_seen), 0.0f);
  // 1. scores: each key row is read once and dotted with every query row that may see it
  for (int64_t j = 0; j < max_seen; ++j) {
    const float* kj = c.k + (KeyRow(table, j, c) * c.kv_heads + kvh) * d;
    for (int64_t t = 0; t < nq; ++t) {
      if (j > positions[t]) continue;
      for (int64_t g = 0; g < group; ++g) {
        const float* qr = q + t * q_stride + (kvh * group + g) * d;
        scores[(t * group + g) * max_seen + j] = Dot(qr, kj, d) * scale;
      }
    }
  }
  // 2. softmax per query row over its visible keys, 3. the weighted sum of value rows
  std::vector<float> acc(static_cast<size_t>(rows * d), 0.0f);
  std::vector<int64_t> seen(static_cast<size_t>(nq));
  for (int64_t t = 0; t < nq; ++t) seen[t] = std::min(num_keys, positions[t] + 1);
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores.data() + r * max_seen;
    const int64_t n = seen[r / group];
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) m = std::max(m, s[j]);
    for (int64_t j = 0; j < n; ++j) s[j] = ExpNonPositive(s[j] - m);
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) sum += s[j];
    const float inv = n > 0 ? 1.0f / sum : 0.0f;
    for (int64_t j = 0; j < n; ++j) s[j] *= inv;
  }
  for (int64_t j = 0; j < max_seen; ++j) {
    const float* vj = c.v + (KeyRow(table, j, c) * c.kv_heads + kvh) * d;
    for (int64_t r = 0; r < rows; ++r) {
      if (j >= seen[r / group]) continue;
      const float w = scores[r * max_seen + j];
      float* a = acc.data() + r * d;
      for (int64_t i = 0; i < d; ++i) a[i] += w * vj[i];
    }
  }
  for (int64_t t = 0; t < nq; ++t)
    for (int64_t g = 0; g < group; ++g)
      std::copy_n(acc.data() + (t * group + g) * d, d, out + t * out_stride + (kvh * group + g) * d);
}

}  // namespace

void mtp::PagedAttend(const AttentionBatch& a, const Cache& c) {
  const int64_t dim = c.dim, kv_heads = c.kv_heads, group = a.heads / kv_heads;
  for (int64_t t = 0; t < a.tokens; ++t) std::fill_n(a.out + t * a.out_stride, a.heads * dim, 0.0f);
  double work = 0;
  for (int64_t b = 0; b < a.num_seqs; ++b)
    work += static_cast<double>(a.cu_seqlens_q[b + 1] - a.cu_seqlens_q[b]) *
            std::min<int64_t>(a.seq_lens_kv[b], a.max_blocks * c.block_size);
  work *= 2.0 * a.heads * dim;
  auto attend = [&](int64_t item) {
    thread_local std::vector<float> scores;
    const int64_t b = item / kv_heads, kvh = item % kv_heads;
    const int64_t first = a.cu_seqlens_q[b], nq = a.cu_seqlens_q[b + 1] - first;
    if (nq == 0) return;
    const int64_t num_keys = std::max<int64_t>(0, std::min<int64_t>(a.seq_lens_kv[b], a.max_blocks * c.block_size));
    AttendGroup(a.q + first * a.q_stride, a.q_stride, a.out + first * a.out_stride, a.out_stride,
                a.positions + first, nq, group, kvh, a.block_tables + b * a.max_blocks, num_keys, c, scores);
  };
  const int64_t items = a.num_seqs * kv_heads;
  if (work < kParallelWork) {
    for (int64_t item = 0; item < items; ++item) attend(item);
  } else {
    Pool::Get().Run(items, attend);
  }
}

mtp::Cache mtp::CheckedCache(const paddle::Tensor& k_cache, const paddle::Tensor& v_cache, int64_t heads,
                             int block_size) {
  PD_CHECK(k_cache.is_cpu() && v_cache.is_cpu(), "the KV cache must be on the CPU");
  PD_CHECK(k_cache.dtype() == paddle::DataType::FLOAT32 && v_cache.dtype() == paddle::DataType::FLOAT32,
           "the KV cache must be float32");
  PD_CHECK(k_cache.shape().size() == 3 && v_cache.shape() == k_cache.shape(), "caches must be [S, KVH, D], K and V alike");
  PD_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t kv_heads = k_cache.shape()[1];
  PD_CHECK(kv_heads > 0 && heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  PD_CHECK(block_size > 0 && k_cache.shape()[0] % block_size == 0 && k_cache.shape()[0] >= block_size,
           "the cache must hold whole blocks, the last one the scratch block");
  return {k_cache.data<float>(), v_cache.data<float>(), k_cache.shape()[0], kv_heads, k_cache.shape()[2],
          block_size, k_cache.shape()[0] / block_size - 1};
}

mtp::AttentionBatch mtp::CheckedBatch(const float* q, int64_t q_stride, float* out, int64_t out_stride,
                                      int64_t tokens, int64_t heads, const paddle::Tensor& k_cache,
                                      const paddle::Tensor& block_tables, const paddle::Tensor& cu_seqlens_q,
                                      const paddle::Tensor& seq_lens_kv, const paddle::Tensor& positions,
                                      int block_size) {
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
  return {q, q_stride, out, out_stride, tokens, heads, tables, num_seqs, max_blocks, cu,
          seq_lens_kv.data<int32_t>(), positions.data<int64_t>()};
}

namespace {

std::vector<paddle::Tensor> PagedAttention(const paddle::Tensor& q, const paddle::Tensor& k_cache,
                                           const paddle::Tensor& v_cache, const paddle::Tensor& block_tables,
                                           const paddle::Tensor& cu_seqlens_q, const paddle::Tensor& seq_lens_kv,
                                           const paddle::Tensor& positions, int block_size) {
  PD_CHECK(q.is_cpu() && q.dtype() == paddle::DataType::FLOAT32, "mtp_paged_attention takes float32 CPU tensors");
  PD_CHECK(q.shape().size() == 3, "q must be [T, H, D]");
  const int64_t tokens = q.shape()[0], heads = q.shape()[1], dim = q.shape()[2];
  const mtp::Cache cache = mtp::CheckedCache(k_cache, v_cache, heads, block_size);
  PD_CHECK(cache.dim == dim, "cache rows must be [KVH, D]");
  const paddle::Tensor qc = q.is_contiguous() ? q : q.contiguous();
  paddle::Tensor out = paddle::empty({tokens, heads, dim}, paddle::DataType::FLOAT32, q.place());
  mtp::PagedAttend(mtp::CheckedBatch(qc.data<float>(), heads * dim, out.data<float>(), heads * dim, tokens, heads,
                                     k_cache, block_tables, cu_seqlens_q, seq_lens_kv, positions, block_size),
                   cache);
  return {out};
}

std::vector<std::vector<int64_t>> PagedAttentionShape(
    const std::vector<int64_t>& q, const std::vector<int64_t>& k_cache, const std::vector<int64_t>& v_cache,
    const std::vector<int64_t>& block_tables, const std::vector<int64_t>& cu_seqlens_q,
    const std::vector<int64_t>& seq_lens_kv, const std::vector<int64_t>& positions, int block_size) {
  return {q};
}

std::vector<paddle::DataType> PagedAttentionDtype(
    const paddle::DataType& q, const paddle::DataType& k_cache, const paddle::DataType& v_cache,
    const paddle::DataType& block_tables, const paddle::DataType& cu_seqlens_q,
    const paddle::DataType& seq_lens_kv, const paddle::DataType& positions) {
  return {paddle::DataType::FLOAT32};
}

}  // namespace

PD_BUILD_OP(mtp_paged_attention)
    .Inputs({"q", "k_cache", "v_cache", "block_tables", "cu_seqlens_q", "seq_lens_kv", "positions"})
    .Outputs({"out"})
    .Attrs({"block_size: int"})
    .SetKernelFn(PD_KERNEL(PagedAttention))
    .SetInferShapeFn(PD_INFER_SHAPE(PagedAttentionShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PagedAttentionDtype));
