"""Reference encoder of the wire format in NumPy: the C++ packer must produce the same bytes
(tests/ops compare them), and tests and the fuzzer build frames with it. Not on the engine's path."""

from __future__ import annotations

from collections.abc import Mapping

import zlib

import numpy as np

from mtpserve.ipc import wire
from mtpserve.ipc.wire_decode import HEADER_STRUCT, header_crc


def encode_header(**fields: int) -> bytes:
    """The 64 header bytes with header_crc filled in; unnamed fields are 0 (chunk_count 1)."""
    values = {n: 0 for n, _ in wire.HEADER_FIELDS} | {"magic": wire.MAGIC, "version": wire.VERSION,
                                                       "chunk_count": 1} | fields
    head = HEADER_STRUCT.pack(*(values[n] for n, _ in wire.HEADER_FIELDS))
    values["header_crc"] = header_crc(head)
    return HEADER_STRUCT.pack(*(values[n] for n, _ in wire.HEADER_FIELDS))


def encode_payload(arrays: Mapping[str, np.ndarray | None], shape: wire.Shape) -> bytes:
    """`arrays` by section name; a section the shape has no room for may be None."""
    spans, total = wire.layout(shape)
    out = np.zeros(total, np.uint8)
    for s in spans:
        given = arrays.get(s.name)
        data = np.ascontiguousarray([] if given is None else given, dtype=s.dtype).reshape(-1)
        assert data.size == s.num_items, (s.name, data.size, s.num_items)
        out[s.offset:s.offset + data.nbytes] = data.view(np.uint8)
    return out.tobytes()


def encode_token_frame(kind: wire.Kind, *, req_ids, seq, num_tokens, finish, token_ids,
                       logprob=None, rank=None, topk_ids=None, topk_logprobs=None, draft_ids=None,
                       step_id: int = 0, frame_seq: int = 0, instance_tag: int = 0) -> bytes:
    """One unchunked token frame (header + payload). topk_ids/topk_logprobs: [N, K]."""
    lp = logprob is not None and int(np.sum(num_tokens)) > 0  # no tokens: no logprob sections
    k = int(np.shape(topk_ids)[1]) if lp and topk_ids is not None else 0
    d = int(np.shape(draft_ids)[1]) if draft_ids is not None else 0
    shape = wire.Shape(len(req_ids), int(np.sum(num_tokens)), k, d, lp)
    arrays = dict(req_ids=req_ids, seq=seq, num_tokens=num_tokens, finish=finish,
                  token_ids=token_ids, logprob=logprob, rank=rank, topk_ids=topk_ids,
                  topk_logprobs=topk_logprobs, draft_ids=draft_ids)
    payload = encode_payload(arrays, shape)
    head = encode_header(kind=int(kind), flags=int(wire.Flag.LOGPROBS) if lp else 0,
                         instance_tag=instance_tag, step_id=step_id, frame_seq=frame_seq,
                         num_reqs=shape.num_reqs, num_tokens=shape.num_tokens, topk=k,
                         draft_width=d, payload_len=len(payload), payload_crc=zlib.crc32(payload))
    return head + payload


def encode_control(code: wire.ControlCode, message: str, *, step_id: int = 0, frame_seq: int = 0,
                   instance_tag: int = 0) -> bytes:
    text = message.encode()[:wire.MAX_CONTROL_MESSAGE]
    payload = int(code).to_bytes(4, "little", signed=True) + bytes(4) + text
    head = encode_header(kind=int(wire.Kind.CONTROL), instance_tag=instance_tag, step_id=step_id,
                         frame_seq=frame_seq, payload_len=len(payload),
                         payload_crc=zlib.crc32(payload))
    return head + payload
