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
class TokenFrame:
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
        """Split per request. NOTE: one tolist() per array, then list slices: no per-token loop;
        tuple.__new__ skips NamedTuple's Python-level __new__ (a third of the cost at B = 128)."""
        cu = self.cu_tokens().tolist()
        heads = zip(self.req_ids.tolist(), self.seq.tolist(), self.finish.tolist(), cu[:-1], cu[1:])
        tokens = self.token_ids.tolist()
        drafts = self.draft_ids.tolist() if self.draft_ids is not None else [None] * len(cu)
        new = tuple.__new__
        if self.logprob is None:
            return [new(RequestOutput, (rid, seq, fin, tokens[a:b], None, None, None, None, d))
                    for (rid, seq, fin, a, b), d in zip(heads, drafts)]
        # NOTE: the logprob sections come together (wire.SECTIONS: needs_logprobs)
        assert self.rank is not None and self.topk_ids is not None and self.topk_logprobs is not None
        lp, rank = self.logprob.tolist(), self.rank.tolist()
        top_ids, top_lp = self.topk_ids.tolist(), self.topk_logprobs.tolist()
        return [new(RequestOutput, (rid, seq, fin, tokens[a:b], lp[a:b], rank[a:b], top_ids[a:b],
                                    top_lp[a:b], d))
                for (rid, seq, fin, a, b), d in zip(heads, drafts)]


@dataclass(frozen=True, slots=True)
class ControlMessage:
    """A CONTROL frame: the engine stopped or failed."""

    code: wire.ControlCode
    message: str
    step_id: int
    frame_seq: int


Frame = TokenFrame | ControlMessage
