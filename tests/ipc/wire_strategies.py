"""Hypothesis strategies for random steps (shared by tests/ipc and tests/ops)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from hypothesis import strategies as st

from mtpserve.ipc.token_frame import ControlMessage, Frame, TokenFrame

VOCAB = 50_000


class RandomStep(NamedTuple):
    req_ids: np.ndarray  # [B] int64, unique, >= 0
    seq: np.ndarray  # [B] int64
    num_tokens: np.ndarray  # [B] int32
    finish: np.ndarray  # [B] int32
    token_ids: np.ndarray  # [N] int64
    logprob: np.ndarray | None  # [N] float32
    rank: np.ndarray | None  # [N] int64
    topk_ids: np.ndarray | None  # [N, K] int64
    topk_logprobs: np.ndarray | None  # [N, K] float32

    @property
    def num_topk(self) -> int:
        return 0 if self.topk_ids is None else self.topk_ids.shape[1]


def make_step(seed: int, num_reqs: int, max_tokens: int, topk: int, logprobs: bool,
              min_tokens: int = 1) -> RandomStep:
    rng = np.random.default_rng(seed)
    b = num_reqs
    nt = rng.integers(min_tokens, max_tokens + 1, b).astype(np.int32)
    n = int(nt.sum())
    req_ids = rng.choice(1 << 40, size=b, replace=False).astype(np.int64)
    lp = None if not logprobs else (
        rng.standard_normal(n).astype(np.float32) * 5,
        rng.integers(1, VOCAB, n).astype(np.int64),
        rng.integers(0, VOCAB, (n, topk)).astype(np.int64),
        rng.standard_normal((n, topk)).astype(np.float32) * 5)
    return RandomStep(req_ids, rng.integers(0, 1 << 31, b).astype(np.int64), nt,
                      rng.integers(0, 6, b).astype(np.int32),
                      rng.integers(0, VOCAB, n).astype(np.int64), *(lp or (None,) * 4))


@st.composite
def steps(draw, max_reqs: int = 256, max_tokens: int = 9, max_topk: int = 20) -> RandomStep:
    """0-256 requests, 1-9 tokens each, top-k 0-20, logprobs on or off."""
    return make_step(draw(st.integers(0, 2**32 - 1)), draw(st.integers(0, max_reqs)),
                     draw(st.integers(1, max_tokens)), draw(st.integers(0, max_topk)),
                     draw(st.booleans()))


class LogprobColumns(NamedTuple):
    logprob: np.ndarray  # [N] float32
    rank: np.ndarray  # [N] int64
    topk_ids: np.ndarray  # [N, K] int64
    topk_logprobs: np.ndarray  # [N, K] float32


def lp_cols(step: RandomStep) -> LogprobColumns:
    """The logprob columns of a step made with logprobs (they exist together or not at all)."""
    assert step.logprob is not None and step.rank is not None
    assert step.topk_ids is not None and step.topk_logprobs is not None
    return LogprobColumns(step.logprob, step.rank, step.topk_ids, step.topk_logprobs)


def token_frame(frame: Frame) -> TokenFrame:
    assert isinstance(frame, TokenFrame), f"expected a token frame, got {frame!r}"
    return frame


def control(frame: Frame) -> ControlMessage:
    assert isinstance(frame, ControlMessage), f"expected a control message, got {frame!r}"
    return frame


def same_bits(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    """Bit-exact equality (floats compared as their bytes, so -0.0 and NaN payloads count)."""
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def assert_frame_matches(frame: Frame, step: RandomStep) -> None:
    """The decoded frame carries exactly the step, in wire dtypes."""
    frame = token_frame(frame)
    assert same_bits(frame.req_ids, step.req_ids)
    assert same_bits(frame.seq, step.seq.astype(np.uint32))
    assert same_bits(frame.num_tokens, step.num_tokens)
    assert same_bits(frame.finish, step.finish)
    assert same_bits(frame.token_ids, step.token_ids.astype(np.int32))
    if step.logprob is None or step.token_ids.size == 0:  # no tokens: no logprob sections
        assert frame.logprob is None and frame.topk_ids is None
        return
    assert same_bits(frame.logprob, step.logprob)
    assert step.rank is not None and step.topk_ids is not None
    assert same_bits(frame.rank, step.rank.astype(np.int32))
    assert same_bits(frame.topk_ids, step.topk_ids.astype(np.int32))
    assert same_bits(frame.topk_logprobs, step.topk_logprobs)
