"""How many tokens each running request drafts next: pure policy, no engine state.

A window of k drafts whose depth-i draft is accepted with probability a_i (given the drafts before it
were) emits E(k) = 1 + sum_{j=1..k} prod_{i<=j} a_i tokens. With this engine a step's cost follows its
deepest row (every row's tokens run through the MTP depths the step runs, and every row is verified as
wide as the widest), so the policy decides in two parts:

1. the step's depth D in 0..K: the one whose tokens per second is best: as measured for steps of these
   rows at depth D where there are such steps, else expected, sum_r E_r(min(D, cap_r)) / period(D), with
   period(D) measured or modelled; the shallowest depth within a margin of the best is taken, and one
   deeper than the depth in use must beat it by the margin too;
2. each row's drafts k_r <= min(D, cap_r): draft j is worth its window slot when the chance that it is
   reached and accepted, prod_{i<=j} a_i, exceeds what the slot costs in tokens: the step's rate times
   the seconds one more window token adds. A request whose drafts are rarely accepted drafts less.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np


class StepCost(NamedTuple):
    """Seconds of a step, linear in what it computes (fitted by spec_cost.StepCostModel)."""

    base: float  # per step
    per_token: float  # per token of the target pass
    per_verify_row: float  # per row of target logits (rows x the widest window)
    per_depth: float  # per MTP depth run, whatever its tokens (dispatch, the draft head)
    per_mtp_token: float  # per token of each MTP depth run

    def seconds(self, num_tokens: float, num_rows: int, width: int, depths: int) -> float:
        return (self.base + self.per_token * num_tokens + self.per_verify_row * num_rows * width
                + (self.per_depth + self.per_mtp_token * num_tokens) * depths)

    def window_token(self, depths: int) -> float:
        """What one more token in one window adds to a step that runs `depths` MTP depths."""
        return self.per_token + self.per_mtp_token * depths


def expected_tokens(acceptance: np.ndarray) -> np.ndarray:
    """acceptance: [B, K] conditional acceptance per depth -> [B, K+1] expected tokens for k = 0..K."""
    return 1.0 + np.concatenate([np.zeros((acceptance.shape[0], 1)), np.cumsum(reach(acceptance), axis=1)],
                                axis=1)


def reach(acceptance: np.ndarray) -> np.ndarray:
    """[B, K]: the chance that drafts 1..j are all accepted."""
    return np.cumprod(acceptance, axis=1)


def choose_depth(gain: np.ndarray, caps: np.ndarray, floors: np.ndarray, period: Callable[[int], float],
                 current: int, margin: float, measured: dict[int, float | None] | None = None) -> int:
    """The step's depth. gain: [B, K+1] expected tokens per k; caps, floors: [B]; period(depth): seconds of
    a step of these rows at that depth; measured[depth]: tokens per second such steps delivered, which
    wins over the estimate. The shallowest depth within `margin` of the best is taken, and a deeper one
    than `current` only when it beats `current` by `margin` too."""
    rows, max_depth = np.arange(gain.shape[0]), gain.shape[1] - 1
    rates = {}
    for depth in range(int(floors.max(initial=0)), max_depth + 1):
        drafts = np.maximum(np.minimum(caps, depth), floors)
        seen = measured.get(depth) if measured else None
        rates[depth] = seen if seen is not None else float(gain[rows, drafts].sum()) / max(period(depth), 1e-9)
    best = max(rates, key=rates.__getitem__)
    # NOTE: a deeper step costs more than its decode periods show (its prefill chunks run every depth
    # too), so among the depths within `margin` of the best the shallowest is taken; a deeper depth
    # than the current one must also beat it by `margin`, so noise does not flip the choice.
    target = min(d for d in rates if rates[d] * (1 + margin) >= rates[best])
    if current in rates and target > current and rates[target] < rates[current] * (1 + margin):
        return current
    return target


def row_drafts(acceptance: np.ndarray, depth: int, caps: np.ndarray, floors: np.ndarray,
               slot_cost: float) -> np.ndarray:
    """Each row's drafts at the step's depth: draft j is kept while it is reached with a chance of at
    least `slot_cost` (expected tokens one window slot costs). acceptance: [B, K] -> [B] int64."""
    worth = reach(acceptance)[:, :depth] >= slot_cost  # [B, depth]
    drafts = np.cumprod(worth, axis=1).sum(axis=1).astype(np.int64)  # the leading run of worthwhile drafts
    return np.maximum(np.minimum(drafts, caps), floors)
