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
few batch sizes, on a machine that serves nobody yet, and freezes them. While serving, what is learnt is
how the load stretches them, per batch size: period = added + factor x device (`Stretch`).

NOTE: under load the host's work (the rank loop, the HTTP process streaming a chunk per row, a client
on the same machine) shares the cores with the device: on this host a decode step of 64 rows took
6.6 ms in the profile and 17-19 ms serving 64 streams. Part of that is added per step whatever the
depth, which favours deeper windows (fewer steps per token); part slows the device's own work in
proportion. Learnt into the device curves at the depth in use, it would make every other depth look
cheap or dear by the wrong amount; fitted as one added and one proportional part, it carries over to
the depths not in use.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

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
    num_emitting: int = 0  # rows that emit (decode windows, last prompt chunks)


# NOTE: CPU-sized guesses (seconds) used until a curve has samples: 2 ms + 0.2 ms a token for the target
# pass, 0.5 ms + 0.05 ms a token for a depth.
def _target_prior(n: float) -> float:
    return 2e-3 + 2e-4 * n


def _depth_prior(n: float) -> float:
    return 5e-4 + 5e-5 * n


class Stretch:
    """How serving stretches the device's quiet step time at one batch size: period = added + factor x
    device, fitted by recursive least squares with forgetting (in milliseconds).

    NOTE: both parts are real on a CPU host. The host's work per step (a chunk per row to stream, the
    rank loop's bookkeeping) is added whatever the depth; the threads sharing the cores also slow the
    device's own work in proportion. Steps of one batch size vary in device time (prompt chunks come and
    go, the depth changes), which is what tells the two apart."""

    FORGET = 0.98  # a sample's weight halves after ~35 steps
    PRIOR = (0.0, 1.0)  # nothing added, no stretch
    PRIOR_COVARIANCE = (25.0, 1.0)  # (5 ms)^2, 1
    FACTOR_RANGE = (0.5, 5.0)

    def __init__(self) -> None:
        self.theta = np.array(self.PRIOR)
        self.covariance = np.diag(self.PRIOR_COVARIANCE)
        self._max_trace = float(sum(self.PRIOR_COVARIANCE))

    def __call__(self, device: float) -> float:
        added, factor = self.theta.tolist()
        low, high = self.FACTOR_RANGE
        return max(added, 0.0) * 1e-3 + min(max(factor, low), high) * device

    def observe(self, device: float, seconds: float) -> None:
        x = np.array([1.0, device * 1e3])
        px = self.covariance @ x
        gain = px / (self.FORGET + x @ px)
        self.theta = self.theta + gain * (seconds * 1e3 - x @ self.theta)
        self.covariance = (self.covariance - np.outer(gain, px)) / self.FORGET
        # NOTE: a steady load varies in one direction only; forgetting would inflate the other without
        # bound, so the covariance is kept within the prior's size
        trace = float(np.trace(self.covariance))
        if trace > self._max_trace:
            self.covariance *= self._max_trace / trace


class StepCosts:
    def __init__(self) -> None:
        self.decode = Curve(_target_prior)  # target(N) of decode-only steps
        self.mixed = Curve(_target_prior)  # target(N) of steps with a prefill chunk
        self.depth = Curve(_depth_prior)
        self.rest = Curve(lambda rows: 0.0)
        self.frozen = False
        self.stretch: dict[int, Stretch] = {}  # by rows in quarter octaves, once frozen
        self.predicted_seconds = 0.0  # sums over observed steps, for /metrics
        self.measured_seconds = 0.0

    def device(self, load: StepLoad) -> float:
        """The device thread's time for a step like `load`, as the curves have it."""
        target = self.mixed if load.has_prefill else self.decode
        return target(load.num_tokens) + load.depth * self.depth(load.num_tokens)

    def period(self, load: StepLoad) -> float:
        if self.frozen:
            return self._stretch(load.num_rows)(self.device(load))
        return self.device(load) + self.rest(load.num_rows)

    def device_token_seconds(self, load: StepLoad) -> float:
        """What one more target-pass token per row adds to the device time of a step like `load`, per
        token."""
        more = load._replace(num_tokens=load.num_tokens + load.num_rows)
        return max(self.device(more) - self.device(load), 0.0) / max(load.num_rows, 1)

    def freeze(self) -> None:
        """Keep the device curves as they are (the start-up profile's, on a machine serving nobody);
        from now on serving learns how it stretches them, per batch size (`Stretch`)."""
        self.frozen = True

    def observe(self, load: StepLoad, seconds: float, timing: StepTiming | None) -> None:
        """A finished step: its load, its period, and the device thread's times (None: not measured, as
        with the synthetic runner; then the period less the depths' estimate is the target's)."""
        self.predicted_seconds += self.period(load)
        self.measured_seconds += seconds
        if self.frozen:
            key = _rows_key(load.num_rows)
            self.stretch.setdefault(key, Stretch()).observe(self.device(load), seconds)
            return
        target = self.mixed if load.has_prefill else self.decode
        if timing is None:
            target.observe(load.num_tokens, max(seconds - load.depth * self.depth(load.num_tokens), 0.0))
            return
        target.observe(load.num_tokens, timing.target_seconds)
        if load.depth:
            self.depth.observe(load.num_tokens, timing.draft_seconds / load.depth)
        self.rest.observe(load.num_rows, max(seconds - timing.target_seconds - timing.draft_seconds, 0.0))

    def _stretch(self, num_rows: int) -> Stretch:
        """This batch size's fit, else the nearest batch size's, else none yet (the prior)."""
        key = _rows_key(num_rows)
        if key in self.stretch:
            return self.stretch[key]
        if self.stretch:
            return self.stretch[min(self.stretch, key=lambda k: abs(k - key))]
        return Stretch()


def _rows_key(num_rows: int) -> int:
    return round(4 * math.log2(max(num_rows, 1)))


class ServingExtra:
    """What serving adds to the device time of a step, by the rows that emit (half octaves) and depth:
    a running mean per cell of the step's period less the device time the curves give for that very
    step, over every step of that shape.

    NOTE: measured on this host at 64 rows: decode steps at depth 0 took 16.8 ms for 7.4 ms of device
    time, at depth 1 23.6 ms for 15.2, and steps with a prompt chunk 53 ms for 47: serving adds about as
    much to a step whatever it computes (the host's work per step, the HTTP process and the client
    streaming a chunk per row, on the same cores). Added, not scaled: a ratio would differ 2x between
    steps with a prompt chunk and without, and carried to a deeper depth would charge it for contention
    it does not cause."""

    WEIGHT = 0.02  # of a step: a cell follows its last ~50 steps (two probes)
    MIN_SAMPLES = 16

    def __init__(self) -> None:
        self._mean: dict[tuple[int, int], float] = {}
        self._count: dict[tuple[int, int], int] = {}

    @staticmethod
    def bucket(num_emitting: int) -> int:
        return round(2 * math.log2(max(num_emitting, 1)))

    def observe(self, num_emitting: int, depth: int, seconds: float, device: float) -> None:
        key, extra = (self.bucket(num_emitting), depth), seconds - device
        count = self._count[key] = self._count.get(key, 0) + 1
        weight = max(1.0 / count, self.WEIGHT)
        self._mean[key] = self._mean.get(key, extra) + weight * (extra - self._mean.get(key, extra))

    def seconds(self, num_emitting: int, depth: int) -> float | None:
        key = self.bucket(num_emitting), depth
        return self._mean[key] if self._count.get(key, 0) >= self.MIN_SAMPLES else None
