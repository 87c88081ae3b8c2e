"""Decoded frames as the HTTP side sees them: NumPy views over one received payload, no copies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from mtpserve.ipc import wire


class RequestOutput(NamedTuple):
    """One request's part of a frame, as Python lists (built by batch conversions)."""

    req_id: int
    seq: int  # tokens of this request sent before this frame
    finish: int  # wire.Finish value
    token_ids: list[int]
    logprobs: list[float] | None
    ranks: list[int] | None
    top_ids: list[list[int]] | None  # [n][K]
    top_logprobs: list[list[float]] | None  # [n][K]
    draft_ids: list[int] | None  # FIRST_TOKEN frames: the MTP drafts for the decode instance


@dataclass(frozen=True, slots=True)
class StepOutput:
    """A token frame (TARGET, DRAFT or FIRST_TOKEN). Arrays are read-only views of the payload."""

    kind: wire.Kind
    step_id: int
    frame_seq: int
    req_ids: np.ndarray  # [B] int64
    seq: np.ndarray  # [B] uint32
    num_tokens: np.ndarray  # [B] int32
    finish: np.ndarray  # [B] int32
    token_ids: np.ndarray  # [N] int32
    logprob: np.ndarray | None  # [N] float32
    rank: np.ndarray | None  # [N] int32
    topk_ids: np.ndarray | None  # [N, K] int32
    topk_logprobs: np.ndarray | None  # [N, K] float32
    draft_ids: np.ndarray | None  # [B, D] int32
    seq_ok: np.ndarray | None = None  # [B] bool, set by the reader when some row's seq was wrong

    @property
    def num_reqs(self) -> int:
        return int(self.req_ids.shape[0])

    def cu_tokens(self) -> np.ndarray:
        """[B + 1] offsets: request i owns tokens cu[i]:cu[i+1]."""
        cu = np.zeros(self.num_reqs + 1, np.int64)
        np.cumsum(self.num_tokens, out=cu[1:])
        return cu

    def requests(self) -> list[RequestOutput]:
        """Split per request. NOTE: one tolist() per array, then list slices: no per-token loop."""
        cu = self.cu_tokens().tolist()
        cols = [a.tolist() if a is not None else None
                for a in (self.token_ids, self.logprob, self.rank, self.topk_ids, self.topk_logprobs)]
        drafts = self.draft_ids.tolist() if self.draft_ids is not None else None
        heads = zip(self.req_ids.tolist(), self.seq.tolist(), self.finish.tolist())
        return [RequestOutput(rid, seq, fin,
                              *[c[cu[i]:cu[i + 1]] if c is not None else None for c in cols],
                              drafts[i] if drafts is not None else None)
                for i, (rid, seq, fin) in enumerate(heads)]


@dataclass(frozen=True, slots=True)
class ControlMessage:
    """A CONTROL frame: the engine stopped or failed."""

    code: wire.ControlCode
    message: str
    step_id: int
    frame_seq: int


Frame = StepOutput | ControlMessage
