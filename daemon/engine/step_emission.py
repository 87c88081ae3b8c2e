"""What one engine step hands to the output path: flat arrays, ready to be packed by an op."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class StepEmission(NamedTuple):
    step_id: int  # the device step whose results these are; -1 when none was collected
    request_ids: tuple[int | str, ...]  # [R] requests with new tokens or a finish
    num_tokens: np.ndarray  # [R] int32, new tokens per request (0 for e.g. an abort)
    token_ids: np.ndarray  # [sum(num_tokens)] int64, bounds-checked against the vocabulary
    finish_reasons: np.ndarray  # [R] uint8, request.FinishReason (0 = still running)
    # NOTE: logprob columns exist when some request in this output asked for logprobs; rows of the
    # others hold NaN / 0 / -1. K is the widest top-k asked; `num_top_logprobs` is each request's own.
    token_logprobs: np.ndarray | None = None  # [N] float32, raw model logprob of each emitted token
    token_ranks: np.ndarray | None = None  # [N] int64, 1 = most likely
    top_ids: np.ndarray | None = None  # [N, K] int64, -1 padding
    top_logprobs: np.ndarray | None = None  # [N, K] float32
    num_top_logprobs: np.ndarray | None = None  # [R] int32, -1 = request asked for no logprobs
    # NOTE: cumulative per-request speculation counters (usage / per-request acceptance metrics).
    num_draft_tokens: np.ndarray | None = None  # [R] int64
    num_accepted_tokens: np.ndarray | None = None  # [R] int64
    seq: np.ndarray | None = None  # [R] int64, tokens each request emitted before this output (wire seq)
    drafts: np.ndarray | None = None  # [R, k] int64, each request's next MTP drafts (a PD prefill sends them)

    @classmethod
    def empty(cls, step_id: int = -1) -> StepEmission:
        return cls(step_id, (), np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.uint8))

    def tokens_of(self, index: int) -> np.ndarray:
        start = int(self.num_tokens[:index].sum())
        return self.token_ids[start:start + int(self.num_tokens[index])]
