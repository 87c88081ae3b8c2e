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

    def observe(self, num_accepted: np.ndarray) -> None:
        """num_accepted: [R] accepted drafts per verified window of this step."""
        k = self.accepted_per_pos.shape[0]
        if k == 0 or num_accepted.size == 0:
            return
        pos = np.arange(k)
        self.num_draft_steps += int(num_accepted.size)
        self.num_draft_tokens += int(num_accepted.size) * k
        self.drafted_per_pos += num_accepted.size
        self.accepted_per_pos += (num_accepted[:, None] > pos[None, :]).sum(axis=0)

    @property
    def num_accepted_tokens(self) -> int:
        return int(self.accepted_per_pos.sum())

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / max(self.num_draft_steps, 1)

    def per_position_rate(self) -> list[float]:
        return (self.accepted_per_pos / np.maximum(self.drafted_per_pos, 1)).tolist()
