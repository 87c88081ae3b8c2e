"""What one engine step emits, for the output path: flat arrays, ready to be packed by an op."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class StepEmission(NamedTuple):
    step_id: int  # the device step whose results these are; -1 when none was collected
    request_ids: tuple[int | str, ...]  # [R] requests with new tokens or a finish
    num_tokens: np.ndarray  # [R] int32, new tokens per request (0 for e.g. an abort)
    token_ids: np.ndarray  # [sum(num_tokens)] int64, bounds-checked against the vocabulary
    finish_reasons: np.ndarray  # [R] uint8, request.FinishReason (0 = still running)
    seq: np.ndarray  # [R] int64, tokens each request emitted before this output (the wire's seq)
    # NOTE: cumulative per-request speculation counters (usage / per-request acceptance metrics).
    num_draft_tokens: np.ndarray  # [R] int64
    num_accepted_tokens: np.ndarray  # [R] int64
    # NOTE: logprob columns exist when some request in this output asked for logprobs; rows of the
    # others hold NaN / 0 / -1. K is the widest top-k asked; `num_top_logprobs` is each request's own.
    token_logprobs: np.ndarray | None = None  # [N] float32, raw model logprob of each emitted token
    token_ranks: np.ndarray | None = None  # [N] int64, 1 = most likely
    top_ids: np.ndarray | None = None  # [N, K] int64, -1 padding
    top_logprobs: np.ndarray | None = None  # [N, K] float32
    num_top_logprobs: np.ndarray | None = None  # [R] int32, -1 = request asked for no logprobs
    drafts: np.ndarray | None = None  # [R, k] int64, each request's next MTP drafts (a PD prefill sends them)
    # NOTE: set by a KV connector (kv_prefill.py): entries that end a PD prefill go out as FIRST_TOKEN
    # frames, with their drafts, instead of ordinary token frames.
    handoff: np.ndarray | None = None  # [R] bool

    @classmethod
    def empty(cls, step_id: int = -1) -> StepEmission:
        none = np.zeros(0, np.int64)
        return cls(step_id, (), np.zeros(0, np.int32), none, np.zeros(0, np.uint8), none, none, none)

    def split_handoff(self) -> tuple[StepEmission, StepEmission]:
        """(entries for token frames, entries for FIRST_TOKEN frames)."""
        if self.handoff is None:
            return self, StepEmission.empty(self.step_id)
        return self.select(~self.handoff), self.select(self.handoff)

    def select(self, keep: np.ndarray) -> StepEmission:
        """The entries where `keep` [R] is true (token and logprob columns follow)."""
        if keep.all():
            return self._replace(handoff=None)
        per_token = np.repeat(keep, self.num_tokens)

        def pick(a: np.ndarray | None, mask: np.ndarray) -> np.ndarray | None:
            return None if a is None else a[mask]

        return StepEmission(
            self.step_id, tuple(r for r, k in zip(self.request_ids, keep) if k), self.num_tokens[keep],
            self.token_ids[per_token], self.finish_reasons[keep], self.seq[keep], self.num_draft_tokens[keep],
            self.num_accepted_tokens[keep], pick(self.token_logprobs, per_token),
            pick(self.token_ranks, per_token), pick(self.top_ids, per_token),
            pick(self.top_logprobs, per_token), pick(self.num_top_logprobs, keep), pick(self.drafts, keep))

    def tokens_of(self, index: int) -> np.ndarray:
        start = int(self.num_tokens[:index].sum())
        return self.token_ids[start:start + int(self.num_tokens[index])]
