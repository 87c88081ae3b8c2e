"""The step-time model the speculation policy plans with, measured on the machine it runs on.

What a step costs the engine's throughput is its period (engine_core._period: from the previous step's
finish to its own). It splits into what the device thread spent on the step and the rest:

    period = target(N) + D * depth(N) + rest(B)

* target(N): the device thread's time for everything but drafting (the target pass over the step's N
  tokens, its LM head, verification, logprobs). Decode-only steps and steps with a prefill chunk are
  separate curves: a decode token is a logit row as well, a prefill token is not, and on a small model the
  LM head costs as much as a layer.
* depth(N): one MTP depth over the same N tokens (the step's draft time over its D depths).
* rest(B): the period minus both, by rows: the host loop and the HTTP process sharing the cores, and any
  wait for the host.

Each is a `Curve`, measured per cell and read between cells by interpolation: no functional form is
assumed (on a CPU the cost per token falls as batches grow, which a linear fit got wrong by 2x). The
device thread's times come from the step itself (`StepTiming`): the waits a step already makes (its
verified tokens and each depth's drafts reach the host) bracket them, so timing adds no sync.

A short profile at start-up (rank_setup.profile_steps) measures the device curves at every depth and a
few batch sizes, on a machine that serves nobody yet, and freezes them. While serving, only rest(B)
learns, as the period less the device curves' prediction. NOTE: under load the host's work per step
(the rank loop, the HTTP process streaming a chunk per row) shares the cores with the device: on this
host a decode step of 64 rows took 6.6 ms in the profile and 17-19 ms serving 64 streams. That work goes
with the rows and the steps, not with the depth, so it is added per step, not scaled into the device
curves: learnt into them at the depth in use, it would make every other depth look cheap or dear by
the wrong amount.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from typing import NamedTuple

from mtpserve.engine.step_plan import StepTiming


class Curve:
    """y(x) from samples: an exponentially weighted mean of x and y per cell (x in quarter octaves),
    interpolated linearly between cells; below the lowest cell its value (a small step costs what reading
    the weights costs, not less), above the highest its value per unit of x."""

    MIN_SAMPLES = 3
    WEIGHT = 0.05  # of a new sample: a cell follows its last ~20 samples

    def __init__(self, prior: Callable[[float], float]) -> None:
        self.prior = prior
        self._x: dict[int, float] = {}
        self._y: dict[int, float] = {}
        self._count: dict[int, int] = {}
        self._points: tuple[list[float], list[float]] | None = None  # the known cells, sorted

    def observe(self, x: float, y: float) -> None:
        key = round(4 * math.log2(max(x, 1.0)))
        count = self._count[key] = self._count.get(key, 0) + 1
        # NOTE: a plain mean until the weight takes over, so a cell's first (often slow) sample fades
        weight = max(1.0 / count, self.WEIGHT)
        self._x[key] = self._x.get(key, x) + weight * (x - self._x.get(key, x))
        self._y[key] = self._y.get(key, y) + weight * (y - self._y.get(key, y))
        self._points = None

    def __call__(self, x: float) -> float:
        xs, ys = self._known()
        if not xs:
            return self.prior(x)
        i = bisect.bisect_left(xs, x)
        if i == 0:
            return ys[0]
        if i == len(xs):
            return ys[-1] * x / xs[-1]
        share = (x - xs[i - 1]) / max(xs[i] - xs[i - 1], 1e-9)
        return ys[i - 1] + share * (ys[i] - ys[i - 1])

    def _known(self) -> tuple[list[float], list[float]]:
        if self._points is None:
            keys = sorted(k for k, n in self._count.items() if n >= self.MIN_SAMPLES)
            self._points = [self._x[k] for k in keys], [self._y[k] for k in keys]
        return self._points


class StepLoad(NamedTuple):
    """What a step computes, as the cost model sees it."""

    num_tokens: int  # the target pass's tokens (decode windows and prefill chunks)
    num_rows: int
    depth: int  # MTP depths the step ran
    has_prefill: bool


# NOTE: CPU-sized guesses (seconds) used until a curve has samples: 2 ms + 0.2 ms a token for the target
# pass, 0.5 ms + 0.05 ms a token for a depth.
def _target_prior(n: float) -> float:
    return 2e-3 + 2e-4 * n


def _depth_prior(n: float) -> float:
    return 5e-4 + 5e-5 * n


class StepCosts:
    def __init__(self) -> None:
        self.decode = Curve(_target_prior)  # target(N) of decode-only steps
        self.mixed = Curve(_target_prior)  # target(N) of steps with a prefill chunk
        self.depth = Curve(_depth_prior)
        self.rest = Curve(lambda rows: 0.0)
        self.frozen = False
        self.predicted_seconds = 0.0  # sums over observed steps, for /metrics
        self.measured_seconds = 0.0

    def period(self, load: StepLoad) -> float:
        target = self.mixed if load.has_prefill else self.decode
        return target(load.num_tokens) + load.depth * self.depth(load.num_tokens) + self.rest(load.num_rows)

    def token_seconds(self, load: StepLoad) -> float:
        """What one more target-pass token per row adds to a step like `load`, per token."""
        more = load._replace(num_tokens=load.num_tokens + load.num_rows)
        return max(self.period(more) - self.period(load), 0.0) / max(load.num_rows, 1)

    def freeze(self) -> None:
        """Keep the device curves as they are (the start-up profile's, on a quiet machine); from now on
        only `rest` learns, as what the period takes beyond them."""
        self.frozen = True

    def observe(self, load: StepLoad, seconds: float, timing: StepTiming | None) -> None:
        """A finished step: its load, its period, and the device thread's times (None: not measured, as
        with the synthetic runner; then the period less the depths' estimate is the target's)."""
        predicted = self.period(load)
        self.predicted_seconds += predicted
        self.measured_seconds += seconds
        if self.frozen:
            self.rest.observe(load.num_rows, max(seconds - (predicted - self.rest(load.num_rows)), 0.0))
            return
        target = self.mixed if load.has_prefill else self.decode
        if timing is None:
            target.observe(load.num_tokens, max(seconds - load.depth * self.depth(load.num_tokens), 0.0))
            return
        target.observe(load.num_tokens, timing.target_seconds)
        if load.depth:
            self.depth.observe(load.num_tokens, timing.draft_seconds / load.depth)
        self.rest.observe(load.num_rows, max(seconds - timing.target_seconds - timing.draft_seconds, 0.0))
