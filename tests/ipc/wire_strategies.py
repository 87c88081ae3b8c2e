"""Hypothesis strategies for random steps (shared by tests/ipc and tests/ops)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from hypothesis import strategies as st

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


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-exact equality (floats compared as their bytes, so -0.0 and NaN payloads count)."""
    return a.shape == b.shape and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def assert_frame_matches(frame, step: RandomStep) -> None:
    """The decoded frame carries exactly the step, in wire dtypes."""
    assert same_bits(frame.req_ids, step.req_ids)
    assert same_bits(frame.seq, step.seq.astype(np.uint32))
    assert same_bits(frame.num_tokens, step.num_tokens)
    assert same_bits(frame.finish, step.finish)
    assert same_bits(frame.token_ids, step.token_ids.astype(np.int32))
    if step.logprob is None or step.token_ids.size == 0:  # no tokens: no logprob sections
        assert frame.logprob is None and frame.topk_ids is None
        return
    assert same_bits(frame.logprob, step.logprob)
    assert same_bits(frame.rank, step.rank.astype(np.int32))
    assert same_bits(frame.topk_ids, step.topk_ids.astype(np.int32))
    assert same_bits(frame.topk_logprobs, step.topk_logprobs)
