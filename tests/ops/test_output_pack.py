"""The C++ packer against the NumPy reference encoder (ipc/wire_encode.py): the same bytes, for
random batches, both token layouts, both integer widths, with invalid slots skipped; bad input raises."""

import numpy as np
import paddle
import pytest
from hypothesis import given, settings

from mtpserve import ops
from mtpserve.ipc import wire
from mtpserve.ipc.wire_encode import encode_token_frame
from wire_strategies import VOCAB, RandomStep, lp_cols, make_step, steps


def tensor(a, dtype=None):
    return paddle.to_tensor(a if dtype is None else a.astype(dtype))


def logprobs_of(step: RandomStep, int_dtype: type[np.signedinteger] = np.int64) -> ops.StepLogprobs | None:
    if step.logprob is None:
        return None
    return ops.StepLogprobs(tensor(step.logprob), tensor(step.rank, int_dtype),
                            tensor(step.topk_ids, int_dtype), tensor(step.topk_logprobs))


def pack(step: RandomStep, int_dtype: type[np.signedinteger] = np.int64, **kw) -> bytes:
    frame = ops.pack_frame(kind=kw.pop("kind", wire.Kind.TARGET), step_id=kw.pop("step_id", 3),
                           req_ids=tensor(step.req_ids), seq=tensor(step.seq, int_dtype),
                           num_tokens=tensor(step.num_tokens, int_dtype),
                           finish=tensor(step.finish, int_dtype),
                           token_ids=kw.pop("token_ids", tensor(step.token_ids, int_dtype)),
                           logprobs=kw.pop("logprobs", logprobs_of(step, int_dtype)),
                           num_topk=step.num_topk, vocab_size=VOCAB, instance_tag=11, **kw)
    return frame.numpy().tobytes()


def reference(step: RandomStep, **kw) -> bytes:
    return encode_token_frame(kw.pop("kind", wire.Kind.TARGET), req_ids=step.req_ids,
                              seq=step.seq, num_tokens=step.num_tokens, finish=step.finish,
                              token_ids=step.token_ids, logprob=step.logprob, rank=step.rank,
                              topk_ids=step.topk_ids, topk_logprobs=step.topk_logprobs,
                              step_id=3, instance_tag=11, **kw)


@settings(max_examples=40, deadline=None)
@given(steps())
def test_cpp_frames_equal_the_reference_bytes(step):
    assert pack(step) == reference(step)


def test_int32_inputs_give_the_same_bytes():
    step = make_step(2, 50, 4, 7, True)
    assert pack(step, np.int32) == reference(step)


def padded(step: RandomStep, width: int, slots: np.ndarray) -> dict:
    """The step laid out [B_in, T] with extra invalid slots (req_id -1) at `slots`."""
    b_in = step.req_ids.size + slots.size
    valid = np.setdiff1d(np.arange(b_in), slots)
    cu = np.concatenate([[0], np.cumsum(step.num_tokens)])
    rows = np.full((b_in, width), 0, np.int64)
    lp = np.zeros((b_in, width), np.float32)
    rk = np.zeros((b_in, width), np.int64)
    k = step.num_topk + 3  # a wider top-k tensor than sent
    tid = np.zeros((b_in, width, k), np.int64)
    tlp = np.zeros((b_in, width, k), np.float32)
    for i, v in enumerate(valid):
        n, s = step.num_tokens[i], slice(cu[i], cu[i + 1])
        cols = lp_cols(step)
        rows[v, :n], lp[v, :n], rk[v, :n] = step.token_ids[s], cols.logprob[s], cols.rank[s]
        tid[v, :n, :step.num_topk], tlp[v, :n, :step.num_topk] = cols.topk_ids[s], cols.topk_logprobs[s]

    def spread(a, fill):
        out = np.full(b_in, fill, a.dtype)
        out[valid] = a
        return out

    return dict(req_ids=spread(step.req_ids, -1), seq=spread(step.seq, 0),
                num_tokens=spread(step.num_tokens, 5), finish=spread(step.finish, 0),
                token_ids=rows, lp=ops.StepLogprobs(tensor(lp), tensor(rk), tensor(tid), tensor(tlp)))


def test_padded_layout_with_invalid_slots_equals_the_compact_frame():
    step = make_step(4, 20, 4, 5, True)
    p = padded(step, 4, np.array([0, 7, 21]))
    frame = ops.pack_frame(kind=wire.Kind.TARGET, step_id=3, req_ids=tensor(p["req_ids"]),
                           seq=tensor(p["seq"]), num_tokens=tensor(p["num_tokens"]),
                           finish=tensor(p["finish"]), token_ids=tensor(p["token_ids"]),
                           logprobs=p["lp"], num_topk=5, vocab_size=VOCAB, instance_tag=11)
    assert frame.numpy().tobytes() == reference(step)


def test_draft_ids_are_packed():
    step = make_step(6, 8, 1, 3, True, min_tokens=1)
    drafts = np.random.default_rng(0).integers(-1, VOCAB, (8, 3))
    got = pack(step, draft_ids=tensor(drafts), kind=wire.Kind.FIRST_TOKEN)
    assert got == reference(step, draft_ids=drafts, kind=wire.Kind.FIRST_TOKEN)


@pytest.mark.parametrize("mutate, message", [
    (lambda s: s._replace(token_ids=s.token_ids + VOCAB), "vocabulary"),
    (lambda s: s._replace(num_tokens=s.num_tokens * 0 + 65, token_ids=np.zeros(65 * 3, np.int64)),
     "num_tokens"),
    (lambda s: s._replace(finish=s.finish * 0 + 9), "finish"),
    (lambda s: s._replace(seq=s.seq * 0 - 1), "seq"),
])
def test_bad_inputs_raise_instead_of_sending_garbage(mutate, message):
    step = mutate(make_step(1, 3, 2, 2, True))
    if step.logprob is not None and step.logprob.size != step.token_ids.size:
        step = step._replace(logprob=None, rank=None, topk_ids=None, topk_logprobs=None)
    with pytest.raises(OSError, match=message):
        pack(step)


def test_top_k_wider_than_twenty_is_refused():
    step = make_step(1, 3, 2, 21, True)
    with pytest.raises(OSError, match="num_topk"):
        pack(step)


def test_logprob_tensors_go_together():
    step = make_step(1, 3, 2, 2, True)
    full = logprobs_of(step)
    assert full is not None
    lp = full._replace(rank=None)
    with pytest.raises(OSError, match="together"):
        pack(step, logprobs=lp)
