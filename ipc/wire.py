"""The engine -> HTTP output wire format: the one definition (C++ mirror: ops_ext/mtp_wire.h).

A *frame* is a 64-byte header followed by a payload. Everything is little-endian. The payload of a
token frame (kinds TARGET, DRAFT, FIRST_TOKEN) is a list of *sections*, each an array padded to 8 bytes,
sized from the header's real batch B, real token count N, real top-k width K and draft width D:

    req_ids i64[B] · seq u32[B] · num_tokens i32[B] · finish i32[B] · token_ids i32[N]
    [logprob f32[N] · rank i32[N] · topk_ids i32[N*K] · topk_logprobs f32[N*K]]   (FLAG_LOGPROBS)
    draft_ids i32[B*D]                                                             (D > 0)

Requests are in frame order; request i owns tokens [cu[i], cu[i] + num_tokens[i]) with cu the exclusive
prefix sum of num_tokens. `seq[i]` is the number of tokens of request i sent before this frame, so a
reader proves nothing was lost or duplicated by checking seq == tokens seen so far.

A CONTROL frame's payload is `code i32 · reserved u32 · UTF-8 message`.

Transport (see ipc/output_channel.py): one queue message = a header + its bytes. A frame whose payload
fits one message travels inline; a larger one either lives in the shared-memory ring (FLAG_IN_RING,
`ring_pos` says where; the message is only the header: a descriptor, and one message may carry a run
of up to max_msg_bytes / 64 descriptors) or is split into chunks (`chunk_index`/`chunk_count`, one
header copy per chunk).

C++ mirrors this file through the generated header (python -m mtpserve.ipc.wire_cgen); a test fails
when the checked-in header differs from what this module generates.
"""

from __future__ import annotations

import enum
import functools
from typing import NamedTuple

import numpy as np

MAGIC = 0x4650544D  # b"MTPF" read as little-endian u32
VERSION = 1
RING_MAGIC = 0x5250544D  # b"MTPR"
RING_VERSION = 1
SECTION_ALIGN = 8


class Kind(enum.IntEnum):
    TARGET = 1  # verified (emitted) tokens of a step
    DRAFT = 2  # draft proposals with draft logprobs, paired with TARGET by (req_id, seq)
    FIRST_TOKEN = 3  # the first token from a prefill instance (PD), plus its MTP drafts
    CONTROL = 4  # engine error / stop


class Flag(enum.IntFlag):
    LOGPROBS = 0x01  # the four logprob sections are present (only when N > 0)
    IN_RING = 0x02  # the payload is in the shared-memory ring at header.ring_pos


KNOWN_FLAGS = int(Flag.LOGPROBS | Flag.IN_RING)


class Finish(enum.IntEnum):
    """Per-request status after this frame's tokens."""

    RUNNING = 0
    STOP = 1  # EOS or a stop token
    LENGTH = 2  # max_tokens / context limit
    ABORT = 3  # cancelled by the client or the router
    PREEMPTED = 4  # evicted; it will be rescheduled and resume at the same seq
    ERROR = 5  # failed inside the engine


class ControlCode(enum.IntEnum):
    ENGINE_ERROR = 1  # the engine hit an error it cannot recover from; message says which
    ENGINE_STOP = 2  # the engine stops cleanly; no frame follows


# Bounds checked by the packer (C++ throws) and by the decoder (frame rejected).
MAX_REQS = 8192
MAX_TOKENS_PER_REQ = 64
MAX_TOPK = 20
MAX_DRAFT_WIDTH = 16
MAX_CONTROL_MESSAGE = 4000
MAX_PAYLOAD = 1 << 30

# NOTE: field order gives natural alignment with no padding; the C++ struct is generated from this.
HEADER_FIELDS: tuple[tuple[str, str], ...] = (
    ("magic", "<u4"),
    ("version", "<u2"),
    ("kind", "u1"),
    ("flags", "u1"),
    ("header_crc", "<u4"),  # crc32 of the 64 header bytes with this field zeroed
    ("instance_tag", "<u4"),  # low 32 bits of the instance hash; frames of another instance rejected
    ("step_id", "<u8"),
    ("frame_seq", "<u8"),  # channel-wide frame counter: gaps and repeats are detected
    ("num_reqs", "<u4"),
    ("num_tokens", "<u4"),
    ("topk", "<u2"),
    ("draft_width", "<u2"),
    ("chunk_index", "<u2"),
    ("chunk_count", "<u2"),
    ("payload_len", "<u4"),  # bytes of the whole payload (all chunks)
    ("payload_crc", "<u4"),  # crc32 of the whole payload
    ("ring_pos", "<u8"),  # monotonic ring byte position of the payload when IN_RING, else 0
)
HEADER_DTYPE = np.dtype([(n, t) for n, t in HEADER_FIELDS])
HEADER_SIZE = HEADER_DTYPE.itemsize
assert HEADER_SIZE == 64, HEADER_SIZE

# The shared-memory ring's first page. Writer-owned and reader-owned positions sit on separate cache
# lines. Owner fields identify the process that created the channel, for stale-object detection.
RING_FIELDS: tuple[tuple[str, str], ...] = (
    ("magic", "<u4"),
    ("version", "<u2"),
    ("transport", "<u2"),  # Transport value
    ("capacity", "<u8"),  # data bytes after the header page
    ("owner_pid", "<i8"),
    ("owner_start", "<u8"),  # owner's start time in clock ticks since boot (/proc/<pid>/stat 22)
    ("sysv_key", "<i8"),  # the SysV key in use, -1 for POSIX
    ("max_msg_bytes", "<u8"),  # bytes per queue message the queue was created with
    ("instance_tag", "<u4"),
    ("closed", "<u4"),  # set to 1 by remove(): readers that still map the ring mark the engine dead
    ("chunked", "<u4"),  # 1: large frames travel as queue chunks, the ring is unused
    ("pad0", "<u4"),
    ("write_pos", "<u8"),  # offset 64: bytes ever reserved by the writer (monotonic)
    ("next_frame_seq", "<u8"),  # frame_seq the next frame gets; survives an engine restart
    ("pad1", "<u8"),
    ("pad2", "<u8"),
    ("pad3", "<u8"),
    ("pad4", "<u8"),
    ("pad5", "<u8"),
    ("pad6", "<u8"),
    ("read_pos", "<u8"),  # offset 128: bytes released by the reader (monotonic)
)
RING_DTYPE = np.dtype([(n, t) for n, t in RING_FIELDS])
RING_HEADER_BYTES = 4096  # the data area starts one page in


class Transport(enum.IntEnum):
    SYSV = 1
    POSIX = 2


class CountKind(enum.IntEnum):
    PER_REQ = 0  # B
    PER_TOKEN = 1  # N
    PER_TOKEN_TOPK = 2  # N * K
    PER_REQ_DRAFT = 3  # B * D


class Section(NamedTuple):
    name: str
    dtype: str
    count_kind: CountKind
    needs_logprobs: bool


SECTIONS: tuple[Section, ...] = (
    Section("req_ids", "<i8", CountKind.PER_REQ, False),
    Section("seq", "<u4", CountKind.PER_REQ, False),
    Section("num_tokens", "<i4", CountKind.PER_REQ, False),
    Section("finish", "<i4", CountKind.PER_REQ, False),
    Section("token_ids", "<i4", CountKind.PER_TOKEN, False),
    Section("logprob", "<f4", CountKind.PER_TOKEN, True),
    Section("rank", "<i4", CountKind.PER_TOKEN, True),
    Section("topk_ids", "<i4", CountKind.PER_TOKEN_TOPK, True),  # -1: padding
    Section("topk_logprobs", "<f4", CountKind.PER_TOKEN_TOPK, True),
    Section("draft_ids", "<i4", CountKind.PER_REQ_DRAFT, False),
)
CONTROL_PREFIX = 8  # code i32 + reserved u32


class Shape(NamedTuple):
    num_reqs: int  # B
    num_tokens: int  # N
    topk: int  # K
    draft_width: int  # D
    has_logprobs: bool


class SectionSpan(NamedTuple):
    name: str
    dtype: np.dtype
    offset: int
    num_items: int


def _count(kind: CountKind, shape: Shape) -> int:
    return (shape.num_reqs, shape.num_tokens, shape.num_tokens * shape.topk,
            shape.num_reqs * shape.draft_width)[kind]


def pad8(n: int) -> int:
    return (n + SECTION_ALIGN - 1) & ~(SECTION_ALIGN - 1)


@functools.lru_cache(maxsize=256)  # steady decoding repeats a few shapes
def layout(shape: Shape) -> tuple[tuple[SectionSpan, ...], int]:
    """Spans of the present sections and the payload length, for a token frame of `shape`."""
    spans, offset = [], 0
    for sec in SECTIONS:
        if sec.needs_logprobs and not shape.has_logprobs:
            continue
        dtype = np.dtype(sec.dtype)
        count = _count(sec.count_kind, shape)
        spans.append(SectionSpan(sec.name, dtype, offset, count))
        offset += pad8(count * dtype.itemsize)
    return tuple(spans), offset


def field_offset(dtype: np.dtype, name: str) -> int:
    """Byte offset of one field of a structured dtype (HEADER_DTYPE, RING_DTYPE)."""
    fields = dtype.fields
    assert fields is not None, f"{dtype} is not a structured dtype"
    return int(next(value for key, value in fields.items() if key == name)[1])
