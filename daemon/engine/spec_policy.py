"""How many tokens each running request drafts next: pure policy, no engine state.

A window of k drafts whose depth-i draft is accepted with probability a_i (given the drafts before it
were) emits E(k) = 1 + sum_{j=1..k} prod_{i<=j} a_i tokens. With this engine a step's cost follows its
deepest row (every row's tokens run through the MTP depths the step runs, and every row is verified as
wide as the widest), so the policy decides in two parts:

1. the step's depth D in 0..K: the one whose expected tokens per second is best,
   sum_r E_r(min(D, cap_r)) / period(D), with period(D) from the measured step costs (spec_cost.py) of
   the load these rows make at D; a deeper one than the depth in use must beat it by a margin, since
   going deeper leaves gaps in the new depths' MTP KV and noise must not flip it (a shallower one leaves
   none, and is taken as soon as it is the best);
   A deeper depth within a band of the depth in use whose price is borrowed from it (what serving adds
   to a step, spec_extra.py) is first run for a few steps to price it (`worth_pricing`, spec_seek.py);
2. each row's drafts k_r <= min(D, cap_r): draft j is worth its window slot when the chance that it is
   reached and accepted, prod_{i<=j} a_i, exceeds what the slot costs in tokens: the step's rate times
   the seconds one more window token adds. A request whose drafts are rarely accepted drafts less.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def expected_tokens(acceptance: np.ndarray) -> np.ndarray:
    """acceptance: [B, K] conditional acceptance per depth -> [B, K+1] expected tokens for k = 0..K."""
    return 1.0 + np.concatenate([np.zeros((acceptance.shape[0], 1)), np.cumsum(reach(acceptance), axis=1)],
                                axis=1)


def reach(acceptance: np.ndarray) -> np.ndarray:
    """[B, K]: the chance that drafts 1..j are all accepted."""
    return np.cumprod(acceptance, axis=1)


def choose_depth(gain: np.ndarray, caps: np.ndarray, floors: np.ndarray, period: Callable[[int], float],
                 current: int, margin: float) -> int:
    """The step's depth. gain: [B, K+1] expected tokens per k; caps, floors: [B]; period(depth): seconds of
    a step of these rows at that depth. The best depth by expected tokens per second, unless it is deeper
    than the depth in use and the depth in use is within `margin` of it."""
    return pick_depth(depth_rates(step_tokens(gain, caps, floors), int(floors.max(initial=0)), period), current,
                      margin)


def depth_rates(emitted: Sequence[float], shallowest: int, period: Callable[[int], float]) -> dict[int, float]:
    """Expected tokens per second of a step of these rows at each depth from `shallowest` (the deepest floor)
    to K, from the step's expected tokens at each depth (`step_tokens`)."""
    return {depth: emitted[depth] / max(period(depth), 1e-9) for depth in range(shallowest, len(emitted))}


def step_tokens(gain: np.ndarray, caps: np.ndarray, floors: np.ndarray) -> list[float]:
    """[K+1] expected tokens of a step of these rows at each depth, every row drafting min(depth, cap) (at
    least its floor). gain: [B, K+1] as `expected_tokens` gives."""
    depths = np.arange(gain.shape[1])
    drafts = np.maximum(np.minimum(caps[:, None], depths[None, :]), floors[:, None])  # [B, K+1]
    return np.take_along_axis(gain, drafts, axis=1).sum(axis=0).tolist()


def pick_depth(rates: dict[int, float], current: int, margin: float) -> int:
    """`choose_depth` from the rates `depth_rates` gives."""
    best = max(rates, key=rates.__getitem__)
    if current in rates and best > current and rates[best] < rates[current] * (1 + margin):
        return current
    return best


def is_clear(rates: dict[int, float], depth: int, margin: float) -> bool:
    """Whether `depth` beats every other depth by more than `margin`: a choice that the noise of a few
    steps, or a few rows more or less, would not change."""
    return all(rate * (1 + margin) < rates[depth] for other, rate in rates.items() if other != depth)


def worth_pricing(rates: dict[int, float], depth: int, band: float, other: int | None = None) -> bool:
    """Whether `other` (the depth after `depth` by default) is within `band` of it: close enough that the
    price it has is worth checking by running it (a price borrowed from another depth can be off by more
    than that)."""
    other = depth + 1 if other is None else other
    return other in rates and rates[other] >= (1 - band) * rates[depth]


def row_drafts(acceptance: np.ndarray, depth: int, caps: np.ndarray, floors: np.ndarray,
               slot_cost: float) -> np.ndarray:
    """Each row's drafts at the step's depth: draft j is kept while it is reached with a chance of at
    least `slot_cost` (expected tokens one window slot costs). acceptance: [B, K] -> [B] int64."""
    worth = reach(acceptance)[:, :depth] >= slot_cost  # [B, depth]
    drafts = np.cumprod(worth, axis=1).sum(axis=1).astype(np.int64)  # the leading run of worthwhile drafts
    return np.maximum(np.minimum(drafts, caps), floors)
