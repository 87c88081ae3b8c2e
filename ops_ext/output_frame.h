// Packing one step's outputs into a wire frame (layout: ipc/wire.py, mirrored in mtp_wire.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "mtp_wire.h"

namespace mtp_out {

// zlib-compatible CRC-32, so Python checks it with zlib.crc32.
uint32_t Crc32(const uint8_t* data, size_t size, uint32_t crc = 0);

// A read-only view of an int32 or int64 host array, so ops accept either dtype.
struct IntView {
  const void* data = nullptr;
  bool is64 = true;
  int64_t operator[](int64_t i) const {
    return is64 ? static_cast<const int64_t*>(data)[i] : static_cast<const int32_t*>(data)[i];
  }
};

// Host-side views of one step's output tensors. Rows with req_ids < 0 are invalid slots (skipped).
// Token-indexed tensors are either flat [N] (request i owns rows cu[i] .. cu[i] + num_tokens[i]) or
// padded [B, T] (request i owns rows i*T .. i*T + num_tokens[i]); token_stride is 0 or T.
struct StepTensors {
  int64_t num_slots = 0;           // B_in: rows of req_ids/seq/num_tokens/finish
  IntView req_ids, seq, num_tokens, finish;
  IntView token_ids;               // [N] or [B, T]
  int64_t num_token_rows = 0;      // N_in or B*T
  int64_t token_stride = 0;        // 0: flat; T: padded
  bool has_logprobs = false;
  const float* logprob = nullptr;  // same rows as token_ids
  IntView rank;                    // same rows as token_ids
  IntView topk_ids;                // [rows, topk_cols]
  const float* topk_logprobs = nullptr;  // [rows, topk_cols]
  int64_t topk_cols = 0;           // K_max of the tensors
  int64_t num_topk = 0;            // K: real width sent (<= topk_cols, <= kMaxTopk)
  IntView draft_ids;               // [B_in, draft_width] or empty
  int64_t draft_width = 0;
  int64_t vocab_size = 0;          // every token id sent must lie in [0, vocab_size)
};

struct FrameMeta {
  int kind = mtp_wire::kKindTarget;
  uint64_t step_id = 0;
  uint32_t instance_tag = 0;
};

// Writes the payload of a token frame into *payload (resized; callers reuse one buffer, so large
// frames cost no allocation) and returns its header (frame_seq, chunk and
// ring fields are the channel's to fill). Throws std::invalid_argument on out-of-range input.
mtp_wire::FrameHeader PackTokenFrame(const StepTensors& step, const FrameMeta& meta,
                                     std::vector<uint8_t>* payload);

mtp_wire::FrameHeader PackControlFrame(int code, const std::string& message, const FrameMeta& meta,
                                       std::vector<uint8_t>* payload);

// Sets header_crc over the 64 header bytes (with header_crc zeroed).
void SealHeader(mtp_wire::FrameHeader* header);

}  // namespace mtp_out
