// The paged attention of ops_ext/paged_attention.cc as a C++ function, for ops that attend inside a
// larger kernel (ops_ext/decoder_layer.cc) without a round trip through Python.
#pragma once
#include <cstdint>

#include "paddle/extension.h"

namespace mtp {

// The KV cache of one layer: S rows of KVH heads of D values, in blocks of block_size rows; the last
// block is the scratch block that table entries < 0 read. Values are float32, or IEEE float16 (`half`:
// half the bytes to read per key, which is what decode attention at long contexts waits on).
struct Cache {
  const void* k;  // float or uint16_t (float16 bits)
  const void* v;
  bool half;
  int64_t rows;      // S
  int64_t kv_heads;  // KVH
  int64_t dim;       // D
  int64_t block_size;
  int64_t scratch_block;
};

// This step's tokens of B requests, as mtp_paged_attention takes them (see paged_attention.cc).
struct AttentionBatch {
  const float* q;      // token t's query head h at q + t * q_stride + h * D
  int64_t q_stride;    // floats per token in q (H * D when q is [T, H, D])
  float* out;          // token t's head h at out + t * out_stride + h * D; rows that see no key are 0
  int64_t out_stride;  // floats per token in out
  int64_t tokens, heads;
  const int32_t* block_tables;  // [B, max_blocks]
  int64_t num_seqs, max_blocks;
  const int32_t* cu_seqlens_q;  // [B+1]
  const int32_t* seq_lens_kv;   // [B]
  const int64_t* positions;     // [T]
  // [B] or nullptr (0): request b's keys before key_starts[b] (a multiple of the block size) are hidden. An
  // MTP depth over a prompt's last positions only (mtp_proposer.py) never wrote the keys before them.
  const int32_t* key_starts;
};

// Attention of every token over its request's visible keys. Checks nothing: build the arguments with
// CheckedBatch and CheckedCache, which reject what would read outside a tensor.
void PagedAttend(const AttentionBatch& batch, const Cache& cache);

// The cache of one layer after checking the tensors: float32 or float16 CPU [S, KVH, D], K and V alike,
// whole blocks, the last the scratch block, and `heads` a multiple of KVH.
Cache CheckedCache(const paddle::Tensor& k_cache, const paddle::Tensor& v_cache, int64_t heads, int block_size);

// The batch after checking the tables against the cache and the token count.
AttentionBatch CheckedBatch(const float* q, int64_t q_stride, float* out, int64_t out_stride, int64_t tokens,
                            int64_t heads, const paddle::Tensor& k_cache, const paddle::Tensor& block_tables,
                            const paddle::Tensor& cu_seqlens_q, const paddle::Tensor& seq_lens_kv,
                            const paddle::Tensor& positions, int block_size,
                            const paddle::optional<paddle::Tensor>& key_starts = paddle::none);

// Stores n floats at element `offset` of a cache tensor's data, rounded to float16 (to nearest, ties to
// even, as NumPy and Paddle round) where the cache is float16.
void StoreRow(void* data, bool half, int64_t offset, const float* src, int64_t n);

// IEEE float16 <-> float32, exact one way and rounded to nearest even the other, on any host.
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);

}  // namespace mtp
