"""How many tokens each running request drafts next: pure policy, no engine state.

A window of k drafts whose depth-i draft is accepted with probability a_i (given the drafts before it
were) emits E(k) = 1 + sum_{j=1..k} prod_{i<=j} a_i tokens. A step costs, by the cost model
(spec_cost.py), c0 + c_tok * tokens + c_row * verify rows + (c_depth + c_mtp * tokens) * depths. The
policy picks the drafts k_r of every row, all <= the step's depth D <= K, to maximise the step's expected tokens per
second: sum_r E_r(k_r) / cost(k). For a fixed D the ratio is maximised by Dinkelbach's iteration (each
row takes the k that maximises E_r(k) - lambda * its share of the cost, then lambda becomes the new
ratio); D itself is tried from 0 to K. B rows, K+1 depths, a few iterations: microseconds.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

_ITERATIONS = 4


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


def expected_tokens(acceptance: np.ndarray) -> np.ndarray:
    """acceptance: [B, K] conditional acceptance per depth -> [B, K+1] expected tokens for k = 0..K."""
    reach = np.cumprod(acceptance, axis=1)  # probability that drafts 1..j are all accepted
    return 1.0 + np.concatenate([np.zeros((acceptance.shape[0], 1)), np.cumsum(reach, axis=1)], axis=1)


def choose_drafts(acceptance: np.ndarray, caps: np.ndarray, cost: StepCost, other_tokens: int,
                  floors: np.ndarray | None = None) -> np.ndarray:
    """The drafts of each row. acceptance: [B, K]; caps: [B] per-request limits (<= K); floors: [B]
    drafts a row must propose whatever the cost (<= caps); other_tokens: tokens of the step that are not
    decode windows (prefill chunks). -> [B] int64."""
    num_rows, max_depth = acceptance.shape
    if num_rows == 0 or max_depth == 0:
        return np.zeros(num_rows, np.int64)
    floors = np.zeros(num_rows, np.int64) if floors is None else floors
    gain = expected_tokens(acceptance)  # [B, K+1]
    best, best_rate = floors, -1.0
    for depth in range(int(floors.max()), max_depth + 1):
        drafts = _best_at_depth(gain, floors, np.minimum(caps, depth), cost, other_tokens, depth)
        rate = _rate(gain, drafts, cost, other_tokens)
        if rate > best_rate * (1 + 1e-9):  # NOTE: ties go to the shallower depth: cheaper if the model errs
            best, best_rate = drafts, rate
    return best


def _best_at_depth(gain: np.ndarray, floors: np.ndarray, limit: np.ndarray, cost: StepCost,
                   other_tokens: int, depth: int) -> np.ndarray:
    """Dinkelbach's iteration for the ratio with every row's drafts in [floor, limit] ([B] each)."""
    ks = np.arange(gain.shape[1])[None, :]  # [1, K+1]
    allowed = (ks <= limit[:, None]) & (ks >= floors[:, None])
    drafts = limit.astype(np.int64)
    # NOTE: a token of a window costs the target pass and every MTP depth run over it
    per_token = cost.per_token + cost.per_mtp_token * depth
    for _ in range(_ITERATIONS):
        rate = _rate(gain, drafts, cost, other_tokens)
        value = np.where(allowed, gain - rate * per_token * (ks + 1), -np.inf)
        chosen = value.argmax(axis=1).astype(np.int64)
        if np.array_equal(chosen, drafts):
            break
        drafts = chosen
    return drafts


def _rate(gain: np.ndarray, drafts: np.ndarray, cost: StepCost, other_tokens: int) -> float:
    """Expected tokens per second of a step whose rows draft `drafts` [B]."""
    rows = np.arange(gain.shape[0])
    width = int(drafts.max(initial=0)) + 1
    tokens = other_tokens + float((drafts + 1).sum())
    seconds = cost.seconds(tokens, gain.shape[0], width, int(drafts.max(initial=0)))
    return float(gain[rows, drafts].sum()) / max(seconds, 1e-9)
