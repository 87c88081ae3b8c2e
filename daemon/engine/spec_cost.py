"""The step-time model the speculation policy plans with, learned on the machine it runs on.

Features of a step: 1, target-pass tokens, verify rows (rows x widest window), MTP depths run, MTP tokens
(depths x tokens). What is fitted is the step's period as the engine lives it (engine_core._period: from
the previous step's finish to this one's), so host work that shares the device's cores counts. Recursive
least squares with forgetting keeps the fit current as contexts grow and the machine's load changes; a
short profile at start-up (rank_setup.profile_steps) shows it every shape before the first client does.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mtpserve.engine.spec_policy import StepCost

# NOTE: features are scaled to similar magnitudes so one forgetting factor and prior suit them all
_SCALE = np.array([1.0, 1e-2, 1e-2, 1.0, 1e-2])
_FORGET = 0.995  # weight of a sample halves after ~140 steps
_PRIOR_VARIANCE = 1e2
_MAX_TRACE = 5 * _PRIOR_VARIANCE  # the prior's
# A CPU-sized guess (seconds) used until samples arrive: 2 ms a step, 0.2 ms a token, 20 us a verify row,
# 0.5 ms an MTP depth, 0.05 ms an MTP token.
_PRIOR = StepCost(2e-3, 2e-4, 2e-5, 5e-4, 5e-5)


def features(num_tokens: float, num_rows: int, width: int, depths: int) -> np.ndarray:
    return np.array([1.0, num_tokens, num_rows * width, depths, depths * num_tokens]) * _SCALE


class StepCostModel:
    def __init__(self, prior: StepCost = _PRIOR) -> None:
        self.theta = np.array(prior) / _SCALE  # coefficients of the scaled features
        self.covariance = np.eye(5) * _PRIOR_VARIANCE
        self.num_samples = 0
        self.predicted_seconds = 0.0  # sums over observed steps, for /metrics
        self.measured_seconds = 0.0

    def cost(self) -> StepCost:
        """The current coefficients, never negative (a negative cost would invite drafting for free)."""
        return StepCost(*np.maximum(self.theta * _SCALE, 0.0).tolist())

    def predict(self, x: np.ndarray) -> float:
        return float(max(x @ self.theta, 0.0))

    def observe(self, x: np.ndarray, seconds: float) -> None:
        """One measured step: x from `features`, its period in seconds."""
        self.predicted_seconds += self.predict(x)
        self.measured_seconds += seconds
        px = self.covariance @ x
        gain = px / (_FORGET + x @ px)
        self.theta = self.theta + gain * (seconds - x @ self.theta)
        self.covariance = (self.covariance - np.outer(gain, px)) / _FORGET
        # NOTE: forgetting divides the covariance by _FORGET every step, and in directions the steps do
        # not vary (a steady load runs one shape) nothing shrinks it again: it would grow until it
        # overflowed (seen after ~15 minutes of a steady load). Capping its trace keeps it at the prior's.
        trace = float(np.trace(self.covariance))
        if trace > _MAX_TRACE:
            self.covariance *= _MAX_TRACE / trace
        self.num_samples += 1


class PeriodTable:
    """Measured periods of steady decode steps (every window verifying as many drafts as the step's
    depth), by rows and depth: an exponentially weighted mean per cell.

    NOTE: the linear model extrapolates across batch sizes badly on a CPU (per-token costs fall as
    batches grow), and what the policy weighs in a steady decode load is one step shape against its
    neighbours: those it measures directly, here. A depth not measured at these rows is estimated from
    one that is, by the ratio of the two at the nearest batch size where both are (the start-up profile
    measures every depth at a few batch sizes)."""

    MIN_SAMPLES = 4
    WEIGHT = 0.03  # of a new sample: the mean follows the last ~30 steps of its cell

    def __init__(self) -> None:
        self.mean: dict[tuple[int, int], float] = {}
        self.tokens: dict[tuple[int, int], float] = {}  # tokens the cell's steps emitted, same weighting
        self.count: dict[tuple[int, int], int] = {}
        self.token_count: dict[tuple[int, int], int] = {}  # steps behind `tokens` (since forget_tokens)

    @staticmethod
    def cell(num_rows: int, depth: int) -> tuple[int, int]:
        """Rows in quarter octaves (1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 13, 16, ...), exact when small."""
        return round(4 * np.log2(num_rows)), depth

    def observe(self, num_rows: int, depth: int, seconds: float, tokens: int) -> None:
        key = self.cell(num_rows, depth)
        count = self.count[key] = self.count.get(key, 0) + 1
        # NOTE: a plain mean until the weight takes over, so a cell's first (often slow) step fades
        weight = max(1.0 / count, self.WEIGHT)
        self.mean[key] = self.mean.get(key, 0.0) + weight * (seconds - self.mean.get(key, 0.0))
        token_count = self.token_count[key] = self.token_count.get(key, 0) + 1
        weight = max(1.0 / token_count, self.WEIGHT)
        self.tokens[key] = self.tokens.get(key, 0.0) + weight * (tokens - self.tokens.get(key, 0.0))

    def forget_tokens(self) -> None:
        """Keep the periods, drop the tokens: what the start-up profile's prompt accepted says nothing of
        clients' drafts, and a cell's measured tokens per second wins over every estimate."""
        self.tokens.clear()
        self.token_count.clear()

    def tokens_per_second(self, num_rows: int, depth: int) -> float | None:
        """What steps of these rows at this depth delivered, measured: acceptance as it really is (gaps
        in the MTP KV included), over the period as it really is. A depth not measured at these rows is
        scaled from one that is, by the ratio of the two at the nearest batch size where both are (how
        depths rank hardly changes from 13 rows to 16); else None."""
        return self._scaled(self.cell(num_rows, depth)[0], depth, self._delivered, self._rate)

    def seconds(self, num_rows: int, depth: int) -> float | None:
        """The measured period; else one measured at another depth for these rows, scaled by the ratio
        of the two depths where both are measured at the nearest other batch size; else None."""
        return self._scaled(self.cell(num_rows, depth)[0], depth, self._known, self.mean.__getitem__)

    def _scaled(self, rows: int, depth: int, known: Callable[[int, int], bool],
                value: Callable[[tuple[int, int]], float]) -> float | None:
        if known(rows, depth):
            return value((rows, depth))
        for other in sorted((d for d in range(self._max_depth + 1) if known(rows, d)),
                            key=lambda d: abs(d - depth)):
            near = [r for r in self._rows() if known(r, depth) and known(r, other)]
            if near:
                ref = min(near, key=lambda r: abs(r - rows))
                return value((rows, other)) * value((ref, depth)) / value((ref, other))
        return None

    def _delivered(self, rows: int, depth: int) -> bool:
        return self.token_count.get((rows, depth), 0) >= self.MIN_SAMPLES

    def _rate(self, key: tuple[int, int]) -> float:
        return self.tokens[key] / max(self.mean[key], 1e-9)

    def _known(self, rows: int, depth: int) -> bool:
        return self.count.get((rows, depth), 0) >= self.MIN_SAMPLES

    def _rows(self) -> set[int]:
        return {rows for rows, _ in self.mean}

    @property
    def _max_depth(self) -> int:
        return max((depth for _, depth in self.mean), default=0)
