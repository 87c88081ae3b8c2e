// The sending end of an output channel: a SysV or POSIX queue plus a shared-memory ring.
//
// Back-pressure policy (also stated in ipc/output_channel.py):
//   1. Submit never blocks: every queue send uses IPC_NOWAIT / O_NONBLOCK.
//   2. A frame that cannot go out now (ring full, queue full) waits in a FIFO inside this object;
//      later frames queue behind it, so order is kept. Nothing is ever dropped.
//   3. Every call returns the status (frames pending, bytes pending, ...). While frames are pending
//      the engine must pause scheduling new work and call Flush until the count is zero.
//   4. The FIFO is bounded by max_pending_bytes; a submit past the bound throws (the engine ignored
//      step 3), loudly, instead of dropping or growing without limit.
//   5. A channel that was removed (the reader's side is gone: ring marked closed, or the queue
//      removed) throws from submit and flush: the engine stops instead of sending into the void.
#pragma once
#include <mqueue.h>

#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "mtp_wire.h"

namespace mtp_out {

// Where a channel lives; all of it comes from the caller (ops read no environment).
struct ChannelAddress {
  int transport = mtp_wire::kTransportPosix;
  std::string queue_name;          // POSIX queue name ("/...")
  int64_t sysv_key = -1;           // SysV key (transport SysV)
  std::string ring_name;           // POSIX shm name of the ring ("/...")
  int64_t max_msg_bytes = 8192;    // bytes per queue message (stock kernel: 8192)
  int64_t max_pending_bytes = 64 << 20;
  bool chunked = false;            // large frames as chunks instead of through the ring
};

struct ChannelStatus {
  int64_t frames_pending = 0;
  int64_t bytes_pending = 0;
  int64_t frames_sent = 0;         // total since attach
  int64_t frames_deferred = 0;     // total frames that could not go out on submit
};

class OutputChannel {
 public:
  // The process-wide channel for address.ring_name, attached on first use.
  static OutputChannel* Get(const ChannelAddress& address);
  // Detaches (unmaps, closes) the channel; returns its last status (pending frames are lost, so the
  // caller reports them).
  static ChannelStatus Close(const std::string& ring_name);

  // Sends the frame now if nothing is pending and there is room; otherwise (or for what did not go
  // out) copies the payload into the FIFO. payload is only read during the call.
  ChannelStatus Submit(mtp_wire::FrameHeader header, const std::vector<uint8_t>& payload);
  ChannelStatus Flush();
  ~OutputChannel();

 private:
  struct Pending {
    mtp_wire::FrameHeader header;
    std::vector<uint8_t> payload;  // empty once placed in the ring
    bool in_ring = false;      // payload travels through the ring
    bool placed = false;       // payload already copied into the ring
    uint16_t next_chunk = 0;   // next queue message to send
  };

  explicit OutputChannel(const ChannelAddress& address);
  void OpenRing();
  void OpenQueue();
  void CheckOpen() const;
  ChannelStatus FlushLocked();
  bool Advance(Pending* p, const uint8_t* payload);
  bool PlaceInRing(Pending* p, const uint8_t* payload);
  bool SendDescriptorRun();
  void PopSent(size_t count);
  bool SendMessage(mtp_wire::FrameHeader header, const uint8_t* body, size_t size);
  bool SendBytes(const uint8_t* data, size_t size);  // false when the queue is full
  ChannelStatus StatusLocked() const;

  ChannelAddress address_;
  mtp_wire::RingHeader* ring_ = nullptr;
  uint8_t* ring_data_ = nullptr;
  size_t ring_map_bytes_ = 0;
  int sysv_id_ = -1;
  mqd_t mq_ = static_cast<mqd_t>(-1);
  std::deque<Pending> pending_;
  int64_t pending_bytes_ = 0;
  int64_t frames_sent_ = 0;
  int64_t frames_deferred_ = 0;
  std::vector<uint8_t> message_;      // header + body, reused
  std::vector<uint8_t> descriptors_;  // a run of ring-frame headers, reused
  std::vector<uint8_t> sysv_buf_;     // mtype + message, reused
  std::mutex mu_;
};

}  // namespace mtp_out
