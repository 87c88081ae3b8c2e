"""The engine core's speculation: what each row drafts next (policy), and what it learns from each step.

Per step, for the rows of the plan: `choose` gives each row the drafts it proposes this step for its
next window (the scheduler sizes that window from `Request.num_drafts`); `observe` takes the finished
step's period (the cost model and the period table learn from it) and each verified window updates its
request's acceptance per depth (and the instance's, the prior of new requests). With `adaptive` off
every row drafts K (or its request's cap), as a fixed-k engine does.

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
from mtpserve.engine.spec_policy import choose_depth, expected_tokens, row_drafts
from mtpserve.engine.spec_stats import DepthAcceptance

EXPLORE_EVERY = 96
EXPLORE_STEPS = 4
SWITCH_MARGIN = 0.05


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
        """Keep the cost model and the measured periods, drop what was learnt of acceptance (after the
        start-up profile)."""
        self.instance = DepthAcceptance(self.max_drafts, decay=self.instance.decay)
        self.periods.forget_tokens()
        self.rows_by_drafts[:] = 0

    def shape(self, plan: SchedulePlan, drafts: np.ndarray) -> StepShape:
        """What the cost model and the period table know of the step `plan` launches with `drafts`."""
        width = max((row.num_tokens for row in plan.rows if not row.is_prefill), default=1)
        decode_only = not any(row.is_prefill for row in plan.rows)
        return StepShape(plan.num_tokens, len(plan.rows), width, int(drafts.max(initial=0)), decode_only)

    def observe(self, shape: StepShape, seconds: float, num_emitted: int) -> None:
        """A finished step: its shape, its period, the tokens it emitted."""
        if seconds <= 0:
            return
        self.cost.observe(features(shape.num_tokens, shape.num_rows, shape.width, shape.depth), seconds)
        if shape.decode_only and shape.width == shape.depth + 1:
            self.periods.observe(shape.num_rows, shape.depth, seconds, num_emitted)

    def observe_window(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        if num_drafts:
            self._acceptance(request).observe(num_drafts, num_accepted)
            # NOTE: the instance's estimate is every new request's prior: only drafts made over a
            # complete MTP context teach it, or a busy spell (little drafting, gaps) would lower it
            # for the quiet one after it
            self.instance.observe(num_drafts, num_accepted, complete=request.mtp_depth)

    def _policy(self, plan: SchedulePlan, caps: np.ndarray) -> np.ndarray:
        """One depth for the step from the rows that emit (spec_policy.py), then each emitting row's
        drafts. A prefill chunk that does not emit yet drafts nothing, but the depths the step runs
        write its MTP KV: a prompt gets that KV exactly when drafting is in use at this load. A pinned
        request drafts its cap (its floor) in every step it is in, so its MTP KV, and so its drafts,
        never depend on its neighbours."""
        pinned = np.array([_is_seeded_sample(row.request) for row in plan.rows])
        drafts = np.where(pinned, caps, 0)
        emits = np.array([row.emits for row in plan.rows])
        if not emits.any():
            return drafts
        prior = self.instance.rates()
        rates = np.stack([self._acceptance(row.request).rates(prior) for row in plan.rows if row.emits])
        caps_e, floors = caps[emits], drafts[emits]
        num_rows, cost = len(caps_e), self.cost.cost()

        def period(depth: int) -> float:
            measured = self.periods.seconds(num_rows, depth)
            window = float((np.maximum(np.minimum(caps_e, depth), floors) + 1).sum())
            return measured if measured is not None else cost.seconds(window, num_rows, depth + 1, depth)

        gain = expected_tokens(rates)
        measured = (None if floors.any() else  # NOTE: pinned rows make these rows' steps unlike the cell's
                    {d: self.periods.tokens_per_second(num_rows, d) for d in range(self.max_drafts + 1)})
        depth = choose_depth(gain, caps_e, floors, period, self._depth, SWITCH_MARGIN, measured)
        self._depth = depth
        full = np.maximum(np.minimum(caps_e, depth), floors)
        step_rate = float(gain[np.arange(num_rows), full].sum()) / max(period(depth), 1e-9)
        drafts[emits] = row_drafts(rates, depth, caps_e, floors, step_rate * cost.window_token(depth))
        return drafts

    def _explore(self, drafts: np.ndarray, caps: np.ndarray, plan: SchedulePlan) -> np.ndarray:
        """EXPLORE_STEPS steps in every EXPLORE_EVERY run a deeper depth than the policy chose, each in
        turn, for every row free to change.

        NOTE: at a steady load the policy picks the same shape step after step and would never measure
        the others; a short burst runs one long enough for its steady steps (windows as deep as the depth)
        to be timed, at the cost of a few percent of the steps. Only deeper: a shallower burst would leave
        gaps in every request's MTP KV (the depths it skips), lowering their acceptance for good; the
        shallower depths are measured whenever the load makes the policy choose them."""
        self._steps += 1
        depth = int(drafts.max(initial=0))
        if self._steps % EXPLORE_EVERY >= EXPLORE_STEPS or depth >= self.max_drafts:
            return drafts
        deeper = depth + 1 + (self._steps // EXPLORE_EVERY) % (self.max_drafts - depth)
        free = np.array([row.emits and not _is_seeded_sample(row.request) for row in plan.rows])
        return np.where(free, np.minimum(caps, deeper), drafts)

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
