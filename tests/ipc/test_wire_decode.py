"""Encode/decode round trips and every rejection reason of the decoder."""

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtpserve.ipc import wire
from mtpserve.ipc.wire_decode import WireError, decode_header, decode_payload
from mtpserve.ipc.wire_encode import encode_control, encode_header, encode_token_frame
from mtpserve.ipc.token_frame import Frame
from wire_strategies import RandomStep, assert_frame_matches, control, make_step, steps, token_frame


def encode(step: RandomStep, **kw) -> bytes:
    return encode_token_frame(wire.Kind.TARGET, req_ids=step.req_ids, seq=step.seq,
                              num_tokens=step.num_tokens, finish=step.finish,
                              token_ids=step.token_ids, logprob=step.logprob, rank=step.rank,
                              topk_ids=step.topk_ids, topk_logprobs=step.topk_logprobs, **kw)


def decode(frame: bytes) -> Frame:
    h = decode_header(frame)
    return decode_payload(h, frame[wire.HEADER_SIZE:])


@settings(max_examples=60, deadline=None)
@given(steps())
def test_round_trip_is_bit_exact(step):
    frame = token_frame(decode(encode(step, step_id=9, frame_seq=4)))
    assert (frame.kind, frame.step_id, frame.frame_seq) == (wire.Kind.TARGET, 9, 4)
    assert_frame_matches(frame, step)


def test_only_the_real_width_travels():
    narrow = encode(make_step(1, 128, 4, 5, True, min_tokens=4))
    wide = encode(make_step(1, 128, 4, 20, True, min_tokens=4))
    assert len(wide) - len(narrow) == 15 * 512 * 8  # 15 more columns of (i32 id, f32 logprob)


def test_requests_split_by_batch_conversion():
    step = make_step(3, 4, 3, 2, True)
    reqs = token_frame(decode(encode(step))).requests()
    cu = np.concatenate([[0], np.cumsum(step.num_tokens)])
    assert [r.req_id for r in reqs] == step.req_ids.tolist()
    assert reqs[2].token_ids == step.token_ids[cu[2]:cu[3]].tolist()
    assert step.topk_ids is not None and reqs[2].top_ids == step.topk_ids[cu[2]:cu[3]].tolist()


def test_control_round_trip():
    frame = control(decode(encode_control(wire.ControlCode.ENGINE_ERROR, "out of KV blocks", step_id=3)))
    assert frame.code is wire.ControlCode.ENGINE_ERROR and frame.message == "out of KV blocks"


def _reseal(frame: bytes, **fields) -> bytes:
    """The frame with header fields replaced and a valid header crc (payload untouched)."""
    h = decode_header(frame)._asdict() | fields
    h.pop("header_crc")
    return encode_header(**h) + frame[wire.HEADER_SIZE:]


GOOD = encode(make_step(5, 3, 2, 3, True))


@pytest.mark.parametrize("fields, reason", [
    ({"magic": 0x12345678}, "magic"),
    ({"version": wire.VERSION + 1}, "version"),
    ({"kind": 9}, "kind"),
    ({"flags": 0x80 | wire.Flag.LOGPROBS}, "flags"),
    ({"topk": wire.MAX_TOPK + 1}, "bounds"),
    ({"num_reqs": wire.MAX_REQS + 1}, "bounds"),
    ({"draft_width": wire.MAX_DRAFT_WIDTH + 1}, "bounds"),
    ({"chunk_index": 1}, "chunk"),
    ({"payload_len": len(GOOD)}, "truncated"),
])
def test_bad_headers_are_rejected_with_their_reason(fields, reason):
    with pytest.raises(WireError) as err:
        decode(_reseal(GOOD, **fields))
    assert err.value.reason == reason


def test_header_crc_catches_a_flipped_bit():
    bad = bytearray(GOOD)
    bad[40] ^= 1
    with pytest.raises(WireError, match="header_crc"):
        decode_header(bytes(bad))


def test_payload_crc_catches_a_flipped_bit():
    bad = bytearray(GOOD)
    bad[-1] ^= 0x10
    with pytest.raises(WireError, match="payload_crc"):
        decode(bytes(bad))


def test_lengths_that_disagree_with_the_shape_are_rejected():
    payload = GOOD[wire.HEADER_SIZE:] + bytes(8)
    frame = _reseal(GOOD, payload_len=len(payload), payload_crc=zlib.crc32(payload))
    with pytest.raises(WireError, match="payload_len"):
        decode(frame[:wire.HEADER_SIZE] + payload)


def test_token_counts_must_add_up():
    """Same shape, but one request claims a token fewer than the header's total."""
    step = make_step(5, 3, 2, 0, False, min_tokens=2)
    frame = bytearray(encode(step))
    nt_at = wire.HEADER_SIZE + wire.layout(wire.Shape(3, 6, 0, 0, False))[0][2].offset
    frame[nt_at] = 1  # num_tokens[0]: 2 -> 1
    payload = bytes(frame[wire.HEADER_SIZE:])
    with pytest.raises(WireError, match="num_tokens sum"):
        decode(_reseal(bytes(frame), payload_crc=zlib.crc32(payload)))


def test_token_ids_outside_the_vocabulary_are_rejected():
    step = make_step(5, 3, 2, 0, False)
    frame = encode(step)
    h = decode_header(frame)
    with pytest.raises(WireError, match="token_ids"):
        decode_payload(h, frame[wire.HEADER_SIZE:], vocab_size=int(step.token_ids.max()))


@given(st.binary(max_size=300))
def test_random_bytes_raise_only_wire_errors(data):
    with pytest.raises(WireError):
        decode(data)
