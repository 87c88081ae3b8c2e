"""Model runners of a tensor-parallel group: rank 0 leads (broadcasts each plan, then runs it), ranks
>= 1 follow (receive a plan, run it, until the stop plan).

Sampling is seeded identically, not broadcast: the LM head all-gathers the full-vocabulary logits, so
every rank holds bitwise the same logits and draws the same tokens from the counter-based RNG keyed by
(seed, position, purpose); drafts likewise. Every rank therefore keeps the same slot state (last
tokens, drafts, stop flags) without a per-step token broadcast. tests/engine/test_tp_ranks.py checks
each rank's step results are identical, greedy and sampled.
"""

from __future__ import annotations

import concurrent.futures

from mtpserve.engine.model_runner import PaddleModelRunner
from mtpserve.engine.step_plan import StepPlan, StepResult
from mtpserve.engine.tp_plan_channel import PlanChannel

STOP_TIMEOUT_S = 5.0  # how long rank 0 waits for the stop plan to go out before giving up on it


class LeaderRunner(PaddleModelRunner):
    """Rank 0's runner: the engine core drives it exactly like a single-rank runner."""

    def __init__(self, model, config, channel: PlanChannel, on_result=None) -> None:
        super().__init__(model, config)
        self.channel = channel
        self.on_result = on_result  # called on the device thread with each StepResult (tests)

    def launch(self, plan: StepPlan) -> concurrent.futures.Future[StepResult]:
        return self._stream.submit(self._lead, plan)

    def close(self) -> None:
        """Send the stop plan (best effort: a dead or hung peer must not block the shutdown)."""
        try:
            self._stream.submit(self.channel.send, None).result(timeout=STOP_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - peers gone or stuck; the launcher stops them
            self._stream.close(timeout=0.0)
            self.channel.close()
            return
        super().close()
        self.channel.close()

    def _lead(self, plan: StepPlan) -> StepResult:
        self.channel.send(plan)
        result = self._execute(plan)
        if self.on_result is not None:
            self.on_result(result)
        return result


class FollowerRunner(PaddleModelRunner):
    """A rank >= 1's runner: no scheduler; it runs the plans rank 0 sends."""

    def __init__(self, model, config, channel: PlanChannel, on_result=None) -> None:
        super().__init__(model, config)
        self.channel = channel
        self.on_result = on_result  # called on the device thread with each StepResult (tests)

    def follow(self) -> concurrent.futures.Future:
        """Run plans until the stop plan; the future's result is the number of steps run."""
        return self._stream.submit(self._follow)

    def close(self) -> None:
        super().close()
        self.channel.close()

    def _follow(self) -> int:
        n = 0
        while (plan := self.channel.recv()) is not None:
            result = self._execute(plan)
            if self.on_result is not None:
                self.on_result(result)
            n += 1
        return n
