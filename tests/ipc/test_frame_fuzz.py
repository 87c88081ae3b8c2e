"""Fuzzing the assembler: random, truncated and bit-flipped messages never crash it; each is
rejected and counted, and valid frames after them still decode."""

from hypothesis import given, settings
from hypothesis import strategies as st

from mtpserve.ipc import wire
from mtpserve.ipc.frame_assembler import FrameAssembler
from mtpserve.ipc.wire_encode import encode_token_frame
from wire_strategies import RandomStep, assert_frame_matches, make_step

TAG = 77


def frame(seq: int, seed: int = 0) -> tuple[bytes, RandomStep]:
    step = make_step(seed, 5, 3, 4, True)
    data = encode_token_frame(wire.Kind.TARGET, req_ids=step.req_ids, seq=step.seq,
                              num_tokens=step.num_tokens, finish=step.finish,
                              token_ids=step.token_ids, logprob=step.logprob, rank=step.rank,
                              topk_ids=step.topk_ids, topk_logprobs=step.topk_logprobs,
                              frame_seq=seq, instance_tag=TAG)
    return data, step


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2000))
def test_random_messages_are_rejected_and_counted(data):
    asm = FrameAssembler(TAG)
    assert asm.feed(data) == []
    assert sum(asm.stats.rejected.values()) >= 1  # a run of 64-byte "descriptors" counts each


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_truncated_frames_are_rejected_and_the_next_one_decodes(data):
    good, step = frame(0)
    cut = data.draw(st.integers(0, len(good) - 1))
    asm = FrameAssembler(TAG)
    assert asm.feed(good[:cut]) == []
    assert sum(asm.stats.rejected.values()) == 1
    assert_frame_matches(asm.feed(frame(1)[0])[0], frame(1)[1])


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_every_single_bit_flip_is_caught(data):
    good, _ = frame(0)
    bit = data.draw(st.integers(0, len(good) * 8 - 1))
    bad = bytearray(good)
    bad[bit // 8] ^= 1 << (bit % 8)
    asm = FrameAssembler(TAG)
    assert asm.feed(bytes(bad)) == []
    assert sum(asm.stats.rejected.values()) >= 1


def test_repeated_and_backward_frames_are_rejected_gaps_counted():
    asm = FrameAssembler(TAG)
    assert len(asm.feed(frame(5)[0])) == 1
    assert asm.feed(frame(5)[0]) == [] and asm.stats.rejected["order"] == 1
    assert asm.feed(frame(4)[0]) == [] and asm.stats.rejected["order"] == 2
    assert len(asm.feed(frame(8)[0])) == 1 and asm.stats.frames_lost == 2


def test_frames_of_another_instance_are_rejected():
    asm = FrameAssembler(TAG + 1)
    assert asm.feed(frame(0)[0]) == [] and asm.stats.rejected["instance"] == 1


def test_chunks_out_of_order_are_rejected_then_a_whole_frame_passes():
    from mtpserve.ipc.wire_decode import decode_header
    from mtpserve.ipc.wire_encode import encode_header
    good, step = frame(0)
    h = decode_header(good)._asdict()
    h.pop("header_crc")
    body = good[wire.HEADER_SIZE:]
    half = len(body) // 2
    chunk = [encode_header(**(h | {"chunk_index": i, "chunk_count": 2})) + part
             for i, part in enumerate((body[:half], body[half:]))]
    asm = FrameAssembler(TAG)
    assert asm.feed(chunk[1]) == [] and asm.stats.rejected["chunk"] == 1
    assert asm.feed(chunk[0]) == []
    assert_frame_matches(asm.feed(chunk[1])[0], step)
