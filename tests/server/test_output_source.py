"""Wire frames -> TokenDeltas: per-request slices, finish codes, seq gaps turned into failures."""

import dataclasses

import numpy as np

from mtpserve.ipc import wire
from mtpserve.ipc.token_frame import TokenFrame
from mtpserve.server.output_source import to_deltas


def _frame(with_lp: bool, seq_ok=None) -> TokenFrame:
    n = np.array([1, 3, 2], np.int32)
    tokens = np.arange(10, 16, dtype=np.int32)
    k = 2
    return TokenFrame(
        kind=wire.Kind.TARGET, step_id=7, frame_seq=0, req_ids=np.array([5, 9, 2**40], np.int64),
        seq=np.array([0, 4, 8], np.uint32), num_tokens=n,
        finish=np.array([wire.Finish.RUNNING, wire.Finish.LENGTH, wire.Finish.PREEMPTED], np.int32),
        token_ids=tokens, logprob=-np.arange(6, dtype=np.float32) if with_lp else None,
        rank=np.ones(6, np.int32) if with_lp else None,
        topk_ids=np.arange(12, dtype=np.int32).reshape(6, k) if with_lp else None,
        topk_logprobs=-np.arange(12, dtype=np.float32).reshape(6, k) if with_lp else None,
        draft_ids=None, seq_ok=seq_ok)


def test_slices_and_finish_codes():
    deltas = to_deltas(_frame(with_lp=True))
    assert [d.request_id for d in deltas] == [5, 9, 2**40]
    assert [d.token_ids for d in deltas] == [[10], [11, 12, 13], [14, 15]]
    assert [d.finish_reason for d in deltas] == [None, "length", None]  # preempted keeps running
    assert deltas[1].logprobs == [-1.0, -2.0, -3.0]
    assert deltas[1].top_ids == [[2, 3], [4, 5], [6, 7]]
    assert deltas[2].top_logprobs == [[-8.0, -9.0], [-10.0, -11.0]]


def test_no_logprob_sections():
    deltas = to_deltas(_frame(with_lp=False))
    assert all(d.logprobs is None and d.top_ids is None for d in deltas)


def test_seq_gap_fails_only_that_request():
    deltas = to_deltas(_frame(with_lp=False, seq_ok=np.array([True, False, True])))
    assert [d.finish_reason for d in deltas] == [None, "error", None]


def test_unknown_finish_code_is_an_error():
    frame = dataclasses.replace(_frame(False), finish=np.array([0, 99, 0], np.int32))
    assert to_deltas(frame)[1].finish_reason == "error"
