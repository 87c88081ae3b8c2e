"""One step's per-request outputs, collected row by row and built into flat StepEmission arrays."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from mtpserve.engine.request import FinishReason, Request
from mtpserve.engine.step_emission import StepEmission


class RowLogprobs(NamedTuple):
    """One request's logprob columns for its n emitted tokens, cut to its own top-k width K."""

    token_logprobs: np.ndarray  # [n] float32
    ranks: np.ndarray  # [n] int64
    top_ids: np.ndarray  # [n, K] int64
    top_logprobs: np.ndarray  # [n, K] float32


class Emitter:
    """Collects one step's per-request outputs into flat arrays."""

    def __init__(self) -> None:
        self.ids: list[int | str] = []
        self.tokens: list[np.ndarray] = []
        self.reasons: list[int] = []
        self.logprobs: list[RowLogprobs | None] = []
        self.widths: list[int] = []
        self.drafted: list[int] = []
        self.accepted: list[int] = []
        self.seq: list[int] = []  # tokens the request emitted before this output
        self.drafts: list[np.ndarray | None] = []  # per request: its next k drafts, when known

    def add(self, request_id: int | str, tokens: np.ndarray, reason: FinishReason, width: int = -1,
            logprobs: RowLogprobs | None = None, request: Request | None = None, seq: int = 0,
            drafts: np.ndarray | None = None) -> None:
        """`request` (when given) has already committed `tokens`, so its earlier count is derived."""
        self.drafts.append(drafts)
        self.seq.append(len(request.output_ids) - tokens.shape[0] if request else seq)
        self.drafted.append(request.num_draft_tokens if request else 0)
        self.accepted.append(request.num_accepted_tokens if request else 0)
        self.ids.append(request_id)
        self.tokens.append(tokens)
        self.reasons.append(int(reason))
        self.widths.append(width if logprobs is not None else -1)
        self.logprobs.append(logprobs)

    def build(self, step_id: int) -> StepEmission:
        if not self.ids:
            return StepEmission.empty(step_id)
        base = StepEmission(step_id, tuple(self.ids),
                          np.fromiter((t.shape[0] for t in self.tokens), np.int32, len(self.tokens)),
                          np.concatenate(self.tokens).astype(np.int64),
                          np.asarray(self.reasons, np.uint8), np.asarray(self.seq, np.int64),
                          np.asarray(self.drafted, np.int64), np.asarray(self.accepted, np.int64))
        if any(d is not None for d in self.drafts):
            base = base._replace(drafts=self._draft_columns())
        if all(lp is None for lp in self.logprobs):
            return base
        return base._replace(**self._logprob_columns())

    def _draft_columns(self) -> np.ndarray:
        k = max(d.shape[0] for d in self.drafts if d is not None)
        return np.stack([np.zeros(k, np.int64) if d is None else d for d in self.drafts])

    def _logprob_columns(self) -> dict[str, Any]:
        width = max(max(self.widths), 0)
        parts = [lp if lp is not None else _no_logprobs(t.shape[0])
                 for lp, t in zip(self.logprobs, self.tokens)]
        # NOTE: each row's top-k written into columns padded to the widest: np.pad per row and column
        # was ~25 us a call, most of the host loop's time at 16 streams with logprobs
        rows = sum(p.top_ids.shape[0] for p in parts)
        top_ids = np.full((rows, width), -1, np.int64)
        top_logprobs = np.full((rows, width), -np.inf, np.float32)
        first = 0
        for p in parts:
            n, k = p.top_ids.shape
            top_ids[first:first + n, :k] = p.top_ids
            top_logprobs[first:first + n, :k] = p.top_logprobs
            first += n
        return dict(token_logprobs=np.concatenate([p.token_logprobs for p in parts]).astype(np.float32),
                    token_ranks=np.concatenate([p.ranks for p in parts]).astype(np.int64),
                    top_ids=top_ids, top_logprobs=top_logprobs, num_top_logprobs=np.asarray(self.widths, np.int32))


def _no_logprobs(n: int) -> RowLogprobs:
    return RowLogprobs(np.full(n, np.nan, np.float32), np.zeros(n, np.int64), np.zeros((n, 0), np.int64),
                       np.zeros((n, 0), np.float32))
