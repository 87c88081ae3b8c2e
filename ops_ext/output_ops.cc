// Paddle ops of the output path: pack a step's host tensors into a frame and send it, with no
// per-request Python work. Python wrappers: mtpserve.ops (OutputSender).
//
// Every sending op takes the channel address as attributes and the sending rank: only the process
// whose rank_id equals send_rank packs and sends (under TP that is rank 0); the others return zeros.
// Each returns status int64[4] = [frames_pending, bytes_pending, frames_sent, frames_deferred];
// frames_pending > 0 means back-pressure: pause scheduling, call mtp_output_flush (output_channel.h).
#include <exception>
#include <string>
#include <vector>

#include "output_channel.h"
#include "output_frame.h"
#include "paddle/extension.h"

namespace {

using mtp_out::ChannelAddress;
using mtp_out::ChannelStatus;
using mtp_out::IntView;
using mtp_out::StepTensors;
using OptTensor = paddle::optional<paddle::Tensor>;

#define MTP_ADDRESS_ATTRS                                                                      \
  "rank_id: int", "send_rank: int", "transport: int", "queue: std::string", "sysv_key: int64_t", \
      "ring: std::string", "max_msg_bytes: int64_t", "max_pending_bytes: int64_t", "chunked: bool"

// Host memory: CPU, or pinned (the engine's async D2H mirrors on a GPU host).
bool OnHost(const paddle::Tensor& t) { return t.is_cpu() || t.is_gpu_pinned(); }

IntView Ints(const paddle::Tensor& t, const char* name) {
  PD_CHECK(OnHost(t), name, " must be a host tensor");
  if (t.dtype() == paddle::DataType::INT64) return {t.data<int64_t>(), true};
  PD_CHECK(t.dtype() == paddle::DataType::INT32, name, " must be int32 or int64");
  return {t.data<int32_t>(), false};
}

const float* Floats(const paddle::Tensor& t, const char* name) {
  PD_CHECK(OnHost(t) && t.dtype() == paddle::DataType::FLOAT32, name, " must be a host float32 tensor");
  return t.data<float>();
}

void CheckSlots(const paddle::Tensor& t, int64_t num_slots, const char* name) {
  PD_CHECK(t.numel() == num_slots, name, " must have one entry per request slot");
}

void SetTokens(const paddle::Tensor& token_ids, StepTensors* s) {
  s->token_ids = Ints(token_ids, "token_ids");
  s->num_token_rows = token_ids.numel();
  const auto& shape = token_ids.shape();
  PD_CHECK(shape.size() == 1 || shape.size() == 2, "token_ids must be [N] or [B, T]");
  s->token_stride = shape.size() == 2 ? shape[1] : 0;
  PD_CHECK(shape.size() == 1 || shape[0] == s->num_slots, "padded token_ids must have B rows");
}

// NOTE: Paddle passes an empty tensor ([N, 0] top-k) as absent, so top-k may be missing when K is 0.
void SetLogprobs(const OptTensor& logprob, const OptTensor& rank, const OptTensor& topk_ids,
                 const OptTensor& topk_logprobs, StepTensors* s) {
  PD_CHECK(logprob.is_initialized() == rank.is_initialized() &&
               topk_ids.is_initialized() == topk_logprobs.is_initialized() &&
               (logprob.is_initialized() || !topk_ids.is_initialized()),
           "logprob and rank go together, top-k ids and logprobs go together and need them");
  s->has_logprobs = logprob.is_initialized();
  if (!s->has_logprobs) return;
  PD_CHECK(logprob->numel() == s->num_token_rows && rank->numel() == s->num_token_rows,
           "logprob and rank must match token_ids");
  s->logprob = Floats(*logprob, "logprob");
  s->rank = Ints(*rank, "rank");
  if (!topk_ids.is_initialized()) return;
  s->topk_cols = topk_ids->shape().back();
  PD_CHECK(topk_ids->numel() == s->num_token_rows * s->topk_cols &&
               topk_logprobs->numel() == topk_ids->numel(), "top-k tensors must be [rows of token_ids, K]");
  s->topk_ids = Ints(*topk_ids, "topk_ids");
  s->topk_logprobs = Floats(*topk_logprobs, "topk_logprobs");
}

void SetDrafts(const OptTensor& draft_ids, StepTensors* s) {
  if (!draft_ids.is_initialized() || draft_ids->numel() == 0) return;
  PD_CHECK(draft_ids->shape().size() == 2 && draft_ids->shape()[0] == s->num_slots, "draft_ids must be [B, D]");
  s->draft_ids = Ints(*draft_ids, "draft_ids");
  s->draft_width = draft_ids->shape()[1];
}

StepTensors MakeStep(const paddle::Tensor& req_ids, const paddle::Tensor& seq, const paddle::Tensor& finish,
                     const paddle::Tensor& token_ids, const OptTensor& logprob, const OptTensor& rank,
                     const OptTensor& topk_ids, const OptTensor& topk_logprobs, const OptTensor& draft_ids,
                     int num_topk, int64_t vocab_size) {
  StepTensors s;
  s.num_slots = req_ids.numel();
  CheckSlots(seq, s.num_slots, "seq");
  CheckSlots(finish, s.num_slots, "finish");
  s.req_ids = Ints(req_ids, "req_ids");
  s.seq = Ints(seq, "seq");
  s.finish = Ints(finish, "finish");
  SetTokens(token_ids, &s);
  SetLogprobs(logprob, rank, topk_ids, topk_logprobs, &s);
  SetDrafts(draft_ids, &s);
  s.num_topk = num_topk;
  s.vocab_size = vocab_size;
  return s;
}

ChannelAddress Address(int transport, const std::string& queue, int64_t sysv_key, const std::string& ring,
                       int64_t max_msg_bytes, int64_t max_pending_bytes, bool chunked) {
  ChannelAddress a;
  a.transport = transport;
  a.queue_name = queue;
  a.sysv_key = sysv_key;
  a.ring_name = ring;
  a.max_msg_bytes = max_msg_bytes;
  a.max_pending_bytes = max_pending_bytes;
  a.chunked = chunked;
  return a;
}

paddle::Tensor StatusTensor(const ChannelStatus& s) {
  auto out = paddle::empty({4}, paddle::DataType::INT64, paddle::CPUPlace());
  int64_t* d = out.data<int64_t>();
  d[0] = s.frames_pending;
  d[1] = s.bytes_pending;
  d[2] = s.frames_sent;
  d[3] = s.frames_deferred;
  return out;
}

mtp_out::FrameMeta Meta(int kind, int64_t step_id, int64_t instance_tag) {
  mtp_out::FrameMeta meta;
  meta.kind = kind;
  meta.step_id = static_cast<uint64_t>(step_id);
  meta.instance_tag = static_cast<uint32_t>(instance_tag & 0xFFFFFFFF);
  return meta;
}

// Runs body, turning C++ exceptions into Paddle errors (a Python exception, never a crash).
template <typename Fn>
std::vector<paddle::Tensor> Guard(Fn&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    PD_THROW(e.what());
  }
}

std::vector<paddle::Tensor> PackAndSend(const StepTensors& step, const mtp_out::FrameMeta& meta,
                                        const ChannelAddress& address) {
  thread_local std::vector<uint8_t> payload;  // reused: a large frame costs no allocation
  const auto header = mtp_out::PackTokenFrame(step, meta, &payload);
  return {StatusTensor(mtp_out::OutputChannel::Get(address)->Submit(header, payload))};
}

std::vector<paddle::Tensor> SendOutput(
    const paddle::Tensor& req_ids, const paddle::Tensor& seq, const paddle::Tensor& num_tokens,
    const paddle::Tensor& finish, const paddle::Tensor& token_ids, const OptTensor& logprob,
    const OptTensor& rank, const OptTensor& topk_ids, const OptTensor& topk_logprobs,
    const OptTensor& draft_ids, int kind, int64_t step_id, int num_topk, int64_t vocab_size,
    int64_t instance_tag, int rank_id, int send_rank, int transport, const std::string& queue,
    int64_t sysv_key, const std::string& ring, int64_t max_msg_bytes, int64_t max_pending_bytes,
    bool chunked) {
  if (rank_id != send_rank) return {StatusTensor({})};
  return Guard([&] {
    StepTensors step = MakeStep(req_ids, seq, finish, token_ids, logprob, rank, topk_ids, topk_logprobs,
                                draft_ids, num_topk, vocab_size);
    CheckSlots(num_tokens, step.num_slots, "num_tokens");
    step.num_tokens = Ints(num_tokens, "num_tokens");
    return PackAndSend(step, Meta(kind, step_id, instance_tag),
                       Address(transport, queue, sysv_key, ring, max_msg_bytes, max_pending_bytes, chunked));
  });
}

std::vector<paddle::Tensor> SendFirstToken(
    const paddle::Tensor& req_ids, const paddle::Tensor& seq, const paddle::Tensor& finish,
    const paddle::Tensor& token_ids, const OptTensor& logprob, const OptTensor& rank,
    const OptTensor& topk_ids, const OptTensor& topk_logprobs, const OptTensor& draft_ids,
    int64_t step_id, int num_topk, int64_t vocab_size, int64_t instance_tag, int rank_id, int send_rank,
    int transport, const std::string& queue, int64_t sysv_key, const std::string& ring,
    int64_t max_msg_bytes, int64_t max_pending_bytes, bool chunked) {
  if (rank_id != send_rank) return {StatusTensor({})};
  return Guard([&] {
    StepTensors step = MakeStep(req_ids, seq, finish, token_ids, logprob, rank, topk_ids, topk_logprobs,
                                draft_ids, num_topk, vocab_size);
    PD_CHECK(token_ids.numel() == step.num_slots, "first-token token_ids must be [B]");
    const std::vector<int32_t> ones(step.num_slots, 1);  // one token per request
    step.num_tokens = {ones.data(), false};
    return PackAndSend(step, Meta(mtp_wire::kKindFirstToken, step_id, instance_tag),
                       Address(transport, queue, sysv_key, ring, max_msg_bytes, max_pending_bytes, chunked));
  });
}

std::vector<paddle::Tensor> PackOutput(
    const paddle::Tensor& req_ids, const paddle::Tensor& seq, const paddle::Tensor& num_tokens,
    const paddle::Tensor& finish, const paddle::Tensor& token_ids, const OptTensor& logprob,
    const OptTensor& rank, const OptTensor& topk_ids, const OptTensor& topk_logprobs,
    const OptTensor& draft_ids, int kind, int64_t step_id, int num_topk, int64_t vocab_size,
    int64_t instance_tag) {
  return Guard([&] {
    StepTensors step = MakeStep(req_ids, seq, finish, token_ids, logprob, rank, topk_ids, topk_logprobs,
                                draft_ids, num_topk, vocab_size);
    CheckSlots(num_tokens, step.num_slots, "num_tokens");
    step.num_tokens = Ints(num_tokens, "num_tokens");
    std::vector<uint8_t> payload;
    auto header = mtp_out::PackTokenFrame(step, Meta(kind, step_id, instance_tag), &payload);
    mtp_out::SealHeader(&header);
    const int64_t size = mtp_wire::kHeaderSize + payload.size();
    auto out = paddle::empty({size}, paddle::DataType::UINT8, paddle::CPUPlace());
    std::memcpy(out.data<uint8_t>(), &header, mtp_wire::kHeaderSize);
    if (!payload.empty()) std::memcpy(out.data<uint8_t>() + mtp_wire::kHeaderSize, payload.data(), payload.size());
    return std::vector<paddle::Tensor>{out};
  });
}

std::vector<paddle::Tensor> SendControl(const paddle::Tensor& x, int code, const std::string& message,
                                        int64_t step_id, int64_t instance_tag, int rank_id, int send_rank,
                                        int transport, const std::string& queue, int64_t sysv_key,
                                        const std::string& ring, int64_t max_msg_bytes,
                                        int64_t max_pending_bytes, bool chunked) {
  if (rank_id != send_rank) return {StatusTensor({})};
  return Guard([&] {
    std::vector<uint8_t> payload;
    const auto header = mtp_out::PackControlFrame(code, message, Meta(mtp_wire::kKindControl, step_id, instance_tag), &payload);
    auto* channel = mtp_out::OutputChannel::Get(
        Address(transport, queue, sysv_key, ring, max_msg_bytes, max_pending_bytes, chunked));
    return std::vector<paddle::Tensor>{StatusTensor(channel->Submit(header, payload))};
  });
}

std::vector<paddle::Tensor> FlushOutput(const paddle::Tensor& x, int rank_id, int send_rank, int transport,
                                        const std::string& queue, int64_t sysv_key, const std::string& ring,
                                        int64_t max_msg_bytes, int64_t max_pending_bytes, bool chunked) {
  if (rank_id != send_rank) return {StatusTensor({})};
  return Guard([&] {
    auto* channel = mtp_out::OutputChannel::Get(
        Address(transport, queue, sysv_key, ring, max_msg_bytes, max_pending_bytes, chunked));
    return std::vector<paddle::Tensor>{StatusTensor(channel->Flush())};
  });
}

std::vector<paddle::Tensor> CloseOutput(const paddle::Tensor& x, const std::string& ring) {
  return {StatusTensor(mtp_out::OutputChannel::Close(ring))};
}

}  // namespace

PD_BUILD_OP(mtp_output_send)
    .Inputs({"req_ids", "seq", "num_tokens", "finish", "token_ids", paddle::Optional("logprob"),
             paddle::Optional("rank"), paddle::Optional("topk_ids"), paddle::Optional("topk_logprobs"),
             paddle::Optional("draft_ids")})
    .Outputs({"status"})
    .Attrs({"kind: int", "step_id: int64_t", "num_topk: int", "vocab_size: int64_t", "instance_tag: int64_t",
            MTP_ADDRESS_ATTRS})
    .SetKernelFn(PD_KERNEL(SendOutput));

PD_BUILD_OP(mtp_output_send_first_token)
    .Inputs({"req_ids", "seq", "finish", "token_ids", paddle::Optional("logprob"), paddle::Optional("rank"),
             paddle::Optional("topk_ids"), paddle::Optional("topk_logprobs"), paddle::Optional("draft_ids")})
    .Outputs({"status"})
    .Attrs({"step_id: int64_t", "num_topk: int", "vocab_size: int64_t", "instance_tag: int64_t",
            MTP_ADDRESS_ATTRS})
    .SetKernelFn(PD_KERNEL(SendFirstToken));

PD_BUILD_OP(mtp_output_pack)
    .Inputs({"req_ids", "seq", "num_tokens", "finish", "token_ids", paddle::Optional("logprob"),
             paddle::Optional("rank"), paddle::Optional("topk_ids"), paddle::Optional("topk_logprobs"),
             paddle::Optional("draft_ids")})
    .Outputs({"frame"})
    .Attrs({"kind: int", "step_id: int64_t", "num_topk: int", "vocab_size: int64_t", "instance_tag: int64_t"})
    .SetKernelFn(PD_KERNEL(PackOutput));

PD_BUILD_OP(mtp_output_control)
    .Inputs({"x"})
    .Outputs({"status"})
    .Attrs({"code: int", "message: std::string", "step_id: int64_t", "instance_tag: int64_t", MTP_ADDRESS_ATTRS})
    .SetKernelFn(PD_KERNEL(SendControl));

PD_BUILD_OP(mtp_output_flush)
    .Inputs({"x"})
    .Outputs({"status"})
    .Attrs({MTP_ADDRESS_ATTRS})
    .SetKernelFn(PD_KERNEL(FlushOutput));

PD_BUILD_OP(mtp_output_close)
    .Inputs({"x"})
    .Outputs({"status"})
    .Attrs({"ring: std::string"})
    .SetKernelFn(PD_KERNEL(CloseOutput));
