// mtp_token_logprobs: per row of float32 logits, in one pass, the chosen token's logprob and rank and
// the top-k ids and logprobs (k <= 20), on CPU hosts.
//
// WHY: on Paddle's CPU build `log_softmax` over [48, 4096] float32 takes ~94 ms (softmax: 0.35 ms), so
// asking for logprobs halved a serving instance's throughput; `topk` adds ~1.5 ms. One pass per row
// needs neither a [N, V] logprob tensor nor a sort.
//
// Per row (V logits x, chosen token t), in three passes over the row (which stays in L1):
//   log-sum-exp  the max m, then the sum of exp(x - m) with the vectorisable exp (vector_math.h);
//   logprob      x[t] - (m + log s);
//   rank         1 + the number of logits strictly greater than x[t] (ties share the better rank);
//   top-k        the k largest logits, larger first, the lower id first among equal logits.
// A row's result depends on that row alone, whatever rows share the call.
//
// Python wrapper: mtpserve.engine.sampler.gather_logprobs (CPU hosts).
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "paddle/extension.h"
#include "vector_math.h"
#include "worker_pool.h"

namespace {

constexpr int kMaxTop = 20;
// Calls over at least this many logits spread their rows over the CPU kernels' workers.
constexpr double kParallelWork = 16 * 4096;

struct TopK {
  int k = 0;
  int size = 0;
  float value[kMaxTop];
  int64_t id[kMaxTop];

  // NOTE: ids arrive in increasing order, so "strictly greater" keeps the lower id among ties.
  void Offer(float x, int64_t j) {
    if (size == k && !(x > value[size - 1])) return;
    int i = size < k ? size++ : size - 1;
    while (i > 0 && x > value[i - 1]) {
      value[i] = value[i - 1];
      id[i] = id[i - 1];
      --i;
    }
    value[i] = x;
    id[i] = j;
  }
};

constexpr int kLanes = 16;

// The row's max, and how many logits are strictly greater than `xt`, in 16 lanes (vectorised).
MTP_VECTOR_CLONES
void MaxAndGreater(const float* x, int64_t vocab, float xt, float* max_out, int64_t* greater_out) {
  float lanes[kLanes];
  int32_t above[kLanes] = {};
  for (int l = 0; l < kLanes; ++l) lanes[l] = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  for (; j + kLanes <= vocab; j += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      lanes[l] = lanes[l] > x[j + l] ? lanes[l] : x[j + l];
      above[l] += x[j + l] > xt;
    }
  float m = -std::numeric_limits<float>::infinity();
  int64_t greater = 0;
  for (int l = 0; l < kLanes; ++l) {
    m = m > lanes[l] ? m : lanes[l];
    greater += above[l];
  }
  for (; j < vocab; ++j) {
    m = m > x[j] ? m : x[j];
    greater += x[j] > xt;
  }
  *max_out = m;
  *greater_out = greater;
}

// sum of exp(x - m) over the row (m its max), in 16 lanes with the vectorisable exp.
MTP_VECTOR_CLONES
float SumExp(const float* x, int64_t vocab, float m) {
  float lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= vocab; j += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += mtp::ExpNonPositive(x[j + l] - m);
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) s += lanes[l];
  for (; j < vocab; ++j) s += mtp::ExpNonPositive(x[j] - m);
  return s;
}

void Row(const float* x, int64_t vocab, int64_t token, int k, float* chosen, int64_t* rank,
         int64_t* top_ids, float* top_lp) {
  const float xt = x[token];
  float m;
  int64_t greater;
  MaxAndGreater(x, vocab, xt, &m, &greater);
  const float lse = m + std::log(SumExp(x, vocab, m));
  *chosen = xt - lse;
  *rank = greater + 1;
  if (k == 0) return;
  TopK top;
  top.k = k;
  for (int64_t j = 0; j < vocab; ++j) top.Offer(x[j], j);
  for (int i = 0; i < k; ++i) {
    top_ids[i] = top.id[i];
    top_lp[i] = top.value[i] - lse;
  }
}

std::vector<paddle::Tensor> TokenLogprobs(const paddle::Tensor& logits, const paddle::Tensor& token_ids,
                                          int num_top) {
  PD_CHECK(logits.is_cpu() && token_ids.is_cpu(), "mtp_token_logprobs runs on CPU tensors");
  PD_CHECK(logits.dtype() == paddle::DataType::FLOAT32, "mtp_token_logprobs takes float32 logits");
  PD_CHECK(token_ids.dtype() == paddle::DataType::INT64, "token_ids must be int64");
  PD_CHECK(logits.shape().size() == 2, "logits must be [N, V]");
  PD_CHECK(num_top >= 0 && num_top <= kMaxTop, "num_top must be in [0, 20]");
  const int64_t rows = logits.shape()[0], vocab = logits.shape()[1];
  PD_CHECK(token_ids.numel() == rows, "one token id per row");
  PD_CHECK(vocab >= num_top && vocab > 0, "the vocabulary must hold num_top tokens");
  const paddle::Tensor lc = logits.is_contiguous() ? logits : logits.contiguous();
  const paddle::Tensor tc = token_ids.is_contiguous() ? token_ids : token_ids.contiguous();
  const float* x = lc.data<float>();
  const int64_t* t = tc.data<int64_t>();
  auto place = logits.place();
  paddle::Tensor chosen = paddle::empty({rows}, paddle::DataType::FLOAT32, place);
  paddle::Tensor rank = paddle::empty({rows}, paddle::DataType::INT64, place);
  paddle::Tensor top_ids = paddle::empty({rows, num_top}, paddle::DataType::INT64, place);
  paddle::Tensor top_lp = paddle::empty({rows, num_top}, paddle::DataType::FLOAT32, place);
  for (int64_t r = 0; r < rows; ++r) PD_CHECK(t[r] >= 0 && t[r] < vocab, "token id outside the vocabulary");
  float* c = chosen.data<float>();
  int64_t* rk = rank.data<int64_t>();
  int64_t* ti = top_ids.data<int64_t>();
  float* tl = top_lp.data<float>();
  auto row = [&](int64_t r) {
    Row(x + r * vocab, vocab, t[r], num_top, c + r, rk + r, ti + r * num_top, tl + r * num_top);
  };
  // NOTE: rows are independent and each runs whole on one thread: results do not depend on the split
  if (rows > 1 && static_cast<double>(rows) * vocab >= kParallelWork) {
    mtp::ParallelFor(rows, row);
  } else {
    for (int64_t r = 0; r < rows; ++r) row(r);
  }
  return {chosen, rank, top_ids, top_lp};
}

std::vector<std::vector<int64_t>> TokenLogprobsShape(const std::vector<int64_t>& logits,
                                                     const std::vector<int64_t>& token_ids, int num_top) {
  return {{logits[0]}, {logits[0]}, {logits[0], num_top}, {logits[0], num_top}};
}

std::vector<paddle::DataType> TokenLogprobsDtype(const paddle::DataType& logits,
                                                 const paddle::DataType& token_ids) {
  return {paddle::DataType::FLOAT32, paddle::DataType::INT64, paddle::DataType::INT64,
          paddle::DataType::FLOAT32};
}

}  // namespace

PD_BUILD_OP(mtp_token_logprobs)
    .Inputs({"logits", "token_ids"})
    .Outputs({"logprob", "rank", "top_ids", "top_logprobs"})
    .Attrs({"num_top: int"})
    .SetKernelFn(PD_KERNEL(TokenLogprobs))
    .SetInferShapeFn(PD_INFER_SHAPE(TokenLogprobsShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(TokenLogprobsDtype));
