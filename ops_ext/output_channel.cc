// The sending end of an output channel; policy in output_channel.h.
#include "output_channel.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/msg.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>

#include "output_frame.h"

namespace mtp_out {
namespace {

using mtp_wire::FrameHeader;

std::runtime_error SysError(const std::string& what) {
  return std::runtime_error(what + ": " + std::strerror(errno));
}

std::mutex& RegistryMutex() {
  static std::mutex mu;
  return mu;
}

std::map<std::string, std::unique_ptr<OutputChannel>>& Registry() {
  static std::map<std::string, std::unique_ptr<OutputChannel>> channels;
  return channels;
}

uint16_t ChunkCount(uint64_t payload_len, uint64_t body_max) {
  const uint64_t n = payload_len == 0 ? 1 : (payload_len + body_max - 1) / body_max;
  if (n > 0xFFFF) throw std::runtime_error("frame needs more than 65535 chunks");
  return static_cast<uint16_t>(n);
}

}  // namespace

OutputChannel* OutputChannel::Get(const ChannelAddress& address) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto& slot = Registry()[address.ring_name];
  if (!slot) slot.reset(new OutputChannel(address));
  return slot.get();
}

ChannelStatus OutputChannel::Close(const std::string& ring_name) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(ring_name);
  if (it == Registry().end()) return {};
  ChannelStatus status;
  {
    std::lock_guard<std::mutex> channel_lock(it->second->mu_);
    status = it->second->StatusLocked();
  }
  Registry().erase(it);
  return status;
}

OutputChannel::OutputChannel(const ChannelAddress& address) : address_(address) {
  if (address_.max_msg_bytes <= static_cast<int64_t>(mtp_wire::kHeaderSize))
    throw std::invalid_argument("max_msg_bytes must exceed the frame header");
  OpenRing();
  OpenQueue();
}

OutputChannel::~OutputChannel() {
  if (ring_) munmap(ring_, ring_map_bytes_);
  if (mq_ != static_cast<mqd_t>(-1)) mq_close(mq_);
}

void OutputChannel::OpenRing() {
  const int fd = shm_open(address_.ring_name.c_str(), O_RDWR, 0);
  if (fd < 0) throw SysError("shm_open " + address_.ring_name);
  struct stat st{};
  const bool sized = fstat(fd, &st) == 0 && st.st_size >= static_cast<off_t>(mtp_wire::kRingHeaderBytes);
  // NOTE: MAP_POPULATE, so frames never pay page faults on a ring that has not wrapped yet.
  void* map = sized ? mmap(nullptr, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0)
                    : MAP_FAILED;
  close(fd);
  if (map == MAP_FAILED) throw SysError("mmap " + address_.ring_name);
  ring_ = static_cast<mtp_wire::RingHeader*>(map);
  ring_map_bytes_ = st.st_size;
  ring_data_ = static_cast<uint8_t*>(map) + mtp_wire::kRingHeaderBytes;
  const bool ok = ring_->magic == mtp_wire::kRingMagic && ring_->version == mtp_wire::kRingVersion &&
                  ring_->capacity + mtp_wire::kRingHeaderBytes <= ring_map_bytes_ &&
                  ring_->transport == address_.transport;
  if (!ok) throw std::runtime_error("ring " + address_.ring_name + " has a foreign or stale header");
}

void OutputChannel::OpenQueue() {
  if (address_.transport == mtp_wire::kTransportSysv) {
    sysv_id_ = msgget(static_cast<key_t>(address_.sysv_key), 0);
    if (sysv_id_ < 0) throw SysError("msgget");
    return;
  }
  mq_ = mq_open(address_.queue_name.c_str(), O_WRONLY | O_NONBLOCK);
  if (mq_ == static_cast<mqd_t>(-1)) throw SysError("mq_open " + address_.queue_name);
  struct mq_attr attr{};
  if (mq_getattr(mq_, &attr) != 0) throw SysError("mq_getattr");
  if (attr.mq_msgsize < address_.max_msg_bytes)
    throw std::invalid_argument("max_msg_bytes exceeds the queue's message size");
}

void OutputChannel::CheckOpen() const {
  // NOTE: a removed POSIX queue stays usable through an open descriptor, so the ring's closed flag
  // (set by the owner before it removes the objects) is what tells the engine nobody reads.
  if (__atomic_load_n(&ring_->closed, __ATOMIC_ACQUIRE))
    throw std::runtime_error("output channel is closed (the HTTP side removed it)");
}

ChannelStatus OutputChannel::Submit(FrameHeader header, const std::vector<uint8_t>& payload) {
  std::lock_guard<std::mutex> lock(mu_);
  CheckOpen();
  if (!pending_.empty() && pending_bytes_ + static_cast<int64_t>(payload.size()) > address_.max_pending_bytes)
    throw std::runtime_error("output back-pressure bound exceeded: the engine must pause while frames are pending");
  const uint64_t body_max = address_.max_msg_bytes - mtp_wire::kHeaderSize;
  Pending p;
  p.in_ring = payload.size() > body_max && !address_.chunked;
  if (p.in_ring && payload.size() > ring_->capacity)  // before it takes a frame_seq or a FIFO slot
    throw std::runtime_error("frame larger than the ring; raise the ring size");
  header.frame_seq = ring_->next_frame_seq++;
  header.chunk_count = p.in_ring ? 1 : ChunkCount(payload.size(), body_max);
  p.header = header;
  if (pending_.empty()) {
    FlushLocked();
    if (pending_.empty() && Advance(&p, payload.data())) {  // fast path: no copy into the FIFO
      ++frames_sent_;
      return StatusLocked();
    }
  }
  if (!p.placed) p.payload = payload;
  pending_bytes_ += p.header.payload_len;
  pending_.push_back(std::move(p));
  ++frames_deferred_;
  return FlushLocked();
}

ChannelStatus OutputChannel::Flush() {
  std::lock_guard<std::mutex> lock(mu_);
  CheckOpen();
  return FlushLocked();
}

ChannelStatus OutputChannel::FlushLocked() {
  while (!pending_.empty()) {
    Pending& front = pending_.front();
    if (front.in_ring) {
      if (!SendDescriptorRun()) break;
      continue;
    }
    if (!Advance(&front, front.payload.data())) break;
    PopSent(1);
  }
  return StatusLocked();
}

// NOTE: under back-pressure the queue, not the ring, is the scarce part (a POSIX queue holds 10
// messages), so the headers of consecutive ring frames share one message (up to 128 of them).
bool OutputChannel::SendDescriptorRun() {
  const size_t max_run = address_.max_msg_bytes / mtp_wire::kHeaderSize;
  size_t run = 0;
  for (; run < pending_.size() && run < max_run; ++run) {
    Pending& p = pending_[run];
    if (!p.in_ring || (!p.placed && !PlaceInRing(&p, p.payload.data()))) break;
  }
  if (run == 0) return false;
  descriptors_.resize(run * mtp_wire::kHeaderSize);
  for (size_t i = 0; i < run; ++i) {
    FrameHeader h = pending_[i].header;
    SealHeader(&h);
    std::memcpy(descriptors_.data() + i * mtp_wire::kHeaderSize, &h, mtp_wire::kHeaderSize);
  }
  if (!SendBytes(descriptors_.data(), descriptors_.size())) return false;
  PopSent(run);
  return true;
}

void OutputChannel::PopSent(size_t count) {
  for (size_t i = 0; i < count; ++i) {
    pending_bytes_ -= pending_.front().header.payload_len;
    pending_.pop_front();
    ++frames_sent_;
  }
}

bool OutputChannel::Advance(Pending* p, const uint8_t* payload) {
  if (p->in_ring) {
    if (!p->placed && !PlaceInRing(p, payload)) return false;
    return SendMessage(p->header, nullptr, 0);
  }
  const uint64_t body_max = address_.max_msg_bytes - mtp_wire::kHeaderSize;
  for (; p->next_chunk < p->header.chunk_count; ++p->next_chunk) {
    const uint64_t start = p->next_chunk * body_max;
    const uint64_t size = std::min<uint64_t>(body_max, p->header.payload_len - start);
    FrameHeader h = p->header;
    h.chunk_index = p->next_chunk;
    if (!SendMessage(h, payload + start, size)) return false;
  }
  return true;
}

bool OutputChannel::PlaceInRing(Pending* p, const uint8_t* payload) {
  const uint64_t size = p->header.payload_len;
  const uint64_t capacity = ring_->capacity;
  if (size > capacity) throw std::runtime_error("frame larger than the ring; raise the ring size");
  uint64_t pos = ring_->write_pos;
  if (pos % capacity + size > capacity) pos += capacity - pos % capacity;  // skip the tail
  const uint64_t read_pos = __atomic_load_n(&ring_->read_pos, __ATOMIC_ACQUIRE);
  if (pos + size - read_pos > capacity) return false;
  std::memcpy(ring_data_ + pos % capacity, payload, size);
  __atomic_store_n(&ring_->write_pos, pos + size, __ATOMIC_RELEASE);
  p->header.ring_pos = pos;
  p->header.flags = static_cast<uint8_t>((p->header.flags | mtp_wire::kFlagInRing) & mtp_wire::kKnownFlags);
  p->placed = true;
  std::vector<uint8_t>().swap(p->payload);
  return true;
}

bool OutputChannel::SendMessage(FrameHeader header, const uint8_t* body, size_t size) {
  SealHeader(&header);
  message_.resize(mtp_wire::kHeaderSize + size);
  std::memcpy(message_.data(), &header, mtp_wire::kHeaderSize);
  if (size) std::memcpy(message_.data() + mtp_wire::kHeaderSize, body, size);
  return SendBytes(message_.data(), message_.size());
}

bool OutputChannel::SendBytes(const uint8_t* data, size_t size) {
  const bool sysv = address_.transport == mtp_wire::kTransportSysv;
  if (sysv) {  // SysV messages start with a long mtype
    sysv_buf_.resize(sizeof(long) + size);
    const long mtype = 1;
    std::memcpy(sysv_buf_.data(), &mtype, sizeof(long));
    std::memcpy(sysv_buf_.data() + sizeof(long), data, size);
  }
  for (;;) {
    const int rc = sysv ? msgsnd(sysv_id_, sysv_buf_.data(), size, IPC_NOWAIT)
                        : mq_send(mq_, reinterpret_cast<const char*>(data), size, 0);
    if (rc == 0) return true;
    if (errno == EAGAIN) return false;
    if (errno == EINTR) continue;
    if (errno == EIDRM || errno == EINVAL || errno == EBADF)
      throw SysError("output queue is gone (the HTTP side removed it)");
    throw SysError("output queue send");
  }
}

ChannelStatus OutputChannel::StatusLocked() const {
  ChannelStatus s;
  s.frames_pending = static_cast<int64_t>(pending_.size());
  s.bytes_pending = pending_bytes_;
  s.frames_sent = frames_sent_;
  s.frames_deferred = frames_deferred_;
  return s;
}

}  // namespace mtp_out
