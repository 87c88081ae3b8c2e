"""From queue messages to validated frames: chunk reassembly, ring copy-out, ordering, counting.

Thread-agnostic and never raising on bad input: a message that fails a check is counted under its
reason in `stats.rejected` and dropped by the reader, which survives it. Frame order is checked with
the channel-wide frame_seq: a repeat or a step back is rejected, a jump forward is counted as lost
frames (the frames in between were rejected earlier) and the reader resynchronises.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass, field

from mtpserve.ipc import wire
from mtpserve.ipc.seq_tracker import SeqTracker
from mtpserve.ipc.shm_ring import RingError, ShmRing
from mtpserve.ipc.token_frame import Frame, TokenFrame
from mtpserve.ipc.wire_decode import FrameHeader, WireError, decode_header, decode_payload

_SEQ_KINDS = (wire.Kind.TARGET, wire.Kind.FIRST_TOKEN)
_IN_RING = int(wire.Flag.IN_RING)
_FLAGS_AT = wire.field_offset(wire.HEADER_DTYPE, "flags")


@dataclass
class ReaderStats:
    messages: int = 0
    frames: int = 0
    payload_bytes: int = 0
    frames_lost: int = 0  # frame_seq gaps
    seq_errors: int = 0  # request rows whose seq was not the expected one
    rejected: collections.Counter = field(default_factory=collections.Counter)  # reason -> count


class FrameAssembler:
    """Feeds on raw queue messages (header + body) and returns whole, validated frames."""

    def __init__(self, instance_tag: int, ring: ShmRing | None = None, *,
                 vocab_size: int | None = None, tracker: SeqTracker | None = None) -> None:
        self.instance_tag = instance_tag
        self.ring = ring
        self.vocab_size = vocab_size
        self.tracker = tracker
        self.stats = ReaderStats()
        self._next_seq: int | None = None
        self._chunk_head: FrameHeader | None = None
        self._chunks: list[bytes] = []

    def feed(self, message: bytes) -> list[Frame]:
        """The frames one queue message completes: it holds one inline frame, one chunk, or a run
        of ring descriptors (64-byte headers). Rejected parts are counted, never raised."""
        self.stats.messages += 1
        if len(message) > wire.HEADER_SIZE and message[_FLAGS_AT] & _IN_RING:
            if len(message) % wire.HEADER_SIZE:
                self.stats.rejected["truncated"] += 1
                return []
            parts = (message[i:i + wire.HEADER_SIZE] for i in range(0, len(message), wire.HEADER_SIZE))
            return [f for f in map(self._feed_one, parts) if f is not None]
        frame = self._feed_one(message)
        return [] if frame is None else [frame]

    def _feed_one(self, message: bytes) -> Frame | None:
        try:
            return self._feed(message)
        except WireError as e:
            self.stats.rejected[e.reason] += 1
        except RingError:
            self.stats.rejected["ring"] += 1
        return None

    def _feed(self, message: bytes) -> Frame | None:
        h = decode_header(message)
        if h.instance_tag != self.instance_tag:
            raise WireError("instance")
        payload = self._payload(h, message)
        if payload is None:
            return None
        self._check_order(h)
        frame = decode_payload(h, payload, self.vocab_size)
        self._next_seq = h.frame_seq + 1
        self.stats.frames += 1
        self.stats.payload_bytes += len(payload)
        return self._track(frame)

    def _payload(self, h: FrameHeader, message: bytes) -> bytes | None:
        if h.flags & _IN_RING:
            return self._from_ring(h)
        if h.chunk_count == 1:
            return message[wire.HEADER_SIZE:]
        return self._add_chunk(h, message[wire.HEADER_SIZE:])

    def _from_ring(self, h: FrameHeader) -> bytes:
        if self.ring is None or not self.ring.capacity:
            raise WireError("ring", "ring descriptor on a channel without a ring")
        if self._next_seq is not None and h.frame_seq < self._next_seq:
            raise WireError("order", "repeated ring descriptor")
        payload = self.ring.take(h.ring_pos, h.payload_len)
        self.ring.release(h.ring_pos + h.payload_len)  # copied out: the writer may reuse it
        return payload

    def _add_chunk(self, h: FrameHeader, body: bytes) -> bytes | None:
        head = self._chunk_head
        if h.chunk_index == 0:
            if head is not None:
                self.stats.rejected["chunk"] += 1  # the previous frame never completed
            self._chunk_head, self._chunks = h, [body]
        elif head is None or not _same_frame(head, h) or h.chunk_index != len(self._chunks):
            self._chunk_head, self._chunks = None, []
            raise WireError("chunk", "chunk out of order")
        else:
            self._chunks.append(body)
        if len(self._chunks) < h.chunk_count:
            return None
        payload = b"".join(self._chunks)
        self._chunk_head, self._chunks = None, []
        return payload

    def _check_order(self, h: FrameHeader) -> None:
        if self._next_seq is None:
            return
        if h.frame_seq < self._next_seq:
            raise WireError("order", f"frame_seq {h.frame_seq} < {self._next_seq}")
        self.stats.frames_lost += h.frame_seq - self._next_seq

    def _track(self, frame: Frame) -> Frame:
        if self.tracker is None or not isinstance(frame, TokenFrame) or frame.kind not in _SEQ_KINDS:
            return frame
        ok = self.tracker.check(frame)
        errors = int(ok.size - ok.sum())
        self.stats.seq_errors += errors
        return dataclasses.replace(frame, seq_ok=ok) if errors else frame


def _same_frame(a: FrameHeader, b: FrameHeader) -> bool:
    return (a.frame_seq, a.kind, a.payload_len, a.payload_crc, a.chunk_count) == \
        (b.frame_seq, b.kind, b.payload_len, b.payload_crc, b.chunk_count)
