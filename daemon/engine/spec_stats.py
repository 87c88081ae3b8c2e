"""Speculation counters: drafts proposed and accepted, per draft position (host side, numpy)."""

from __future__ import annotations

import numpy as np


class AcceptanceStats:
    """Cumulative counters in the vLLM convention: a window of k drafts counts one draft step,
    k draft tokens, and `num_accepted` accepted tokens, the first `num_accepted` positions each +1.
    Mean acceptance length = 1 + accepted / draft steps (the bonus token included)."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_draft_steps = 0
        self.num_draft_tokens = 0
        self.accepted_per_pos = np.zeros(num_speculative_tokens, dtype=np.int64)  # [k]
        self.drafted_per_pos = np.zeros(num_speculative_tokens, dtype=np.int64)  # [k]

    def observe(self, num_accepted: np.ndarray, num_drafts: np.ndarray) -> None:
        """Per verified window of this step [R]: drafts accepted and drafts it verified (windows that
        drafted nothing count for nothing)."""
        k = self.accepted_per_pos.shape[0]
        drafted = num_drafts > 0
        if k == 0 or not drafted.any():
            return
        num_accepted, num_drafts = num_accepted[drafted], num_drafts[drafted]
        pos = np.arange(k)
        self.num_draft_steps += int(num_accepted.size)
        self.num_draft_tokens += int(num_drafts.sum())
        self.drafted_per_pos += (num_drafts[:, None] > pos[None, :]).sum(axis=0)
        self.accepted_per_pos += (num_accepted[:, None] > pos[None, :]).sum(axis=0)

    @property
    def num_accepted_tokens(self) -> int:
        return int(self.accepted_per_pos.sum())

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / max(self.num_draft_steps, 1)

    def per_position_rate(self) -> list[float]:
        return (self.accepted_per_pos / np.maximum(self.drafted_per_pos, 1)).tolist()


class DepthAcceptance:
    """A running estimate of the chance that the draft at each depth is accepted, given that the drafts
    before it were: decayed counts of tries and acceptances per depth, shrunk towards a prior.

    Depth i of a window of n drafts was tried if the i drafts before it were accepted (i <= accepted) and
    accepted if accepted > i."""

    PRIOR_WEIGHT = 4.0  # windows' worth of evidence the prior counts for
    FIRST_PRIOR = 0.7  # before anything was seen: what trained MTP heads accept at depth 1, roughly

    def __init__(self, max_drafts: int, decay: float) -> None:
        # NOTE: plain lists: K is a handful, and every verified window of every step updates one
        self.tried = [0.0] * max_drafts
        self.accepted = [0.0] * max_drafts
        self.decay = decay

    def observe(self, num_drafts: int, num_accepted: int, complete: int | None = None) -> None:
        """`complete`: only depths below it count (the deeper ones drafted over a context with gaps)."""
        counted = num_drafts if complete is None else min(num_drafts, complete)
        if counted <= 0:
            return
        tried, accepted, decay = self.tried, self.accepted, self.decay
        for depth in range(len(tried)):
            tried[depth] = tried[depth] * decay + (depth < counted and depth <= num_accepted)
            accepted[depth] = accepted[depth] * decay + (depth < counted and depth < num_accepted)

    def fade(self, factor: float) -> None:
        """Weaken the evidence without adding any (the estimate drifts back towards the prior)."""
        self.tried = [t * factor for t in self.tried]
        self.accepted = [a * factor for a in self.accepted]

    def rates(self, prior: np.ndarray | None = None) -> np.ndarray:
        """[K] conditional acceptance per depth."""
        base = np.full(len(self.tried), self.FIRST_PRIOR) if prior is None else prior
        return (np.array(self.accepted) + self.PRIOR_WEIGHT * base) / (np.array(self.tried) + self.PRIOR_WEIGHT)
