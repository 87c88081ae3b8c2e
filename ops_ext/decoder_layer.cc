// mtp_decoder_layer: one dense pre-norm decoder block (Qwen2/MiMo: RMSNorm, q/k/v with bias, rotary
// "rotate half", grouped-query attention over the paged KV cache, o_proj, RMSNorm, SwiGLU MLP, two
// residuals) as one op on CPU hosts. It writes this step's K/V into the cache in place.
//
// WHY: written as Paddle ops a block is ~25 calls from Python (norms, matmuls, splits, reshapes, RoPE,
// the scatter of K/V, attention, adds). On the bundled model a k=0 step ran at 1.5 ms, of which the
// arithmetic is a fraction: the rest was dispatching those calls. One call per block leaves the
// arithmetic, the way CUDA graphs leave it on GPU hosts.
//
// Inputs (T tokens; H hidden; heads query heads and KVH KV heads of D floats; I intermediate):
//   x               [T, H] the residual stream
//   input_norm      [H]; post_norm [H]
//   qkv_panels      [(heads + 2 KVH) D / 32, H, 32]: q, k, v projections packed as mtp_small_matmul panels
//   qkv_bias        [(heads + 2 KVH) D] or absent
//   o_panels        [H / 32, heads D, 32]
//   gate_up_panels  [2 I / 32, H, 32]: gate then up
//   down_panels     [H / 32, I, 32]
//                   (every panel tensor float32, or float16: an MTP layer's may be, see model/small_matmul.py)
//   cos_table       [P, D] cos(p f) for every position p; sin_table [P, D] the sine with rotate-half's sign
//   positions       [T] int64; write_slots [T] int64: the cache row of each token's K/V (-1: not written)
//   k_cache, v_cache [S, KVH, D] float32 or float16: written in place (outputs k_out, v_out), rounded to
//                   the cache's dtype
//   block_tables, cu_seqlens_q, seq_lens_kv: as mtp_paged_attention takes them
//   out_rows        [N] int64 (increasing) or absent: only these tokens' outputs are wanted (their queries alone
//                   attend, and o_proj and the MLP run on them alone; every token's K/V is written)
//   An MTP layer's block also takes its input stage, so that a draft depth is one call too:
//   token_ids       [T] int64: x is then the previous depth's hidden, and the block's input is
//                   norm(x; hidden_norm) @ hidden_panels + token_table[token_ids] (the token half of
//                   input_proj, tabulated; zero at position 0 when zero_position_zero)
//   final_norm      [H] or absent: also return the output normalised by it
//   A head, so that the logits and the greedy tokens of a model's last block or of a draft depth need no
//   further call (it needs final_norm):
//   head_panels     [V'/32, H, 32] or absent: a head over V' tokens (the LM head, or a draft vocabulary's)
//   head_ids        [V'] int64 or absent: the vocabulary id of each head column (absent: the column)
//   head_rows       [M] int64 or absent: the output rows the head reads (absent: every output row)
//   key_starts      [B] int32 or absent: as mtp_paged_attention takes it (an MTP depth's keys from there on)
// Outputs: [T or N, H], the block's output (residual stream after the MLP); [T or N, H] its final norm
// ([0, H] without final_norm); [M] int64 the head's argmax ids ([0] without head_panels), the first
// column of the largest logit on ties, as paddle.argmax picks; [M, V'] the head's logits ([0, 0]
// without head_panels).
//
// Every row is computed the same way whatever rows share the call (the panel product and the attention
// both keep that property), so a token's logits do not depend on its batch.
//
// Python wrapper: mtpserve.model.fused_layer.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "paddle/extension.h"
#include "paged_attention.h"
#include "rms_norm.h"
#include "small_matmul.h"
#include "vector_math.h"

namespace {

using OptTensor = paddle::optional<paddle::Tensor>;

struct Panels {
  const void* data;  // float, or float16 bits when `half`
  bool half;
  int64_t k, n;  // the packed weight is [K, N]
};

Panels CheckedPanels(const paddle::Tensor& t, int64_t k, const char* name) {
  const bool half = t.dtype() == paddle::DataType::FLOAT16;
  PD_CHECK(t.is_cpu() && (half || t.dtype() == paddle::DataType::FLOAT32) && t.is_contiguous(), name,
           " must be a contiguous float32 or float16 CPU tensor");
  PD_CHECK(t.shape().size() == 3 && t.shape()[1] == k && t.shape()[2] == mtp::kPanelColumns, name,
           " must be [N/32, ", k, ", 32]");
  return {t.data(), half, k, t.shape()[0] * mtp::kPanelColumns};
}

const float* CheckedVector(const paddle::Tensor& t, int64_t n, const char* name) {
  PD_CHECK(t.is_cpu() && t.dtype() == paddle::DataType::FLOAT32 && t.is_contiguous() && t.numel() == n, name,
           " must be a contiguous float32 CPU tensor of ", n, " values");
  return t.data<float>();
}

void Multiply(const float* x, int64_t m, const Panels& w, const float* bias, float* y) {
  mtp::PanelMatmul(x, m, w.k, w.data, w.half, w.n, bias, y);
}

// x * cos + rotate_half(x) * sin for `count` heads of D floats at one position, in place; the sign of
// rotate_half is in `sin` (its first half is -sin), so rotate_half becomes a swap of the halves.
MTP_VECTOR_CLONES
void Rotate(float* x, int64_t count, int64_t d, const float* cos, const float* sin) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < count; ++h) {
    float* lo = x + h * d;
    float* hi = lo + half;
    for (int64_t i = 0; i < half; ++i) {
      const float a = lo[i], b = hi[i];
      lo[i] = a * cos[i] + b * sin[i];
      hi[i] = b * cos[half + i] + a * sin[half + i];
    }
  }
}

// out[r] = silu(gate[r]) * up[r] for rows of [gate | up] (2I floats) into rows of I floats.
MTP_VECTOR_CLONES
void SwiGlu(const float* gate_up, float* out, int64_t rows, int64_t inter) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * 2 * inter;
    float* o = out + r * inter;
    for (int64_t j = 0; j < inter; ++j) o[j] = mtp::Silu(g[j]) * g[inter + j];
  }
}

MTP_VECTOR_CLONES
void AddInto(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] + y[i];
}

struct Shapes {
  int64_t tokens, hidden, heads, kv_heads, dim, inter, qkv_width;
};

// The head's (argmax ids [M], logits [M, V']) at rows `head_rows` of `normed` [R, H] (all R rows without
// it); ([0], [0, 0]) without a head.
std::vector<paddle::Tensor> Head(const paddle::Tensor& normed, const OptTensor& head_panels, const OptTensor& head_ids,
                                 const OptTensor& head_rows, bool has_final_norm) {
  if (!head_panels)
    return {paddle::empty({0}, paddle::DataType::INT64, normed.place()),
            paddle::empty({0, 0}, paddle::DataType::FLOAT32, normed.place())};
  PD_CHECK(has_final_norm, "a head reads the final norm: it needs final_norm");
  const int64_t rows = normed.shape()[0], hidden = normed.shape()[1];
  const Panels head = CheckedPanels(*head_panels, hidden, "head_panels");
  const int64_t* ids = nullptr;
  if (head_ids) {
    PD_CHECK(head_ids->dtype() == paddle::DataType::INT64 && head_ids->numel() == head.n,
             "head_ids must be int64 [V'], one id per head column");
    ids = head_ids->data<int64_t>();
  }
  int64_t m = rows;
  const int64_t* pick = nullptr;
  if (head_rows) {
    PD_CHECK(head_rows->dtype() == paddle::DataType::INT64, "head_rows must be int64");
    m = head_rows->numel();
    pick = head_rows->data<int64_t>();
    for (int64_t r = 0; r < m; ++r) PD_CHECK(pick[r] >= 0 && pick[r] < rows, "a head row is outside the output");
  }
  thread_local std::vector<float> in;
  in.resize(static_cast<size_t>(m * hidden));
  const float* nd = normed.data<float>();
  for (int64_t r = 0; r < m; ++r)
    std::memcpy(in.data() + r * hidden, nd + (pick ? pick[r] : r) * hidden, sizeof(float) * hidden);
  paddle::Tensor logits = paddle::empty({m, head.n}, paddle::DataType::FLOAT32, normed.place());
  float* ld = logits.data<float>();
  Multiply(in.data(), m, head, nullptr, ld);
  paddle::Tensor out = paddle::empty({m}, paddle::DataType::INT64, normed.place());
  int64_t* od = out.data<int64_t>();
  for (int64_t r = 0; r < m; ++r) {
    const float* row = ld + r * head.n;
    int64_t best = 0;
    for (int64_t j = 1; j < head.n; ++j)
      if (row[j] > row[best]) best = j;  // NOTE: strictly greater: the first of equal maxima wins
    od[r] = ids ? ids[best] : best;
  }
  return {out, logits};
}

// The attention batch of the kept tokens `keep` [rows] (increasing) alone: their queries moved down to the first
// rows of `qkv` (its other rows' K/V are in the cache already), their positions, and each request's share of
// them; the keys are the batch's.
mtp::AttentionBatch KeptQueries(const mtp::AttentionBatch& batch, const int64_t* keep, int64_t rows,
                                int64_t qkv_width, std::vector<int32_t>& cu, std::vector<int64_t>& positions,
                                std::vector<float>& qkv) {
  cu.assign(static_cast<size_t>(batch.num_seqs + 1), 0);
  positions.resize(static_cast<size_t>(rows));
  int64_t b = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = keep[r];
    while (b < batch.num_seqs && t >= batch.cu_seqlens_q[b + 1]) cu[static_cast<size_t>(++b)] = static_cast<int32_t>(r);
    positions[static_cast<size_t>(r)] = batch.positions[t];
    if (t != r) std::memmove(qkv.data() + r * qkv_width, qkv.data() + t * qkv_width, sizeof(float) * qkv_width);
  }
  while (b < batch.num_seqs) cu[static_cast<size_t>(++b)] = static_cast<int32_t>(rows);
  mtp::AttentionBatch kept = batch;
  kept.tokens = rows;
  kept.cu_seqlens_q = cu.data();
  kept.positions = positions.data();
  return kept;
}

std::vector<paddle::Tensor> DecoderLayer(
    const paddle::Tensor& x, const paddle::Tensor& input_norm, const paddle::Tensor& qkv_panels,
    const OptTensor& qkv_bias, const paddle::Tensor& o_panels, const paddle::Tensor& post_norm,
    const paddle::Tensor& gate_up_panels, const paddle::Tensor& down_panels, const paddle::Tensor& cos_table,
    const paddle::Tensor& sin_table, const paddle::Tensor& positions, const paddle::Tensor& write_slots,
    paddle::Tensor& k_cache, paddle::Tensor& v_cache, const paddle::Tensor& block_tables,
    const paddle::Tensor& cu_seqlens_q, const paddle::Tensor& seq_lens_kv, const OptTensor& out_rows,
    const OptTensor& token_ids, const OptTensor& token_table, const OptTensor& hidden_norm,
    const OptTensor& hidden_panels, const OptTensor& final_norm, const OptTensor& head_panels,
    const OptTensor& head_ids, const OptTensor& head_rows, const OptTensor& key_starts, int heads, float eps,
    int block_size, bool zero_position_zero) {
  PD_CHECK(x.is_cpu() && x.dtype() == paddle::DataType::FLOAT32 && x.shape().size() == 2,
           "x must be a float32 CPU tensor [T, H]");
  const mtp::Cache cache = mtp::CheckedCache(k_cache, v_cache, heads, block_size);
  Shapes s{x.shape()[0], x.shape()[1], heads, cache.kv_heads, cache.dim, 0, 0};
  s.qkv_width = (s.heads + 2 * s.kv_heads) * s.dim;
  PD_CHECK(s.dim % 2 == 0, "the head dimension must be even");
  const Panels qkv = CheckedPanels(qkv_panels, s.hidden, "qkv_panels");
  PD_CHECK(qkv.n == s.qkv_width, "qkv_panels must produce (heads + 2 KV heads) * D columns");
  const Panels o = CheckedPanels(o_panels, s.heads * s.dim, "o_panels");
  PD_CHECK(o.n == s.hidden, "o_panels must produce H columns");
  const Panels gate_up = CheckedPanels(gate_up_panels, s.hidden, "gate_up_panels");
  s.inter = gate_up.n / 2;
  const Panels down = CheckedPanels(down_panels, s.inter, "down_panels");
  PD_CHECK(down.n == s.hidden, "down_panels must produce H columns");
  const float* norm1 = CheckedVector(input_norm, s.hidden, "input_norm");
  const float* norm2 = CheckedVector(post_norm, s.hidden, "post_norm");
  const float* bias = qkv_bias ? CheckedVector(*qkv_bias, s.qkv_width, "qkv_bias") : nullptr;
  PD_CHECK(cos_table.shape().size() == 2 && cos_table.shape()[1] == s.dim && sin_table.shape() == cos_table.shape(),
           "the rotary tables must be [P, D]");
  const float* cos = CheckedVector(cos_table, cos_table.numel(), "cos_table");
  const float* sin = CheckedVector(sin_table, sin_table.numel(), "sin_table");
  const int64_t max_position = cos_table.shape()[0];
  PD_CHECK(write_slots.dtype() == paddle::DataType::INT64 && write_slots.numel() == s.tokens,
           "write_slots must be int64 [T]");
  const paddle::Tensor xc = x.is_contiguous() ? x : x.contiguous();
  const float* xd = xc.data<float>();  // NOTE: an MTP layer replaces it by its input (step 0)
  const int64_t* slots = write_slots.data<int64_t>();

  int64_t rows = s.tokens;
  const int64_t* keep = nullptr;
  if (out_rows) {
    PD_CHECK(out_rows->dtype() == paddle::DataType::INT64, "out_rows must be int64");
    keep = out_rows->data<int64_t>();
    rows = out_rows->numel();
    for (int64_t r = 0; r < rows; ++r) {
      PD_CHECK(keep[r] >= 0 && keep[r] < s.tokens, "out_rows holds a token outside the call");
      PD_CHECK(r == 0 || keep[r] > keep[r - 1], "out_rows must increase");  // NOTE: so copying down is safe
    }
  }
  for (int64_t t = 0; t < s.tokens; ++t) PD_CHECK(slots[t] < cache.rows, "a write slot is outside the cache");
  thread_local std::vector<float> normed, qkv_out, attn, gate_up_out, act;
  qkv_out.resize(static_cast<size_t>(s.tokens * s.qkv_width));
  attn.resize(static_cast<size_t>(s.tokens * s.heads * s.dim));
  const mtp::AttentionBatch batch = mtp::CheckedBatch(
      qkv_out.data(), s.qkv_width, attn.data(), s.heads * s.dim, s.tokens, s.heads, k_cache, block_tables,
      cu_seqlens_q, seq_lens_kv, positions, block_size, key_starts);
  for (int64_t t = 0; t < s.tokens; ++t)
    PD_CHECK(batch.positions[t] >= 0 && batch.positions[t] < max_position, "position ", batch.positions[t],
             " is outside the rotary tables");
  paddle::Tensor out = paddle::empty({rows, s.hidden}, paddle::DataType::FLOAT32, x.place());
  float* od = out.data<float>();
  const float* final_w = final_norm ? CheckedVector(*final_norm, s.hidden, "final_norm") : nullptr;
  paddle::Tensor normed_out =
      paddle::empty({final_w != nullptr ? rows : 0, s.hidden}, paddle::DataType::FLOAT32, x.place());
  normed.resize(static_cast<size_t>(s.tokens * s.hidden));

  // 0. an MTP layer's input (x holds the previous depth's hidden):
  //    x = norm(x) @ W_hidden + table[token], the token half of input_proj tabulated (model/mtp_layer.py)
  thread_local std::vector<float> mtp_in;
  if (token_ids) {
    PD_CHECK(token_table && hidden_norm && hidden_panels, "an MTP input needs token_table, hidden_norm and hidden_panels");
    PD_CHECK(token_ids->dtype() == paddle::DataType::INT64 && token_ids->numel() == s.tokens,
             "token_ids must be int64 [T]");
    PD_CHECK(token_table->shape().size() == 2 && token_table->shape()[1] == s.hidden, "token_table must be [V, H]");
    const float* table = CheckedVector(*token_table, token_table->numel(), "token_table");
    const int64_t* ids = token_ids->data<int64_t>();
    for (int64_t t = 0; t < s.tokens; ++t)
      PD_CHECK(ids[t] >= 0 && ids[t] < token_table->shape()[0], "a token id is outside the token table");
    const Panels hidden_w = CheckedPanels(*hidden_panels, s.hidden, "hidden_panels");
    PD_CHECK(hidden_w.n == s.hidden, "hidden_panels must produce H columns");
    mtp_in.resize(static_cast<size_t>(s.tokens * s.hidden));
    mtp::RmsNormRows(xd, CheckedVector(*hidden_norm, s.hidden, "hidden_norm"), normed.data(), s.tokens, s.hidden, eps);
    Multiply(normed.data(), s.tokens, hidden_w, nullptr, mtp_in.data());
    for (int64_t t = 0; t < s.tokens; ++t) {
      if (zero_position_zero && batch.positions[t] == 0) continue;  // NOTE: the token half is zero there
      AddInto(mtp_in.data() + t * s.hidden, table + ids[t] * s.hidden, s.hidden);
    }
    xd = mtp_in.data();
  }

  // 1. q, k, v of every token, rotated
  mtp::RmsNormRows(xd, norm1, normed.data(), s.tokens, s.hidden, eps);
  Multiply(normed.data(), s.tokens, qkv, bias, qkv_out.data());
  const int64_t* pos = batch.positions;
  for (int64_t t = 0; t < s.tokens; ++t) {
    Rotate(qkv_out.data() + t * s.qkv_width, s.heads + s.kv_heads, s.dim, cos + pos[t] * s.dim,
           sin + pos[t] * s.dim);
  }
  // 2. this step's K/V into the cache, then attention over it
  const int64_t kv_row = s.kv_heads * s.dim;
  for (int64_t t = 0; t < s.tokens; ++t) {
    if (slots[t] < 0) continue;
    const float* kt = qkv_out.data() + t * s.qkv_width + s.heads * s.dim;
    mtp::StoreRow(k_cache.data(), cache.half, slots[t] * kv_row, kt, kv_row);
    mtp::StoreRow(v_cache.data(), cache.half, slots[t] * kv_row, kt + kv_row, kv_row);
  }
  //    NOTE: with out_rows only the wanted rows' queries attend: the others' outputs feed nothing but the
  //    rows dropped below (a prompt chunk's last block, or an MTP depth over a prompt, wants its frontier)
  thread_local std::vector<int32_t> kept_cu;
  thread_local std::vector<int64_t> kept_positions;
  const mtp::AttentionBatch attending = keep == nullptr ? batch : KeptQueries(batch, keep, rows, s.qkv_width,
                                                                               kept_cu, kept_positions, qkv_out);
  mtp::PagedAttend(attending, cache);

  // 3. the attention residual h = x + attn @ o of the wanted rows
  std::vector<float>& h = qkv_out;  // NOTE: q/k/v are spent; reuse the buffer for the residual stream
  h.resize(static_cast<size_t>(s.tokens * s.hidden));
  Multiply(attn.data(), rows, o, nullptr, h.data());
  if (keep == nullptr) {
    AddInto(h.data(), xd, s.tokens * s.hidden);
  } else {
    for (int64_t r = 0; r < rows; ++r) AddInto(h.data() + r * s.hidden, xd + keep[r] * s.hidden, s.hidden);
  }
  // 4. the MLP residual: out = h + (silu(h' @ gate) * (h' @ up)) @ down, h' = norm(h)
  mtp::RmsNormRows(h.data(), norm2, normed.data(), rows, s.hidden, eps);
  gate_up_out.resize(static_cast<size_t>(rows * 2 * s.inter));
  act.resize(static_cast<size_t>(rows * s.inter));
  Multiply(normed.data(), rows, gate_up, nullptr, gate_up_out.data());
  SwiGlu(gate_up_out.data(), act.data(), rows, s.inter);
  Multiply(act.data(), rows, down, nullptr, od);
  AddInto(od, h.data(), rows * s.hidden);
  if (final_w != nullptr) mtp::RmsNormRows(od, final_w, normed_out.data<float>(), rows, s.hidden, eps);
  // 5. a draft depth's head: the argmax over its columns of the wanted normalised rows
  std::vector<paddle::Tensor> head = Head(normed_out, head_panels, head_ids, head_rows, final_w != nullptr);
  return {out, normed_out, head[0], head[1]};
}

std::vector<std::vector<int64_t>> DecoderLayerShape(
    const std::vector<int64_t>& x, const std::vector<int64_t>& input_norm, const std::vector<int64_t>& qkv_panels,
    const paddle::optional<std::vector<int64_t>>& qkv_bias, const std::vector<int64_t>& o_panels,
    const std::vector<int64_t>& post_norm, const std::vector<int64_t>& gate_up_panels,
    const std::vector<int64_t>& down_panels, const std::vector<int64_t>& cos_table,
    const std::vector<int64_t>& sin_table, const std::vector<int64_t>& positions,
    const std::vector<int64_t>& write_slots, const std::vector<int64_t>& k_cache, const std::vector<int64_t>& v_cache,
    const std::vector<int64_t>& block_tables, const std::vector<int64_t>& cu_seqlens_q,
    const std::vector<int64_t>& seq_lens_kv, const paddle::optional<std::vector<int64_t>>& out_rows,
    const paddle::optional<std::vector<int64_t>>& token_ids, const paddle::optional<std::vector<int64_t>>& token_table,
    const paddle::optional<std::vector<int64_t>>& hidden_norm,
    const paddle::optional<std::vector<int64_t>>& hidden_panels,
    const paddle::optional<std::vector<int64_t>>& final_norm,
    const paddle::optional<std::vector<int64_t>>& head_panels, const paddle::optional<std::vector<int64_t>>& head_ids,
    const paddle::optional<std::vector<int64_t>>& head_rows, const paddle::optional<std::vector<int64_t>>& key_starts) {
  const int64_t rows = out_rows ? (*out_rows)[0] : x[0];
  const int64_t picked = head_panels ? (head_rows ? (*head_rows)[0] : rows) : 0;
  const int64_t columns = head_panels ? (*head_panels)[0] * mtp::kPanelColumns : 0;
  return {{rows, x[1]}, {final_norm ? rows : 0, x[1]}, {picked}, {picked, columns}};
}

std::vector<paddle::DataType> DecoderLayerDtype(
    const paddle::DataType& x, const paddle::DataType& input_norm, const paddle::DataType& qkv_panels,
    const paddle::optional<paddle::DataType>& qkv_bias, const paddle::DataType& o_panels,
    const paddle::DataType& post_norm, const paddle::DataType& gate_up_panels, const paddle::DataType& down_panels,
    const paddle::DataType& cos_table, const paddle::DataType& sin_table, const paddle::DataType& positions,
    const paddle::DataType& write_slots, const paddle::DataType& k_cache, const paddle::DataType& v_cache,
    const paddle::DataType& block_tables, const paddle::DataType& cu_seqlens_q, const paddle::DataType& seq_lens_kv,
    const paddle::optional<paddle::DataType>& out_rows, const paddle::optional<paddle::DataType>& token_ids,
    const paddle::optional<paddle::DataType>& token_table, const paddle::optional<paddle::DataType>& hidden_norm,
    const paddle::optional<paddle::DataType>& hidden_panels, const paddle::optional<paddle::DataType>& final_norm,
    const paddle::optional<paddle::DataType>& head_panels, const paddle::optional<paddle::DataType>& head_ids,
    const paddle::optional<paddle::DataType>& head_rows, const paddle::optional<paddle::DataType>& key_starts) {
  return {paddle::DataType::FLOAT32, paddle::DataType::FLOAT32, paddle::DataType::INT64, paddle::DataType::FLOAT32};
}

}  // namespace

PD_BUILD_OP(mtp_decoder_layer)
    .Inputs({"x", "input_norm", "qkv_panels", paddle::Optional("qkv_bias"), "o_panels", "post_norm",
             "gate_up_panels", "down_panels", "cos_table", "sin_table", "positions", "write_slots", "k_cache",
             "v_cache", "block_tables", "cu_seqlens_q", "seq_lens_kv", paddle::Optional("out_rows"),
             paddle::Optional("token_ids"), paddle::Optional("token_table"), paddle::Optional("hidden_norm"),
             paddle::Optional("hidden_panels"), paddle::Optional("final_norm"), paddle::Optional("head_panels"),
             paddle::Optional("head_ids"), paddle::Optional("head_rows"), paddle::Optional("key_starts")})
    .Outputs({"out", "normed_out", "head_ids_out", "head_logits", "k_out", "v_out"})
    .SetInplaceMap({{"k_cache", "k_out"}, {"v_cache", "v_out"}})
    .Attrs({"heads: int", "eps: float", "block_size: int", "zero_position_zero: bool"})
    .SetKernelFn(PD_KERNEL(DecoderLayer))
    .SetInferShapeFn(PD_INFER_SHAPE(DecoderLayerShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(DecoderLayerDtype));
