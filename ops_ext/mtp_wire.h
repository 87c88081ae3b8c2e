// GENERATED from ipc/wire.py by `python -m mtpserve.ipc.wire_cgen`. Do not edit by hand:
// tests/ipc/test_wire_cgen.py fails when this file and ipc/wire.py drift.
#pragma once
#include <cstddef>
#include <cstdint>

namespace mtp_wire {

constexpr uint32_t kMagic = 0x4650544Du;
constexpr uint32_t kVersion = 0x1u;
constexpr uint32_t kRingMagic = 0x5250544Du;
constexpr uint32_t kRingVersion = 0x1u;
constexpr uint32_t kSectionAlign = 0x8u;
constexpr uint32_t kKnownFlags = 0x3u;
constexpr uint32_t kMaxReqs = 0x2000u;
constexpr uint32_t kMaxTokensPerReq = 0x40u;
constexpr uint32_t kMaxTopk = 0x14u;
constexpr uint32_t kMaxDraftWidth = 0x10u;
constexpr uint32_t kMaxControlMessage = 0xFA0u;
constexpr uint32_t kMaxPayload = 0x40000000u;
constexpr uint32_t kHeaderSize = 0x40u;
constexpr uint32_t kRingHeaderBytes = 0x1000u;
constexpr uint32_t kControlPrefix = 0x8u;

constexpr int kKindTarget = 1;
constexpr int kKindDraft = 2;
constexpr int kKindFirstToken = 3;
constexpr int kKindControl = 4;
constexpr int kFlagLogprobs = 1;
constexpr int kFlagInRing = 2;
constexpr int kFinishRunning = 0;
constexpr int kFinishStop = 1;
constexpr int kFinishLength = 2;
constexpr int kFinishAbort = 3;
constexpr int kFinishPreempted = 4;
constexpr int kFinishError = 5;
constexpr int kControlEngineError = 1;
constexpr int kControlEngineStop = 2;
constexpr int kTransportSysv = 1;
constexpr int kTransportPosix = 2;
constexpr int kCountPerReq = 0;
constexpr int kCountPerToken = 1;
constexpr int kCountPerTokenTopk = 2;
constexpr int kCountPerReqDraft = 3;

struct FrameHeader {
  uint32_t magic;
  uint16_t version;
  uint8_t kind;
  uint8_t flags;
  uint32_t header_crc;
  uint32_t instance_tag;
  uint64_t step_id;
  uint64_t frame_seq;
  uint32_t num_reqs;
  uint32_t num_tokens;
  uint16_t topk;
  uint16_t draft_width;
  uint16_t chunk_index;
  uint16_t chunk_count;
  uint32_t payload_len;
  uint32_t payload_crc;
  uint64_t ring_pos;
};
static_assert(sizeof(FrameHeader) == 64, "FrameHeader size");
static_assert(offsetof(FrameHeader, magic) == 0, "FrameHeader.magic");
static_assert(offsetof(FrameHeader, version) == 4, "FrameHeader.version");
static_assert(offsetof(FrameHeader, kind) == 6, "FrameHeader.kind");
static_assert(offsetof(FrameHeader, flags) == 7, "FrameHeader.flags");
static_assert(offsetof(FrameHeader, header_crc) == 8, "FrameHeader.header_crc");
static_assert(offsetof(FrameHeader, instance_tag) == 12, "FrameHeader.instance_tag");
static_assert(offsetof(FrameHeader, step_id) == 16, "FrameHeader.step_id");
static_assert(offsetof(FrameHeader, frame_seq) == 24, "FrameHeader.frame_seq");
static_assert(offsetof(FrameHeader, num_reqs) == 32, "FrameHeader.num_reqs");
static_assert(offsetof(FrameHeader, num_tokens) == 36, "FrameHeader.num_tokens");
static_assert(offsetof(FrameHeader, topk) == 40, "FrameHeader.topk");
static_assert(offsetof(FrameHeader, draft_width) == 42, "FrameHeader.draft_width");
static_assert(offsetof(FrameHeader, chunk_index) == 44, "FrameHeader.chunk_index");
static_assert(offsetof(FrameHeader, chunk_count) == 46, "FrameHeader.chunk_count");
static_assert(offsetof(FrameHeader, payload_len) == 48, "FrameHeader.payload_len");
static_assert(offsetof(FrameHeader, payload_crc) == 52, "FrameHeader.payload_crc");
static_assert(offsetof(FrameHeader, ring_pos) == 56, "FrameHeader.ring_pos");

struct RingHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t transport;
  uint64_t capacity;
  int64_t owner_pid;
  uint64_t owner_start;
  int64_t sysv_key;
  uint64_t max_msg_bytes;
  uint32_t instance_tag;
  uint32_t closed;
  uint32_t chunked;
  uint32_t pad0;
  uint64_t write_pos;
  uint64_t next_frame_seq;
  uint64_t pad1;
  uint64_t pad2;
  uint64_t pad3;
  uint64_t pad4;
  uint64_t pad5;
  uint64_t pad6;
  uint64_t read_pos;
};
static_assert(sizeof(RingHeader) == 136, "RingHeader size");
static_assert(offsetof(RingHeader, magic) == 0, "RingHeader.magic");
static_assert(offsetof(RingHeader, version) == 4, "RingHeader.version");
static_assert(offsetof(RingHeader, transport) == 6, "RingHeader.transport");
static_assert(offsetof(RingHeader, capacity) == 8, "RingHeader.capacity");
static_assert(offsetof(RingHeader, owner_pid) == 16, "RingHeader.owner_pid");
static_assert(offsetof(RingHeader, owner_start) == 24, "RingHeader.owner_start");
static_assert(offsetof(RingHeader, sysv_key) == 32, "RingHeader.sysv_key");
static_assert(offsetof(RingHeader, max_msg_bytes) == 40, "RingHeader.max_msg_bytes");
static_assert(offsetof(RingHeader, instance_tag) == 48, "RingHeader.instance_tag");
static_assert(offsetof(RingHeader, closed) == 52, "RingHeader.closed");
static_assert(offsetof(RingHeader, chunked) == 56, "RingHeader.chunked");
static_assert(offsetof(RingHeader, pad0) == 60, "RingHeader.pad0");
static_assert(offsetof(RingHeader, write_pos) == 64, "RingHeader.write_pos");
static_assert(offsetof(RingHeader, next_frame_seq) == 72, "RingHeader.next_frame_seq");
static_assert(offsetof(RingHeader, pad1) == 80, "RingHeader.pad1");
static_assert(offsetof(RingHeader, pad2) == 88, "RingHeader.pad2");
static_assert(offsetof(RingHeader, pad3) == 96, "RingHeader.pad3");
static_assert(offsetof(RingHeader, pad4) == 104, "RingHeader.pad4");
static_assert(offsetof(RingHeader, pad5) == 112, "RingHeader.pad5");
static_assert(offsetof(RingHeader, pad6) == 120, "RingHeader.pad6");
static_assert(offsetof(RingHeader, read_pos) == 128, "RingHeader.read_pos");

struct SectionSpec { const char* name; uint32_t elem_size; int count_kind; bool needs_logprobs; };
constexpr int kNumSections = 10;
constexpr SectionSpec kSections[kNumSections] = {
    {"req_ids", 8, 0, false},
    {"seq", 4, 0, false},
    {"num_tokens", 4, 0, false},
    {"finish", 4, 0, false},
    {"token_ids", 4, 1, false},
    {"logprob", 4, 1, true},
    {"rank", 4, 1, true},
    {"topk_ids", 4, 2, true},
    {"topk_logprobs", 4, 2, true},
    {"draft_ids", 4, 3, false},
};
constexpr int kSectionReqIds = 0;
constexpr int kSectionSeq = 1;
constexpr int kSectionNumTokens = 2;
constexpr int kSectionFinish = 3;
constexpr int kSectionTokenIds = 4;
constexpr int kSectionLogprob = 5;
constexpr int kSectionRank = 6;
constexpr int kSectionTopkIds = 7;
constexpr int kSectionTopkLogprobs = 8;
constexpr int kSectionDraftIds = 9;

}  // namespace mtp_wire
