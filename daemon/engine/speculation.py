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

import numpy as np

from mtpserve.engine.request import Request
from mtpserve.engine.scheduler import SchedulePlan
from mtpserve.engine.spec_cost import StepCostModel, features
from mtpserve.engine.spec_policy import choose_drafts
from mtpserve.engine.spec_stats import DepthAcceptance

EXPLORE_EVERY = 16


class Speculation:
    def __init__(self, max_drafts: int, adaptive: bool) -> None:
        self.max_drafts = max_drafts
        self.adaptive = adaptive and max_drafts > 0
        self.instance = DepthAcceptance(max_drafts, decay=0.999)  # the prior of every request
        self.cost = StepCostModel()
        self.forced: int | None = None  # the start-up profile pins every row's drafts
        self.rows_by_drafts = np.zeros(max_drafts + 1, np.int64)  # rows that chose k, for /metrics
        self._steps = 0

    def choose(self, plan: SchedulePlan) -> np.ndarray:
        """[B] drafts each row proposes this step; sets each request's next window."""
        caps = np.array([self._cap(row.request) for row in plan.rows], np.int64)
        if self.forced is not None:
            drafts = np.minimum(caps, self.forced)
        elif not self.adaptive:
            drafts = caps
        else:
            drafts = self._explore(self._policy(plan, caps), caps, plan)
        for row, k in zip(plan.rows, drafts.tolist()):
            row.request.num_drafts = k
        np.add.at(self.rows_by_drafts, drafts, 1)
        return drafts

    def forget_acceptance(self) -> None:
        """Keep the cost model, drop what was learnt of acceptance (after the start-up profile)."""
        self.instance = DepthAcceptance(self.max_drafts, decay=self.instance.decay)
        self.rows_by_drafts[:] = 0

    def features(self, plan: SchedulePlan, drafts: np.ndarray) -> np.ndarray:
        """The cost model's inputs for the step `plan` launches with `drafts`."""
        width = max((row.num_tokens for row in plan.rows if not row.is_prefill), default=1)
        return features(plan.num_tokens, len(plan.rows), width, int(drafts.max(initial=0)))

    def observe(self, x: np.ndarray, seconds: float) -> None:
        if seconds > 0:
            self.cost.observe(x, seconds)

    def observe_window(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        if num_drafts:
            self._acceptance(request).observe(num_drafts, num_accepted)
            self.instance.observe(num_drafts, num_accepted)

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
        # NOTE: chunks of prompts still prefilling cost the same whatever the windows draft
        other = sum(row.num_tokens for row in plan.rows if not row.emits)
        drafts[emits] = choose_drafts(rates, caps[emits], self.cost.cost(), other, drafts[emits])
        return drafts

    def _explore(self, drafts: np.ndarray, caps: np.ndarray, plan: SchedulePlan) -> np.ndarray:
        """One step in EXPLORE_EVERY drafts one more, the next such step one fewer, than the policy chose.

        NOTE: at a steady load the policy picks the same shapes step after step, and a least-squares fit
        cannot tell what a depth costs from samples that all ran the same depths: its estimate would
        drift with the noise and nothing would correct it. A little variation keeps the cost of the
        neighbouring choices measured, at a cost of a fraction of the steps it runs."""
        self._steps += 1
        if self._steps % EXPLORE_EVERY:
            return drafts
        delta = 1 if self._steps % (2 * EXPLORE_EVERY) else -1
        free = np.array([row.emits and not _is_seeded_sample(row.request) for row in plan.rows])
        return np.where(free, np.clip(drafts + delta, 0, caps), drafts)

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
