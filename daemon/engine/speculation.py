"""The engine core's speculation: what each row drafts next (policy), and what it learns from each step.

Per step, for the rows of the plan: `choose` gives each row the drafts it proposes this step for its
next window (the scheduler sizes that window from `Request.num_drafts`); `observe` takes the finished
step: each verified window updates its request's acceptance per depth (and the instance's, the prior of
new requests), and the step's device time corrects the cost model. With `adaptive` off every row
drafts K (or its request's cap), as a fixed-k engine does.

A sampled request with a seed always drafts its cap: rejection sampling keeps the distribution whatever
the drafts, but which sample a seed gives depends on them, and a seed promises the same sample whatever
the load. Greedy and unseeded requests are adaptive.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from mtpserve.engine.request import Request
from mtpserve.engine.scheduler import SchedulePlan
from mtpserve.engine.spec_cost import PeriodTable, StepCostModel, features
from mtpserve.engine.spec_policy import choose_drafts, expected_tokens
from mtpserve.engine.spec_stats import DepthAcceptance

EXPLORE_EVERY = 96
EXPLORE_STEPS = 4
SWITCH_MARGIN = 0.03


class StepShape(NamedTuple):
    num_tokens: int
    num_rows: int
    width: int  # the widest window's drafts + 1
    depth: int  # MTP depths the step runs
    decode_only: bool


class Speculation:
    def __init__(self, max_drafts: int, adaptive: bool) -> None:
        self.max_drafts = max_drafts
        self.adaptive = adaptive and max_drafts > 0
        self.instance = DepthAcceptance(max_drafts, decay=0.999)  # the prior of every request
        self.cost = StepCostModel()
        self.forced: int | None = None  # the start-up profile pins every row's drafts
        self.rows_by_drafts = np.zeros(max_drafts + 1, np.int64)  # rows that chose k, for /metrics
        self.periods = PeriodTable()
        self._steps = 0
        self._depth = max_drafts  # the depth of the last steady decode step

    def choose(self, plan: SchedulePlan) -> np.ndarray:
        """[B] drafts each row proposes this step; sets each request's next window."""
        caps = np.array([self._cap(row.request) for row in plan.rows], np.int64)
        if self.forced is not None:
            drafts = np.minimum(caps, self.forced)
        elif not self.adaptive:
            drafts = caps
        else:
            drafts = self._explore(self._policy(plan, caps), caps, plan)
        depth = int(drafts.max(initial=0))
        for row, k in zip(plan.rows, drafts.tolist()):
            row.request.num_drafts = k
            row.request.mtp_depth = min(row.request.mtp_depth, depth)
        np.add.at(self.rows_by_drafts, drafts, 1)
        return drafts

    def forget_acceptance(self) -> None:
        """Keep the cost model, drop what was learnt of acceptance (after the start-up profile)."""
        self.instance = DepthAcceptance(self.max_drafts, decay=self.instance.decay)
        self.rows_by_drafts[:] = 0

    def shape(self, plan: SchedulePlan, drafts: np.ndarray) -> StepShape:
        """What the cost model and the period table know of the step `plan` launches with `drafts`."""
        width = max((row.num_tokens for row in plan.rows if not row.is_prefill), default=1)
        decode_only = not any(row.is_prefill for row in plan.rows)
        return StepShape(plan.num_tokens, len(plan.rows), width, int(drafts.max(initial=0)), decode_only)

    def observe(self, shape: StepShape, seconds: float) -> None:
        if seconds <= 0:
            return
        self.cost.observe(features(shape.num_tokens, shape.num_rows, shape.width, shape.depth), seconds)
        if shape.decode_only and shape.width == shape.depth + 1:
            self.periods.observe(shape.num_rows, shape.depth, seconds)

    def observe_window(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        if num_drafts:
            self._acceptance(request).observe(num_drafts, num_accepted)
            # NOTE: the instance's estimate is every new request's prior: only drafts made over a
            # complete MTP context teach it, or a busy spell (little drafting, gaps) would lower it
            # for the quiet one after it
            self.instance.observe(num_drafts, num_accepted, complete=request.mtp_depth)

    def _policy(self, plan: SchedulePlan, caps: np.ndarray) -> np.ndarray:
        """Rows that emit choose their next window. A prefill chunk that does not emit yet drafts nothing
        (the depths the step runs still write its MTP KV), unless its request is pinned: then every step
        it is in runs its depths, so its MTP KV, and so its drafts, never depend on its neighbours."""
        pinned = np.array([_is_seeded_sample(row.request) for row in plan.rows])
        drafts = np.where(pinned, caps, 0)
        emits = np.array([row.emits for row in plan.rows])
        if not emits.any():
            return drafts
        rows = [row for row in plan.rows if row.emits]
        prior = self.instance.rates()
        rates = np.stack([self._acceptance(row.request).rates(prior) for row in rows])
        if all(not row.is_prefill for row in plan.rows):
            drafts[emits] = self._steady_depth(expected_tokens(rates), caps[emits], drafts[emits])
            return drafts
        # NOTE: chunks of prompts still prefilling cost the same whatever the windows draft
        other = sum(row.num_tokens for row in plan.rows if not row.emits)
        drafts[emits] = choose_drafts(rates, caps[emits], self.cost.cost(), other, drafts[emits])
        return drafts

    def _steady_depth(self, gain: np.ndarray, caps: np.ndarray, floors: np.ndarray) -> np.ndarray:
        """A decode-only step: one depth D for every row (capped per request), the D whose expected
        tokens per second of measured period is best; the current D is kept unless another is better by
        SWITCH_MARGIN (measured periods are noisy, and a flip costs a step of mixed shapes)."""
        rows, cost = np.arange(gain.shape[0]), self.cost.cost()
        best, best_rate, current_rate = self._depth, -1.0, -1.0
        for depth in range(int(floors.max(initial=0)), self.max_drafts + 1):
            drafts = np.maximum(np.minimum(caps, depth), floors)
            seconds = self.periods.seconds(len(rows), depth)
            if seconds is None:
                seconds = cost.seconds(float((drafts + 1).sum()), len(rows), depth + 1, depth)
            rate = float(gain[rows, drafts].sum()) / max(seconds, 1e-9)
            current_rate = rate if depth == self._depth else current_rate
            if rate > best_rate:
                best, best_rate = depth, rate
        if current_rate > 0 and best_rate < current_rate * (1 + SWITCH_MARGIN):
            best = self._depth
        self._depth = best
        return np.maximum(np.minimum(caps, best), floors)

    def _explore(self, drafts: np.ndarray, caps: np.ndarray, plan: SchedulePlan) -> np.ndarray:
        """EXPLORE_STEPS steps in every EXPLORE_EVERY run another depth than the policy chose, each depth
        in turn, for every row free to change.

        NOTE: at a steady load the policy picks the same shape step after step and would never measure
        the others; a short burst runs one long enough for its steady steps (windows as deep as the depth)
        to be timed, at the cost of a few percent of the steps (less where the depths differ little)."""
        self._steps += 1
        if self._steps % EXPLORE_EVERY >= EXPLORE_STEPS:
            return drafts
        burst = self._steps // EXPLORE_EVERY
        depth = (int(drafts.max(initial=0)) + 1 + burst % self.max_drafts) % (self.max_drafts + 1)
        free = np.array([row.emits and not _is_seeded_sample(row.request) for row in plan.rows])
        return np.where(free, np.minimum(caps, depth), drafts)

    def _cap(self, request: Request) -> int:
        cap = request.params.max_draft_tokens
        return self.max_drafts if cap is None else min(cap, self.max_drafts)

    def _acceptance(self, request: Request) -> DepthAcceptance:
        if request.acceptance is None:
            request.acceptance = DepthAcceptance(self.max_drafts, decay=0.9)
        return request.acceptance


def _is_seeded_sample(request: Request) -> bool:
    params = request.params
    return params.seed is not None and params.temperature > 0
