"""The real send ops through both real transports (ring and chunked), read back by the real readers:
bit-exact, in order, sequence numbers intact, back-pressure reported and never a drop."""

import asyncio

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from output_modes import MODE_IDS, MODES
from mtpserve import ops
from mtpserve.ipc import wire
from mtpserve.ipc.output_reader import OutputReader
from mtpserve.ipc.polling_reader import PollingReader
from test_output_pack import logprobs_of, tensor
from wire_strategies import VOCAB, RandomStep, assert_frame_matches, control, lp_cols, make_step, steps, token_frame


def send(sender: ops.OutputSender, step: RandomStep, step_id: int = 0) -> ops.SendStatus:
    return ops.SendStatus.of(sender.send_step(
        step_id=step_id, req_ids=tensor(step.req_ids), seq=tensor(step.seq),
        num_tokens=tensor(step.num_tokens), finish=tensor(step.finish),
        token_ids=tensor(step.token_ids), logprobs=logprobs_of(step), num_topk=step.num_topk))


def deliver(sender: ops.OutputSender, reader: PollingReader, status: ops.SendStatus) -> list:
    """Read while flushing until nothing is pending (the engine's pause-and-flush loop)."""
    frames = reader.poll()
    while status.frames_pending:
        status = ops.SendStatus.of(sender.flush())
        frames += reader.poll()
    return frames + reader.poll()


@pytest.fixture(params=MODES, ids=MODE_IDS)
def channel(request, open_channel):
    transport, chunked = request.param
    return open_channel(transport, chunked, ring_bytes=1 << 20)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps())
def test_random_batches_round_trip_bit_exact(channel, step):
    ch, sender = channel
    reader = PollingReader(ch, track_seq=False)
    frames = deliver(sender, reader, send(sender, step, step_id=5))
    assert len(frames) == 1 and frames[0].step_id == 5
    assert_frame_matches(frames[0], step)
    assert not reader.stats.rejected
    reader.close()


def advancing_steps(num_steps: int, b: int, t: int, k: int):
    """Steps of the same b requests, t tokens each, with seq advancing by t (as the engine does)."""
    for i in range(num_steps):
        step = make_step(i, b, t, k, True, min_tokens=t)
        yield step._replace(req_ids=np.arange(b, dtype=np.int64) + 1000,
                            seq=np.full(b, i * t, np.int64), finish=np.zeros(b, np.int32))


@pytest.mark.parametrize("transport, chunked", MODES, ids=MODE_IDS)
def test_256_requests_4_tokens_top20_at_stock_limits(open_channel, transport, chunked):
    ch, sender = open_channel(transport, chunked)
    reader = PollingReader(ch, vocab_size=VOCAB)
    sent = list(advancing_steps(6, 256, 4, 20))
    got = []
    for i, step in enumerate(sent):
        got += deliver(sender, reader, send(sender, step, step_id=i))
    assert [f.step_id for f in got] == list(range(6))
    for frame, step in zip(got, sent):
        assert_frame_matches(frame, step)
        assert frame.seq_ok is None  # every request's seq was the expected one
    assert reader.stats.seq_errors == 0 and reader.stats.frames_lost == 0
    assert not reader.stats.rejected
    reader.close()


@pytest.mark.parametrize("transport", ["posix", "sysv"])
def test_a_full_ring_defers_frames_in_order_and_never_drops(open_channel, transport):
    ch, sender = open_channel(transport, ring_bytes=50_000)
    reader = PollingReader(ch)
    sent = list(advancing_steps(6, 64, 4, 8))  # ~21 KB each: the ring holds two
    statuses = [send(sender, step, i) for i, step in enumerate(sent)]
    assert statuses[0].frames_pending == 0
    assert statuses[-1].frames_pending >= 3 and statuses[-1].bytes_pending > 0
    assert statuses[-1].frames_deferred >= 3
    frames = deliver(sender, reader, statuses[-1])
    assert [f.step_id for f in frames] == list(range(6))
    for frame, step in zip(frames, sent):
        assert_frame_matches(frame, step)
    reader.close()


def test_past_the_pending_bound_the_op_raises(open_channel):
    ch, sender = open_channel("posix", ring_bytes=100_000, max_pending_bytes=80_000)
    steps_ = list(advancing_steps(8, 64, 4, 8))
    with pytest.raises(OSError, match="back-pressure"):
        for i, step in enumerate(steps_):
            send(sender, step, i)
    status = ops.SendStatus.of(sender.flush())
    assert status.frames_pending > 0  # what was accepted is still queued, not dropped


def test_only_the_send_rank_sends(open_channel):
    ch, sender = open_channel("sysv", rank=1)
    reader = PollingReader(ch)
    status = send(sender, make_step(0, 4, 2, 2, True))
    assert status == (0, 0, 0, 0) and reader.poll() == []
    reader.close()


def test_first_token_frames_carry_drafts_and_logprobs(open_channel):
    ch, sender = open_channel("posix")
    reader = PollingReader(ch)
    step = make_step(3, 16, 1, 5, True)
    drafts = np.random.default_rng(1).integers(0, VOCAB, (16, 3))
    sender.send_first_token(step_id=1, req_ids=tensor(step.req_ids), seq=tensor(step.seq * 0),
                            finish=tensor(step.finish * 0), token_ids=tensor(step.token_ids),
                            logprobs=logprobs_of(step), num_topk=5, draft_ids=tensor(drafts))
    frame = token_frame(reader.poll()[0])
    assert frame.kind is wire.Kind.FIRST_TOKEN and (frame.num_tokens == 1).all()
    assert frame.draft_ids is not None and frame.topk_ids is not None
    assert np.array_equal(frame.draft_ids, drafts) and np.array_equal(frame.topk_ids, lp_cols(step).topk_ids)
    reader.close()


def test_control_frames_go_through_the_same_channel(open_channel):
    ch, sender = open_channel("sysv")
    reader = PollingReader(ch)
    send(sender, make_step(0, 2, 1, 0, False)._replace(seq=np.zeros(2, np.int64)))
    sender.send_control(wire.ControlCode.ENGINE_ERROR, "device lost", step_id=4)
    frames = reader.poll()
    error = control(frames[1])
    assert error.code is wire.ControlCode.ENGINE_ERROR and error.message == "device lost"
    reader.close()


def test_a_removed_queue_stops_the_sender(open_channel):
    ch, sender = open_channel("sysv")
    send(sender, make_step(0, 2, 1, 0, False))
    from mtpserve.ipc import sysv
    sysv.remove(sysv.open_existing(ch.address.sysv_key))
    with pytest.raises(OSError, match="gone"):
        send(sender, make_step(1, 2, 1, 0, False))


@pytest.mark.parametrize("transport", ["posix", "sysv"])
async def test_asyncio_reader_receives_op_frames(open_channel, transport):
    ch, sender = open_channel(transport)
    reader = OutputReader(ch, vocab_size=VOCAB)
    await reader.start()
    sent = list(advancing_steps(4, 128, 4, 5))
    for i, step in enumerate(sent):
        assert send(sender, step, i).frames_pending == 0
    for step in sent:
        assert_frame_matches(await asyncio.wait_for(reader.get(), 2), step)
    assert reader.stats.seq_errors == 0
    await reader.close()


def test_a_skipped_token_is_flagged_on_that_request_only(open_channel):
    ch, sender = open_channel("posix")
    reader = PollingReader(ch)
    sent = list(advancing_steps(3, 8, 2, 3))
    sent[2] = sent[2]._replace(seq=sent[2].seq + np.eye(8, dtype=np.int64)[3])  # engine skipped one
    frames = [f for i, step in enumerate(sent) for f in deliver(sender, reader, send(sender, step, i))]
    assert frames[0].seq_ok is None and frames[1].seq_ok is None
    assert frames[2].seq_ok.tolist() == [i != 3 for i in range(8)]
    assert reader.stats.seq_errors == 1
    reader.close()


def test_a_ring_descriptor_outside_the_written_span_is_rejected(open_channel):
    from mtpserve.ipc import sysv
    from mtpserve.ipc.wire_encode import encode_header

    ch, sender = open_channel("sysv")
    reader = PollingReader(ch)
    bogus = encode_header(kind=int(wire.Kind.TARGET), flags=int(wire.Flag.IN_RING),
                          instance_tag=ch.address.instance_tag, payload_len=30_000,
                          ring_pos=1 << 20)
    assert sysv.send(sysv.open_existing(ch.address.sysv_key), bogus)
    step = make_step(0, 64, 4, 8, True)
    frames = deliver(sender, reader, send(sender, step))
    assert len(frames) == 1 and reader.stats.rejected == {"ring": 1}
    assert_frame_matches(frames[0], step._replace(seq=step.seq))
    reader.close()


def test_numpy_inputs_and_padded_top_k_ids_pass(open_channel):
    """The engine's NumPy outputs go in as they are; -1 pads top-k rows of requests asking fewer."""
    ch, sender = open_channel("posix")
    reader = PollingReader(ch)
    step = make_step(2, 6, 3, 4, True)
    step = step._replace(topk_ids=np.where(np.arange(4) < 2, lp_cols(step).topk_ids, -1))
    cols = lp_cols(step)
    sender.send_step(step_id=0, req_ids=step.req_ids, seq=step.seq, num_tokens=step.num_tokens,
                     finish=step.finish, token_ids=step.token_ids, num_topk=4,
                     logprobs=ops.StepLogprobs(cols.logprob, cols.rank, cols.topk_ids, cols.topk_logprobs))
    (frame,) = reader.poll()
    assert_frame_matches(frame, step)
    reader.close()


@pytest.mark.parametrize("transport", ["posix", "sysv"])
async def test_a_slow_consumer_pushes_back_to_the_engine(open_channel, transport):
    """The reader buffers at most max_buffered frames; then the queue and the ring fill and the send
    op reports pending frames. Once the consumer catches up, every frame arrives, in order."""
    ch, sender = open_channel(transport, ring_bytes=200_000)
    reader = OutputReader(ch, max_buffered=2)
    await reader.start()
    sent = list(advancing_steps(40, 64, 4, 8))  # ~21 KB each: through the ring
    status = None
    for i, step in enumerate(sent):
        status = send(sender, step, i)
        await asyncio.sleep(0.002)  # the reader runs, but nobody calls get()
    assert status is not None and status.frames_pending > 0
    got = []
    while len(got) < len(sent):
        got.append(await asyncio.wait_for(reader.get(), 2))
        status = ops.SendStatus.of(sender.flush())
    assert [f.step_id for f in got] == list(range(40)) and status.frames_pending == 0
    for frame, step in zip(got, sent):
        assert_frame_matches(frame, step)
    await reader.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 2**32 - 1), st.integers(1, 60), st.booleans()),
                min_size=1, max_size=12))
def test_frames_of_mixed_sizes_wrap_a_small_ring_in_order(open_channel, plan):
    """Inline and ring frames of random sizes, read at random moments, through a 64 KB ring."""
    ch, sender = open_channel("sysv", ring_bytes=64_000)
    reader = PollingReader(ch, track_seq=False)
    sent, got, status = [], [], None
    for i, (seed, batch, read_now) in enumerate(plan):
        sent.append(make_step(seed, batch, 4, 10, True))
        status = send(sender, sent[-1], i)
        if read_now:
            got += reader.poll()
    assert status is not None
    got += deliver(sender, reader, status)
    assert [f.step_id for f in got] == list(range(len(plan)))
    for frame, step in zip(got, sent):
        assert_frame_matches(frame, step)
    reader.close()


def test_a_frame_larger_than_the_ring_is_refused(open_channel):
    ch, sender = open_channel("posix", ring_bytes=16_384)
    with pytest.raises(OSError, match="larger than the ring"):
        send(sender, make_step(0, 64, 4, 8, True, min_tokens=4))  # ~21 KB


def test_a_restarted_sender_continues_the_frame_sequence(open_channel):
    ch, sender = open_channel("posix")
    reader = PollingReader(ch)
    send(sender, make_step(0, 2, 1, 0, False)._replace(seq=np.zeros(2, np.int64)))
    sender.close()  # the engine process goes away; a new one attaches
    again = ops.OutputSender(ch.address, rank=0, vocab_size=VOCAB)
    send(again, make_step(1, 2, 1, 0, False)._replace(seq=np.zeros(2, np.int64)))
    assert len(reader.poll()) == 2
    assert reader.stats.frames_lost == 0 and not reader.stats.rejected
    reader.close()


def test_under_back_pressure_ring_frames_share_descriptor_messages(open_channel):
    """A POSIX queue holds 10 messages; the ring holds more frames, whose headers then travel
    together (up to 128 per message), so the queue stops being the bottleneck."""
    ch, sender = open_channel("posix", ring_bytes=4 << 20)
    reader = PollingReader(ch)
    sent = list(advancing_steps(30, 64, 4, 8))  # ~21 KB each
    statuses = [send(sender, step, i) for i, step in enumerate(sent)]
    assert statuses[-1].frames_pending == 20
    frames = deliver(sender, reader, statuses[-1])
    assert [f.step_id for f in frames] == list(range(30))
    assert reader.stats.messages == 11  # 10 single descriptors, then one run of 20
    for frame, step in zip(frames, sent):
        assert_frame_matches(frame, step)
    reader.close()


@pytest.mark.parametrize("transport", ["posix", "sysv"])
def test_a_removed_channel_stops_the_sender(open_channel, transport):
    """A POSIX queue stays writable through an open descriptor after unlink; the ring's closed flag
    is what stops the engine."""
    ch, sender = open_channel(transport)
    send(sender, make_step(0, 2, 1, 0, False))
    ch.remove()
    with pytest.raises(OSError, match="closed|gone"):
        send(sender, make_step(1, 2, 1, 0, False))


def test_draft_frames_carry_draft_logprobs_and_leave_the_seq_count_alone(open_channel):
    """DRAFT frames pair with TARGET frames by (req_id, seq), not by arrival order."""
    ch, sender = open_channel("sysv")
    reader = PollingReader(ch)
    target = next(advancing_steps(1, 8, 2, 3))
    draft = make_step(9, 8, 3, 3, True)._replace(req_ids=target.req_ids, seq=target.seq + 2)
    send(sender, target, 0)
    sender.send_step(step_id=0, req_ids=draft.req_ids, seq=draft.seq, num_tokens=draft.num_tokens,
                     finish=draft.finish * 0, token_ids=draft.token_ids, num_topk=3,
                     logprobs=ops.StepLogprobs(*lp_cols(draft)), kind=wire.Kind.DRAFT)
    frames = [token_frame(f) for f in reader.poll()]
    assert [f.kind for f in frames] == [wire.Kind.TARGET, wire.Kind.DRAFT]
    assert_frame_matches(frames[1], draft._replace(finish=draft.finish * 0))
    assert reader.stats.seq_errors == 0 and reader.tracker is not None and len(reader.tracker) == 8
    reader.close()
