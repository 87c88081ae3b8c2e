// mtp_sample_verify: the tokens of a step's windows from their processed logits, on CPU hosts: a plain draw
// (or argmax) for prompt rows, and for decode rows the drafts verified against the target, by argmax for
// greedy requests and by rejection sampling for the others, with the recovered or bonus token after them.
//
// WHY: Paddle's CPU kernels made sampling the costliest part of a small model's step: softmax, the
// filters, the inverse-CDF draws and the verification as ~80 tensor ops took 2.3 ms of a 1-row window of
// two tokens (0.9 ms with no draft) and 17.6 ms at 64 rows, where the forward pass is ~15 ms. Here a request
// is one pass per window row it needs: rows past the first rejection are never read.
//
// Inputs (B requests, windows of W rows, vocabulary V; row b*W+j of `logits` is request b's position j):
//   logits  [B*W, V] float32, penalties and the min_tokens mask already applied
//   ints    [B, W+1] int64 per request: its drafts d_1..d_{W-1} (-1 past its last), then top_k (<= 0: off),
//           then 1 if it is a prompt chunk's row (which emits one plain draw at position 0), else 0
//   floats  [B, 2W+2] float32 per request: temperature (<= 0: greedy), top_p, min_p, the W uniforms of its
//           positions' draws, then the W-1 uniforms of its drafts' coins
// (two arrays, not eight: each tensor a step makes on a rank's device thread costs ~50 us cold at batch 1,
// host_tensor.py)
// Outputs: tokens [B, W] int64 (accepted drafts, then the recovered/bonus/plain token, then -1) and
// num_accepted [B] int64.
//
// The maths is spec_verify.py's and sampler.py's (probabilities: softmax(x / T), then top-k/top-p/min-p
// zero what they drop; a draft d is accepted if u < p(d); at the first rejection the token is a draw from p
// with d removed; after k acceptances, from the bonus position's p; a draw is the first id whose running
// sum reaches u times the total). A request's result depends on its own rows alone.
//
// Python wrapper: mtpserve.engine.spec_verify.sample_and_verify (CPU hosts).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "paddle/extension.h"
#include "vector_math.h"
#include "worker_pool.h"

namespace {

// Calls over at least this many logits spread their requests over the CPU kernels' workers.
constexpr double kParallelWork = 16 * 4096;

// Buckets of probabilities by their float's top 12 bits (sign, exponent, 3 bits of mantissa).
constexpr int kBuckets = 1 << 12;

uint32_t Bucket(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return bits >> 20;
}

// A thread's scratch for SortedThreshold.
struct Buckets {
  std::vector<int64_t> count;
  std::vector<float> mass, low, values;
};

struct Sampling {
  float temperature, top_p, min_p;
  int64_t top_k;
};

int64_t Argmax(const float* x, int64_t vocab) {
  int64_t best = 0;
  for (int64_t j = 1; j < vocab; ++j)
    if (x[j] > x[best]) best = j;  // NOTE: strictly greater: the lowest id among equal logits
  return best;
}

constexpr int kLanes = 16;

// max of v[0..n), in 16 lanes (a float reduction vectorises only when its order is written out).
MTP_VECTOR_CLONES
float Max(const float* v, int64_t n) {
  float lanes[kLanes];
  for (int l = 0; l < kLanes; ++l) lanes[l] = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] = lanes[l] > v[j + l] ? lanes[l] : v[j + l];
  float m = -std::numeric_limits<float>::infinity();
  for (int l = 0; l < kLanes; ++l) m = m > lanes[l] ? m : lanes[l];
  for (; j < n; ++j) m = m > v[j] ? m : v[j];
  return m;
}

// sum of v[0..n), in 16 lanes.
MTP_VECTOR_CLONES
float Sum(const float* v, int64_t n) {
  float lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += v[j + l];
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) s += lanes[l];
  for (; j < n; ++j) s += v[j];
  return s;
}

// p[j] = softmax(x / T)[j]; returns max(p).
MTP_VECTOR_CLONES
float Softmax(const float* x, int64_t vocab, float temperature, float* p) {
  const float inv_t = 1.0f / temperature;
  for (int64_t j = 0; j < vocab; ++j) p[j] = x[j] * inv_t;
  const float m = Max(p, vocab);
  // NOTE: a masked token (-inf: a stop token before min_tokens) gets exactly 0, not ExpNonPositive's ~1e-38
  for (int64_t j = 0; j < vocab; ++j)
    p[j] = x[j] > -std::numeric_limits<float>::infinity() ? mtp::ExpNonPositive(p[j] - m) : 0.0f;
  const float inv = 1.0f / Sum(p, vocab);
  for (int64_t j = 0; j < vocab; ++j) p[j] *= inv;
  return Max(p, vocab);
}

// The smallest probability both top-k and top-p keep (sampler._sorted_threshold): the num_keep-th largest,
// num_keep = max(1, min(top_k, how many have less than top_p of mass before them in descending order)).
//
// NOTE: found without sorting the vocabulary: a non-negative float's bits order it as its value does, so
// buckets by their top bits hold descending ranges of values. Whole buckets are taken from the top while
// both limits allow, and only the bucket the boundary falls in is sorted: at T = 1.5 a top-p of 0.9 keeps
// thousands of tokens, and sorting them took ~160 us a row.
float SortedThreshold(const float* p, int64_t vocab, const Sampling& s, Buckets& b) {
  const int64_t by_k = s.top_k > 0 ? std::min(s.top_k, vocab) : vocab;
  const float by_p = s.top_p < 1.0f ? s.top_p : std::numeric_limits<float>::infinity();
  b.count.assign(kBuckets, 0);
  b.mass.assign(kBuckets, 0.0f);
  b.low.assign(kBuckets, std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < vocab; ++j) {
    const uint32_t key = Bucket(p[j]);
    ++b.count[key];
    b.mass[key] += p[j];
    b.low[key] = std::min(b.low[key], p[j]);
  }
  int64_t keep = 0;
  float mass = 0.0f, last = 0.0f;
  for (int key = kBuckets - 1; key >= 0 && keep < by_k && mass < by_p; --key) {
    const int64_t n = b.count[key];
    if (n == 0) continue;
    if (keep + n <= by_k && mass + b.mass[key] < by_p) {  // NOTE: every one of them, and the next, is kept
      keep += n;
      mass += b.mass[key];
      last = b.low[key];
      continue;
    }
    b.values.clear();
    for (int64_t j = 0; j < vocab; ++j)
      if (Bucket(p[j]) == static_cast<uint32_t>(key)) b.values.push_back(p[j]);
    std::sort(b.values.begin(), b.values.end(), std::greater<float>());
    for (size_t i = 0; i < b.values.size() && keep < by_k && mass < by_p; ++i, ++keep) {
      mass += b.values[i];
      last = b.values[i];
    }
    break;
  }
  return keep > 0 ? last : Max(p, vocab);
}

// Zero what min-p and top-k/top-p drop (sampler.filter_probs, before its renormalisation); returns the sum
// of what is kept.
float Filter(float* p, int64_t vocab, float top, const Sampling& s, Buckets& order) {
  float floor = s.min_p * top;
  if (s.top_k > 0 || s.top_p < 1.0f) floor = std::max(floor, SortedThreshold(p, vocab, s, order));
  for (int64_t j = 0; j < vocab; ++j) p[j] = p[j] >= floor ? p[j] : 0.0f;
  return Sum(p, vocab);
}

// The first id whose running sum of w reaches u times the whole sum (sampler.draw), with w[skip] taken as
// 0 (a rejected draft; -1: none), unless that leaves nothing. NOTE: summed in double: over a few thousand
// small probabilities a float running sum drifts by ~1e-7, and a draw near a boundary would move with it.
int64_t Draw(const float* w, int64_t vocab, float u, int64_t skip) {
  double total = 0.0;
  for (int64_t j = 0; j < vocab; ++j) total += w[j];
  if (skip >= 0 && total - w[skip] > 0.0) {
    total -= w[skip];
  } else {
    skip = -1;
  }
  const double target = static_cast<double>(u) * total;
  double cdf = 0.0;
  for (int64_t j = 0; j < vocab; ++j) {
    cdf += j == skip ? 0.0 : w[j];
    if (!(cdf < target)) return j;
  }
  return vocab - 1;  // NOTE: rounding can leave u * total above the last running sum
}

struct Request {
  const float* logits;  // [W, V]
  const int64_t* drafts;  // [W-1]
  const float* u_sample;  // [W]
  const float* u_accept;  // [W-1]
  bool prefill;
  Sampling s;
  int64_t width, vocab;
  int64_t* tokens;  // [W]
  int64_t* accepted;
};

void Greedy(const Request& r) {
  const int64_t last = r.prefill ? 0 : r.width - 1;
  int64_t n = 0, target = Argmax(r.logits, r.vocab);
  while (n < last && r.drafts[n] == target) {
    r.tokens[n] = target;
    ++n;
    target = Argmax(r.logits + n * r.vocab, r.vocab);
  }
  r.tokens[n] = target;
  *r.accepted = n;
}

void Sampled(const Request& r, std::vector<float>& p, Buckets& order) {
  const int64_t last = r.prefill ? 0 : r.width - 1;
  for (int64_t n = 0;; ++n) {
    const float* x = r.logits + n * r.vocab;
    const float top = Softmax(x, r.vocab, r.s.temperature, p.data());
    const float kept = Filter(p.data(), r.vocab, top, r.s, order);
    const int64_t draft = n < last ? r.drafts[n] : -1;
    // NOTE: p(d) of the renormalised distribution; u * kept < p(d) is u < p(d) / kept without a division
    if (draft >= 0 && r.u_accept[n] * kept < p[draft]) {
      r.tokens[n] = draft;
      continue;
    }
    r.tokens[n] = Draw(p.data(), r.vocab, r.u_sample[n], draft);
    *r.accepted = n;
    return;
  }
}

std::vector<paddle::Tensor> SampleVerify(const paddle::Tensor& logits, const paddle::Tensor& ints,
                                         const paddle::Tensor& floats) {
  PD_CHECK(logits.is_cpu() && ints.is_cpu() && floats.is_cpu(), "mtp_sample_verify runs on CPU tensors");
  PD_CHECK(ints.is_contiguous() && floats.is_contiguous(), "mtp_sample_verify takes contiguous parameters");
  PD_CHECK(logits.dtype() == paddle::DataType::FLOAT32 && logits.shape().size() == 2, "logits: [B*W, V] float32");
  PD_CHECK(ints.dtype() == paddle::DataType::INT64 && ints.shape().size() == 2, "ints: [B, W+1] int64");
  PD_CHECK(floats.dtype() == paddle::DataType::FLOAT32 && floats.shape().size() == 2, "floats: [B, 2W+2] float32");
  const int64_t batch = ints.shape()[0], width = ints.shape()[1] - 1, vocab = logits.shape()[1];
  PD_CHECK(width >= 1 && logits.shape()[0] == batch * width && vocab > 0, "logits must hold W rows per request");
  PD_CHECK(floats.shape()[0] == batch && floats.shape()[1] == 2 * width + 2, "floats: [B, 2W+2]");
  const paddle::Tensor lc = logits.is_contiguous() ? logits : logits.contiguous();
  const float* x = lc.data<float>();
  const int64_t* in = ints.data<int64_t>();
  const float* fl = floats.data<float>();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j = 0; j + 1 < width; ++j) PD_CHECK(in[b * (width + 1) + j] < vocab, "a draft outside the vocabulary");
  auto place = logits.place();
  paddle::Tensor tokens = paddle::full({batch, width}, -1, paddle::DataType::INT64, place);
  paddle::Tensor accepted = paddle::empty({batch}, paddle::DataType::INT64, place);
  int64_t* out = tokens.data<int64_t>();
  int64_t* acc = accepted.data<int64_t>();
  auto request = [&](int64_t b) {
    const int64_t* i = in + b * (width + 1);
    const float* f = fl + b * (2 * width + 2);
    const Sampling s{f[0], f[1], f[2], i[width - 1]};
    const Request r{x + b * width * vocab, i, f + 3, f + 3 + width, i[width] != 0, s, width, vocab,
                    out + b * width, acc + b};
    if (s.temperature <= 0.0f) {
      Greedy(r);
      return;
    }
    thread_local std::vector<float> p;
    thread_local Buckets order;
    p.resize(static_cast<size_t>(vocab));
    Sampled(r, p, order);
  };
  // NOTE: requests are independent and each runs whole on one thread: results do not depend on the split
  if (batch > 1 && static_cast<double>(batch) * width * vocab >= kParallelWork) {
    mtp::ParallelFor(batch, request);
  } else {
    for (int64_t b = 0; b < batch; ++b) request(b);
  }
  return {tokens, accepted};
}

std::vector<std::vector<int64_t>> SampleVerifyShape(const std::vector<int64_t>& logits, const std::vector<int64_t>& ints,
                                                    const std::vector<int64_t>& floats) {
  return {{ints[0], ints[1] - 1}, {ints[0]}};
}

std::vector<paddle::DataType> SampleVerifyDtype(const paddle::DataType&, const paddle::DataType&,
                                                const paddle::DataType&) {
  return {paddle::DataType::INT64, paddle::DataType::INT64};
}

}  // namespace

PD_BUILD_OP(mtp_sample_verify)
    .Inputs({"logits", "ints", "floats"})
    .Outputs({"tokens", "num_accepted"})
    .SetKernelFn(PD_KERNEL(SampleVerify))
    .SetInferShapeFn(PD_INFER_SHAPE(SampleVerifyShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(SampleVerifyDtype));
