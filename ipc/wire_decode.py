"""Validating decoder of the wire format (ipc/wire.py). Every check failure is a WireError with a
short `reason`, which the reader counts; nothing here trusts a length before checking it."""

from __future__ import annotations

import collections
import struct
import zlib

import numpy as np

from mtpserve.ipc import wire
from mtpserve.ipc.token_frame import ControlMessage, Frame, TokenFrame

_FORMAT = {"u1": "B", "u2": "H", "u4": "I", "u8": "Q"}
HEADER_STRUCT = struct.Struct("<" + "".join(_FORMAT[t.lstrip("<")] for _, t in wire.HEADER_FIELDS))
FrameHeader = collections.namedtuple("FrameHeader", [n for n, _ in wire.HEADER_FIELDS])
_CRC_AT = wire.field_offset(wire.HEADER_DTYPE, "header_crc")
_ZERO4 = bytes(4)
_KINDS = frozenset(int(k) for k in wire.Kind)
_CONTROL_CODES = frozenset(int(c) for c in wire.ControlCode)
# NOTE: plain ints, because enum flag arithmetic costs microseconds on the hot path.
_LOGPROBS, _IN_RING, _UNKNOWN_FLAGS = int(wire.Flag.LOGPROBS), int(wire.Flag.IN_RING), ~wire.KNOWN_FLAGS
_MAX_FINISH = int(max(wire.Finish))
_CONTROL_KIND = int(wire.Kind.CONTROL)


class WireError(ValueError):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def header_crc(head: bytes | memoryview) -> int:
    """crc32 of the 64 header bytes with the header_crc field taken as zero."""
    crc = zlib.crc32(head[:_CRC_AT])
    crc = zlib.crc32(_ZERO4, crc)
    return zlib.crc32(head[_CRC_AT + 4:wire.HEADER_SIZE], crc)


def _check(ok: bool, reason: str, detail: str = "") -> None:
    if not ok:
        raise WireError(reason, detail)


def decode_header(message: bytes | memoryview) -> FrameHeader:
    """Parse and validate the header at the start of one queue message."""
    _check(len(message) >= wire.HEADER_SIZE, "truncated", f"{len(message)} bytes")
    h = FrameHeader._make(HEADER_STRUCT.unpack_from(message))
    _check(h.magic == wire.MAGIC, "magic")
    _check(h.version == wire.VERSION, "version", str(h.version))
    _check(h.header_crc == header_crc(message), "header_crc")
    _check(h.kind in _KINDS, "kind", str(h.kind))
    _check(h.flags & _UNKNOWN_FLAGS == 0, "flags", hex(h.flags))
    _check_widths(h)
    _check_transport(h, len(message))
    return h


def _check_widths(h: FrameHeader) -> None:
    _check(h.num_reqs <= wire.MAX_REQS, "bounds", "num_reqs")
    _check(h.num_tokens <= h.num_reqs * wire.MAX_TOKENS_PER_REQ, "bounds", "num_tokens")
    _check(h.topk <= wire.MAX_TOPK, "bounds", "topk")
    _check(h.topk == 0 or h.flags & _LOGPROBS, "bounds", "topk without logprobs")
    _check(h.draft_width <= wire.MAX_DRAFT_WIDTH, "bounds", "draft_width")
    _check(h.payload_len <= wire.MAX_PAYLOAD, "bounds", "payload_len")


def _check_transport(h: FrameHeader, size: int) -> None:
    _check(1 <= h.chunk_count and h.chunk_index < h.chunk_count, "chunk", "index/count")
    if h.flags & _IN_RING:
        _check(h.chunk_count == 1 and size == wire.HEADER_SIZE, "chunk", "ring descriptor with a body")
    elif h.chunk_count == 1:
        _check(size == wire.HEADER_SIZE + h.payload_len, "truncated", "inline body length")


def decode_payload(h: FrameHeader, payload: bytes, vocab_size: int | None = None) -> Frame:
    """Check the payload against the header and return views over it."""
    _check(len(payload) == h.payload_len, "truncated", "payload length")
    _check(zlib.crc32(payload) == h.payload_crc, "payload_crc")
    if h.kind == _CONTROL_KIND:
        return _decode_control(h, payload)
    return _decode_tokens(h, payload, vocab_size)


def _decode_control(h: FrameHeader, payload: bytes) -> ControlMessage:
    _check(len(payload) >= wire.CONTROL_PREFIX, "content", "control payload")
    code = int.from_bytes(payload[:4], "little", signed=True)
    _check(code in _CONTROL_CODES, "content", f"control code {code}")
    text = payload[wire.CONTROL_PREFIX:].decode("utf-8", errors="replace")
    return ControlMessage(wire.ControlCode(code), text, h.step_id, h.frame_seq)


def _decode_tokens(h: FrameHeader, payload: bytes, vocab_size: int | None) -> TokenFrame:
    shape = wire.Shape(h.num_reqs, h.num_tokens, h.topk, h.draft_width,
                       bool(h.flags & _LOGPROBS))
    spans, total = wire.layout(shape)
    _check(total == len(payload), "payload_len", f"{len(payload)} != {total}")
    v = {s.name: np.frombuffer(payload, s.dtype, s.num_items, s.offset) for s in spans}
    _check_content(h, v, vocab_size)
    lp = shape.has_logprobs
    return TokenFrame(
        kind=wire.Kind(h.kind), step_id=h.step_id, frame_seq=h.frame_seq,
        req_ids=v["req_ids"], seq=v["seq"], num_tokens=v["num_tokens"], finish=v["finish"],
        token_ids=v["token_ids"], logprob=v["logprob"] if lp else None,
        rank=v["rank"] if lp else None,
        topk_ids=v["topk_ids"].reshape(h.num_tokens, h.topk) if lp else None,
        topk_logprobs=v["topk_logprobs"].reshape(h.num_tokens, h.topk) if lp else None,
        draft_ids=v["draft_ids"].reshape(h.num_reqs, h.draft_width) if h.draft_width else None)


def _check_content(h: FrameHeader, v: dict[str, np.ndarray], vocab_size: int | None) -> None:
    """Vectorised invariants: counts add up, statuses are known, ids lie in the vocabulary.
    NOTE: a uint32 view turns `0 <= x <= hi` into one max() (negatives become huge)."""
    if not h.num_reqs:
        return
    _check(int(v["num_tokens"].view(np.uint32).max()) <= wire.MAX_TOKENS_PER_REQ, "content",
           "num_tokens range")
    _check(int(v["num_tokens"].sum()) == h.num_tokens, "content", "num_tokens sum")
    _check(int(v["finish"].view(np.uint32).max()) <= _MAX_FINISH, "content", "finish status")
    hi = vocab_size if vocab_size is not None else 2**31
    ids = v["token_ids"]
    _check(not ids.size or int(ids.view(np.uint32).max()) < hi, "content", "token_ids range")
    for name in ("topk_ids", "draft_ids"):  # -1 pads: fewer alternatives asked, no draft
        ids = v.get(name)
        if ids is not None and ids.size:
            _check(int((ids.view(np.uint32) + np.uint32(1)).max()) <= hi, "content", f"{name} range")
