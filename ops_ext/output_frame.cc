// Packing one step's outputs into a wire frame: only the real batch, real tokens, real top-k width.
#include "output_frame.h"

#include <dlfcn.h>

#include <array>
#include <cstring>
#include <stdexcept>

namespace mtp_out {
namespace {

using mtp_wire::FrameHeader;
using ZlibCrc = unsigned long (*)(unsigned long, const unsigned char*, unsigned int);

std::array<uint32_t, 256> MakeCrcTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    table[i] = c;
  }
  return table;
}

// NOTE: zlib's crc32 is several times faster than a byte table; it is loaded at run time so the
// build needs no extra link flag. The table is the fallback on a host without libz.
ZlibCrc LoadZlibCrc() {
  void* lib = dlopen("libz.so.1", RTLD_NOW | RTLD_LOCAL);
  return lib ? reinterpret_cast<ZlibCrc>(dlsym(lib, "crc32")) : nullptr;
}

void Check(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(what);
}

struct SectionPlan {
  uint32_t offset[mtp_wire::kNumSections] = {};
  uint32_t bytes[mtp_wire::kNumSections] = {};  // unpadded
  bool present[mtp_wire::kNumSections] = {};
  uint32_t payload_len = 0;
};

uint64_t Pad8(uint64_t n) { return (n + mtp_wire::kSectionAlign - 1) & ~uint64_t{7}; }

SectionPlan PlanSections(uint64_t b, uint64_t n, uint64_t k, uint64_t d, bool logprobs) {
  SectionPlan plan;
  const uint64_t counts[4] = {b, n, n * k, b * d};
  uint64_t offset = 0;
  for (int i = 0; i < mtp_wire::kNumSections; ++i) {
    const auto& spec = mtp_wire::kSections[i];
    if (spec.needs_logprobs && !logprobs) continue;
    plan.present[i] = true;
    plan.offset[i] = static_cast<uint32_t>(offset);
    plan.bytes[i] = static_cast<uint32_t>(counts[spec.count_kind] * spec.elem_size);
    offset += Pad8(plan.bytes[i]);
  }
  Check(offset <= mtp_wire::kMaxPayload, "frame payload exceeds kMaxPayload");
  plan.payload_len = static_cast<uint32_t>(offset);
  return plan;
}

// Sizes the (reused) buffer and zeroes only the padding; the sections are all overwritten.
// NOTE: zero padding keeps frames bit-reproducible.
void PrepareBuffer(const SectionPlan& plan, std::vector<uint8_t>* payload) {
  payload->resize(plan.payload_len);
  for (int i = 0; i < mtp_wire::kNumSections; ++i) {
    if (!plan.present[i]) continue;
    const uint32_t end = plan.offset[i] + plan.bytes[i];
    std::memset(payload->data() + end, 0, Pad8(plan.bytes[i]) - plan.bytes[i]);
  }
}

// Valid slots, each with the first row of its tokens in the input tensors.
struct Batch {
  std::vector<int64_t> slots;
  std::vector<int64_t> rows;
  int64_t num_tokens = 0;
};

Batch SelectBatch(const StepTensors& s) {
  Batch batch;
  int64_t flat_row = 0;
  for (int64_t i = 0; i < s.num_slots; ++i) {
    const int64_t n = s.num_tokens[i];
    const int64_t row = s.token_stride ? i * s.token_stride : flat_row;
    if (s.req_ids[i] < 0) {  // invalid (over-allocated) slot: skipped, but its tokens keep their rows
      flat_row += n > 0 ? n : 0;
      continue;
    }
    Check(n >= 0 && n <= mtp_wire::kMaxTokensPerReq, "num_tokens out of [0, kMaxTokensPerReq]");
    Check(!s.token_stride || n <= s.token_stride, "num_tokens exceeds the padded token width");
    Check(row + n <= s.num_token_rows, "token tensors are shorter than num_tokens says");
    batch.slots.push_back(i);
    batch.rows.push_back(row);
    batch.num_tokens += n;
    flat_row += n;
  }
  Check(static_cast<int64_t>(batch.slots.size()) <= mtp_wire::kMaxReqs, "batch exceeds kMaxReqs");
  return batch;
}

int32_t TokenId(int64_t id, int64_t vocab_size, bool allow_none) {
  Check((id >= 0 && id < vocab_size) || (allow_none && id == -1), "token id outside the vocabulary");
  return static_cast<int32_t>(id);
}

// Narrows n ids to int32 with one range check for the run (a branch-free loop the compiler
// vectorises); lo is -1 where -1 pads, else 0.
template <typename T>
void NarrowIds(const T* src, int64_t n, int64_t lo, int64_t vocab_size, int32_t* dst) {
  bool ok = true;
  for (int64_t i = 0; i < n; ++i) {
    ok &= static_cast<int64_t>(src[i]) >= lo && static_cast<int64_t>(src[i]) < vocab_size;
    dst[i] = static_cast<int32_t>(src[i]);
  }
  Check(ok, "token id outside the vocabulary");
}

void NarrowIds(const IntView& src, int64_t start, int64_t n, int64_t lo, int64_t vocab_size,
               int32_t* dst) {
  if (src.is64) return NarrowIds(static_cast<const int64_t*>(src.data) + start, n, lo, vocab_size, dst);
  NarrowIds(static_cast<const int32_t*>(src.data) + start, n, lo, vocab_size, dst);
}

template <typename T>
T* At(std::vector<uint8_t>* payload, const SectionPlan& plan, int section) {
  return reinterpret_cast<T*>(payload->data() + plan.offset[section]);
}

void PackRequests(const StepTensors& s, const Batch& batch, const SectionPlan& plan,
                  std::vector<uint8_t>* out) {
  auto* req_ids = At<int64_t>(out, plan, mtp_wire::kSectionReqIds);
  auto* seq = At<uint32_t>(out, plan, mtp_wire::kSectionSeq);
  auto* num_tokens = At<int32_t>(out, plan, mtp_wire::kSectionNumTokens);
  auto* finish = At<int32_t>(out, plan, mtp_wire::kSectionFinish);
  for (size_t b = 0; b < batch.slots.size(); ++b) {
    const int64_t slot = batch.slots[b];
    Check(s.seq[slot] >= 0 && s.seq[slot] <= UINT32_MAX, "seq out of u32 range");
    Check(s.finish[slot] >= 0 && s.finish[slot] <= mtp_wire::kFinishError, "unknown finish status");
    req_ids[b] = s.req_ids[slot];
    seq[b] = static_cast<uint32_t>(s.seq[slot]);
    num_tokens[b] = static_cast<int32_t>(s.num_tokens[slot]);
    finish[b] = static_cast<int32_t>(s.finish[slot]);
  }
}

void PackTokens(const StepTensors& s, const Batch& batch, const SectionPlan& plan,
                std::vector<uint8_t>* out) {
  auto* tokens = At<int32_t>(out, plan, mtp_wire::kSectionTokenIds);
  int64_t o = 0;
  for (size_t b = 0; b < batch.slots.size(); ++b) {
    const int64_t n = s.num_tokens[batch.slots[b]];
    NarrowIds(s.token_ids, batch.rows[b], n, 0, s.vocab_size, tokens + o);
    o += n;
  }
}

void PackLogprobRow(const StepTensors& s, int64_t row, int64_t o, const SectionPlan& plan,
                    std::vector<uint8_t>* out) {
  const int64_t k = s.num_topk;
  At<float>(out, plan, mtp_wire::kSectionLogprob)[o] = s.logprob[row];
  At<int32_t>(out, plan, mtp_wire::kSectionRank)[o] = static_cast<int32_t>(s.rank[row]);
  auto* ids = At<int32_t>(out, plan, mtp_wire::kSectionTopkIds) + o * k;
  const int64_t base = row * s.topk_cols;
  // NOTE: -1 pads top-k rows of requests that asked for fewer (or no) alternatives.
  NarrowIds(s.topk_ids, base, k, -1, s.vocab_size, ids);
  std::memcpy(At<float>(out, plan, mtp_wire::kSectionTopkLogprobs) + o * k, s.topk_logprobs + base,
              sizeof(float) * k);
}

void PackLogprobs(const StepTensors& s, const Batch& batch, const SectionPlan& plan,
                  std::vector<uint8_t>* out) {
  int64_t o = 0;
  for (size_t b = 0; b < batch.slots.size(); ++b) {
    const int64_t n = s.num_tokens[batch.slots[b]];
    for (int64_t j = 0; j < n; ++j) PackLogprobRow(s, batch.rows[b] + j, o + j, plan, out);
    o += n;
  }
}

void PackDrafts(const StepTensors& s, const Batch& batch, const SectionPlan& plan,
                std::vector<uint8_t>* out) {
  auto* drafts = At<int32_t>(out, plan, mtp_wire::kSectionDraftIds);
  const int64_t d = s.draft_width;
  for (size_t b = 0; b < batch.slots.size(); ++b) {
    for (int64_t c = 0; c < d; ++c)
      drafts[b * d + c] = TokenId(s.draft_ids[batch.slots[b] * d + c], s.vocab_size, true);
  }
}

FrameHeader BaseHeader(const FrameMeta& meta, uint32_t payload_len, const uint8_t* payload) {
  FrameHeader h{};
  h.magic = mtp_wire::kMagic;
  h.version = static_cast<uint16_t>(mtp_wire::kVersion);
  h.kind = static_cast<uint8_t>(meta.kind & 0xFF);
  h.instance_tag = meta.instance_tag;
  h.step_id = meta.step_id;
  h.chunk_count = 1;
  h.payload_len = payload_len;
  h.payload_crc = Crc32(payload, payload_len);
  return h;
}

}  // namespace

uint32_t Crc32(const uint8_t* data, size_t size, uint32_t crc) {
  static const ZlibCrc zlib_crc = LoadZlibCrc();
  static const std::array<uint32_t, 256> table = MakeCrcTable();
  if (zlib_crc) return static_cast<uint32_t>(zlib_crc(crc, data, static_cast<unsigned int>(size)));
  uint32_t c = ~crc;
  for (size_t i = 0; i < size; ++i) c = table[(c ^ data[i]) & 0xFF] ^ (c >> 8);
  return ~c;
}

FrameHeader PackTokenFrame(const StepTensors& s, const FrameMeta& meta, std::vector<uint8_t>* payload) {
  Check(meta.kind >= mtp_wire::kKindTarget && meta.kind <= mtp_wire::kKindFirstToken, "bad frame kind");
  Check(s.num_topk >= 0 && s.num_topk <= mtp_wire::kMaxTopk, "num_topk out of [0, kMaxTopk]");
  Check(!s.has_logprobs || s.num_topk <= s.topk_cols, "num_topk exceeds the top-k tensor width");
  Check(s.draft_width >= 0 && s.draft_width <= mtp_wire::kMaxDraftWidth, "draft width too large");
  const Batch batch = SelectBatch(s);
  const bool logprobs = s.has_logprobs && batch.num_tokens > 0;  // NOTE: no tokens, no logprob sections
  const int64_t k = logprobs ? s.num_topk : 0;
  const SectionPlan plan = PlanSections(batch.slots.size(), batch.num_tokens, k, s.draft_width, logprobs);
  PrepareBuffer(plan, payload);
  PackRequests(s, batch, plan, payload);
  PackTokens(s, batch, plan, payload);
  if (logprobs) PackLogprobs(s, batch, plan, payload);
  if (s.draft_width) PackDrafts(s, batch, plan, payload);
  FrameHeader h = BaseHeader(meta, plan.payload_len, payload->data());
  h.flags = static_cast<uint8_t>((logprobs ? mtp_wire::kFlagLogprobs : 0) & mtp_wire::kKnownFlags);
  h.num_reqs = static_cast<uint32_t>(batch.slots.size());
  h.num_tokens = static_cast<uint32_t>(batch.num_tokens);
  h.topk = static_cast<uint16_t>(k & 0xFFFF);
  h.draft_width = static_cast<uint16_t>(s.draft_width & 0xFFFF);
  return h;
}

FrameHeader PackControlFrame(int code, const std::string& message, const FrameMeta& meta,
                             std::vector<uint8_t>* payload) {
  Check(code == mtp_wire::kControlEngineError || code == mtp_wire::kControlEngineStop, "bad control code");
  const size_t text = std::min<size_t>(message.size(), mtp_wire::kMaxControlMessage);
  payload->assign(mtp_wire::kControlPrefix + text, 0);
  const int32_t code32 = code;
  std::memcpy(payload->data(), &code32, sizeof(code32));
  std::memcpy(payload->data() + mtp_wire::kControlPrefix, message.data(), text);
  FrameMeta control = meta;
  control.kind = mtp_wire::kKindControl;
  return BaseHeader(control, static_cast<uint32_t>(payload->size()), payload->data());
}

void SealHeader(FrameHeader* h) {
  h->header_crc = 0;
  h->header_crc = Crc32(reinterpret_cast<const uint8_t*>(h), sizeof(FrameHeader));
}

}  // namespace mtp_out
