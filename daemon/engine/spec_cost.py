"""The step-time model the speculation policy plans with, measured on the machine it runs on.

What a step costs the engine's throughput is its period (engine_core._period: from the previous step's
finish to its own). Two layers:

1. The device's time for a step, as curves over what it computes (`StepCosts`):

       device = target(N) + a_target * C + D * (depth(N) + a_depth * C)

   target(N): the device thread's time for everything but drafting (target pass over N tokens, LM head,
   verification, logprobs), one curve for decode-only steps and one for steps with a prefill chunk (a
   decode token is also a logit row, a prompt token is not, and on a small model the LM head costs as
   much as a layer); depth(N): one MTP depth over the same N tokens (a step with a prefill chunk has a
   curve per number of depths instead, `StepCosts` says why); C: what the step's attention reads (a
   decode window's (query token, key) pairs, a prompt chunk's positions), and a_target, a_depth what
   each unit costs the target pass and a depth. The device thread's times come from the step itself
   (`StepTiming`), taken where it already waits for the device, so timing adds no sync. A short profile
   at start-up (rank_setup.profile_steps), serving nobody yet, fills them at every depth, a few batch
   sizes and a short and a long context, and prompts alone at every depth; then they are frozen.
2. What serving adds to it (`ServingExtra`): the period less the device time, measured by the rows
   that emit, apart for steps with a prefill chunk and without. The host loop, the HTTP process and any
   client share the cores with the device and add about as much to a step whatever depth it runs.

Each curve is a `Curve`, measured per cell and read between cells by interpolation: no functional form is
assumed (on a CPU the cost per token falls as batches grow, which a linear fit got wrong by 2x).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import numpy as np

from mtpserve.engine.step_plan import StepTiming


class Curve:
    """y(x) from samples: an exponentially weighted mean of x and y per cell (x in quarter octaves),
    interpolated linearly between cells; below the lowest cell its value (a small step costs what reading
    the weights costs, not less), above the highest its value per unit of x.

    A sample may come with a context c (what the step attends, `StepLoad.context`): `context_slope()` is
    what y grows by per unit of c, from the samples of cells that saw short and long contexts, and
    `settle(per_context)` ends the learning: each cell keeps the lower quartile of its samples' y less
    per_context * c, the cell's cost at no context (the caller adds per_context * c back)."""

    MIN_SAMPLES = 3
    WEIGHT = 0.05  # of a new sample: a cell follows its last ~20 samples
    QUANTILE = 0.25  # what a settled cell keeps
    KEPT = 256  # samples a cell remembers for it

    def __init__(self, prior: Callable[[float], float]) -> None:
        self.prior = prior
        self._x: dict[int, float] = {}
        self._y: dict[int, float] = {}
        self._count: dict[int, int] = {}
        self._samples: dict[int, deque[tuple[float, float]]] | None = {}  # a cell's last (y, c), until settled
        self._points: tuple[list[float], list[float]] | None = None  # the known cells, sorted

    def observe(self, x: float, y: float, context: float = 0.0) -> None:
        if self._samples is None:
            return
        key = round(4 * math.log2(max(x, 1.0)))
        count = self._count[key] = self._count.get(key, 0) + 1
        self._samples.setdefault(key, deque(maxlen=self.KEPT)).append((y, context))
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

    def context_slope(self) -> float:
        """Seconds per unit of context: per cell, the lower quartiles of its long-context and short-context
        samples (split halfway between its shortest and longest) over their contexts' difference; the
        median over the cells that saw both (0 if none did)."""
        slopes = []
        for samples in (self._samples or {}).values():
            ys, cs = np.array([y for y, _ in samples]), np.array([c for _, c in samples])
            long = cs > (cs.min() + cs.max()) / 2
            if long.sum() < self.MIN_SAMPLES or (~long).sum() < self.MIN_SAMPLES:
                continue
            rise = np.quantile(ys[long], self.QUANTILE) - np.quantile(ys[~long], self.QUANTILE)
            slopes.append(rise / (np.median(cs[long]) - np.median(cs[~long])))
        return max(float(np.median(slopes)), 0.0) if slopes else 0.0

    def settle(self, per_context: float = 0.0) -> None:
        """Keep each cell at the lower quartile of its samples (less `per_context` * their context), and
        learn no more.

        NOTE: the start-up profile's samples are the device's time plus whatever else ran on the host
        meanwhile (another process starting, the kernel's own work); that only ever adds time, and on
        this 2-core host one burst moved a cell's mean 20-30% between two profiles of one process, which
        is more than the depths differ by. A low quantile is the device's time on a quiet host."""
        if self._samples is None:
            return
        for key, samples in self._samples.items():
            self._y[key] = float(np.quantile([y - per_context * c for y, c in samples], self.QUANTILE))
        self._samples = None
        self._points = None

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
    context: int = 0  # what attention reads: decode windows' (query, key) pairs, prompt chunks' positions


# NOTE: CPU-sized guesses (seconds) used until a curve has samples: 2 ms + 0.2 ms a token for the target
# pass, 0.5 ms + 0.05 ms a token for a depth.
def _target_prior(n: float) -> float:
    return 2e-3 + 2e-4 * n


def _depth_prior(n: float) -> float:
    return 5e-4 + 5e-5 * n


class StepCosts:
    """The device's time for a step, as curves over what it computes. A decode step:

        device = target(N) + a_target * C + D * (depth(N) + a_depth * C),

    a step with a prefill chunk:

        device = mixed(N) + a_target * C + drafts_D(N) + D * a_depth * C,

    N the target pass's tokens, C what its attention reads (`StepLoad.context`), D the depths.

    NOTE: attention grows with the rows' contexts, which N does not see: measured here at 16 rows,
    384-token prompts instead of 32 doubled a depth-0 step (2.2 -> 4.4 ms) and each depth's draft time
    (0.7 -> 1.5 ms), and curves over N alone, profiled at short contexts, charged a depth half of what it
    costs in serving. A window's every token dots every key (speculation._context says what that did).

    NOTE: drafts_D, a curve per D, because a prompt's depths do not cost alike: the last depth runs its
    layer's MLP and head at the frontier only, the depths before it over every position (their hidden
    states feed the next). One 384-token prompt took 2.2 ms at one depth and 11.1 ms at three. Priced as
    D times a decode step's depth, a prompt token cost 8.5 us at depth 1 where serving's prompt chunks
    took 4.4 us (16 streams, code)."""

    def __init__(self) -> None:
        self.decode = Curve(_target_prior)  # target(N) of decode-only steps
        self.mixed = Curve(_target_prior)  # target(N) of steps with a prefill chunk
        self.depth = Curve(_depth_prior)  # depth(N) of decode-only steps
        self._mixed_drafts: dict[int, Curve] = {}  # drafts_D(N) of steps with a prefill chunk, by D
        self.per_context_target = 0.0  # a_target: seconds per attended position (0 until profiled)
        self.per_context_depth = 0.0  # a_depth
        self.frozen = False

    def mixed_drafts(self, depths: int) -> Curve:
        """drafts_D: the draft time of a step with a prefill chunk at D depths (until it has samples,
        D decode depths over as many tokens)."""
        curve = self._mixed_drafts.get(depths)
        if curve is None:
            curve = self._mixed_drafts[depths] = Curve(lambda n: depths * self.depth(n))
        return curve

    def device(self, load: StepLoad) -> float:
        """The device thread's time for a step like `load`, as the curves have it."""
        target = self.mixed if load.has_prefill else self.decode
        attention = (self.per_context_target + load.depth * self.per_context_depth) * load.context
        return target(load.num_tokens) + attention + self._drafts(load)

    def _drafts(self, load: StepLoad) -> float:
        """The depths' time for a step like `load`, less their attention."""
        if not load.depth:
            return 0.0
        if load.has_prefill:
            return self.mixed_drafts(load.depth)(load.num_tokens)
        return load.depth * self.depth(load.num_tokens)

    def device_token_seconds(self, load: StepLoad) -> float:
        """What one more target-pass token per row adds to the device time of a step like `load`, per
        token."""
        more = load._replace(num_tokens=load.num_tokens + load.num_rows)
        return max(self.device(more) - self.device(load), 0.0) / max(load.num_rows, 1)

    def freeze(self) -> None:
        """Keep the curves as they are (the start-up profile's, on a machine serving nobody): serving's
        own costs are measured apart (`ServingExtra`)."""
        self.per_context_target = self.decode.context_slope()
        self.per_context_depth = self.depth.context_slope()
        self.decode.settle(self.per_context_target)
        self.mixed.settle(self.per_context_target)
        self.depth.settle(self.per_context_depth)
        for depths, curve in self._mixed_drafts.items():
            curve.settle(depths * self.per_context_depth)
        self.frozen = True

    def observe(self, load: StepLoad, seconds: float, timing: StepTiming | None) -> None:
        """A finished step: its load, its period, and the device thread's times (None: not measured, as
        with the synthetic runner; then the period less the depths' estimate is the target's)."""
        if self.frozen:
            return
        target = self.mixed if load.has_prefill else self.decode
        if timing is None:
            target.observe(load.num_tokens, max(seconds - self._drafts(load), 0.0), load.context)
            return
        target.observe(load.num_tokens, timing.target_seconds, load.context)
        if not load.depth:
            return
        if load.has_prefill:
            self.mixed_drafts(load.depth).observe(load.num_tokens, timing.draft_seconds, load.context)
        else:
            self.depth.observe(load.num_tokens, timing.draft_seconds / load.depth, load.context)


class ServingExtra:
    """What serving adds to the device time of a step, by the rows that emit (half octaves), apart for
    steps with a prefill chunk and without, and for each depth a step ran: a running mean of the step's
    period less the device time the curves give for that very step.

    A depth is priced with its own mean at these rows while it is recent (its last step here no more than
    STALE_STEPS of this cell's steps ago), else with the mean of every depth's steps at the nearest rows
    measured (mostly the depth in use's); a depth run again after that starts its own mean afresh.

    NOTE: the host's work per step, the HTTP process and the clients share the cores with the device. Added,
    not scaled: a period-to-device ratio differed 2x between steps with a prompt chunk and without, and
    carried to a deeper depth it charged that depth for contention it does not cause. Depths run in turn
    in one process (step_trace's schedule) added about as much as each other to a decode step: 0.45, 0.50
    and 0.66 ms at depths 0-2 at 4 streams (1.8x, 1.4x and 1.3x their quiet cost), 4.5 and 4.7 ms at
    depths 0 and 1 at 64.

    NOTE: per depth, because the start-up profile's curves are what one launch measured: at 64 streams one
    launch priced depth 1's decode step at 2.4x depth 0's and the next at 3.0x (serving's steps: 1.8x).
    With one mean for every depth, learnt at the depth in use, that error stays in every other depth's
    price and decides the depth; a depth the policy has run is priced by what its own steps took.

    NOTE: recent only, because serving's share of the cores moves: a depth run for a few hundred steps at 4
    streams while a test ran beside the daemon learnt 2.3 ms, 3x the depth in use's 0.7 ms, and kept that
    price (and the policy off it) for the rest of the run. Forgotten after ~1,000 steps, a depth the curves
    favour is run again, for the ~MIN_SAMPLES steps its price takes, and priced by what it takes now.

    NOTE: apart for steps with a prefill chunk, because the two kinds miss in opposite directions. At 16
    streams on code, decode steps took 1.4 ms more than the quiet profile at depth 0 and at depth 1 alike,
    and steps with a prompt chunk 2-3 ms less (the profile's prefills carry no decode rows). One mean over
    both charged a decode step ~0.45 ms too little: 12% of a depth-0 step, 7% of a depth-1 step, enough to
    tip the choice to depth 0."""

    WEIGHT = 0.02  # of a step: a cell follows its last ~50 steps
    MIN_SAMPLES = 16
    STALE_STEPS = 1000

    def __init__(self) -> None:
        self._mean: dict[tuple[bool, int], float] = {}  # every depth's steps
        self._count: dict[tuple[bool, int], int] = {}
        self._depth_mean: dict[tuple[bool, int, int], float] = {}  # each depth's own
        self._depth_count: dict[tuple[bool, int, int], int] = {}
        self._depth_seen: dict[tuple[bool, int, int], int] = {}  # its cell's count at its last step

    @staticmethod
    def bucket(num_emitting: int) -> int:
        return round(2 * math.log2(max(num_emitting, 1)))

    def observe(self, num_emitting: int, seconds: float, device: float, has_prefill: bool = False,
                depth: int = 0) -> None:
        key, extra = (has_prefill, self.bucket(num_emitting)), seconds - device
        _update(self._mean, self._count, key, extra, self.WEIGHT)
        own = (*key, depth)
        if not self._is_recent(own):
            self._depth_count[own] = 0  # NOTE: a plain mean again, of what this depth takes now
        _update(self._depth_mean, self._depth_count, own, extra, self.WEIGHT)
        self._depth_seen[own] = self._count[key]

    def _has_own(self, own: tuple[bool, int, int]) -> bool:
        """Whether a depth's own mean prices it: enough steps, and recent."""
        return self._depth_count.get(own, 0) >= self.MIN_SAMPLES and self._is_recent(own)

    def _is_recent(self, own: tuple[bool, int, int]) -> bool:
        seen = self._depth_seen.get(own)
        return seen is not None and self._count[own[:2]] - seen <= self.STALE_STEPS

    def seconds(self, num_emitting: int, has_prefill: bool = False, depth: int | None = None) -> float:
        """At these rows (and this depth, if its steps have been measured here), else at the nearest rows
        measured, else nothing yet; never below 0 (a quiet profile is the least a step costs)."""
        return max(self.measured(num_emitting, has_prefill, depth), 0.0)

    def measured(self, num_emitting: int, has_prefill: bool = False, depth: int | None = None) -> float:
        """The mean itself, which is below 0 where serving's steps were shorter than the profile's curves
        (a prefill chunk beside decode rows); for a kind of step not measured yet, a decode step's."""
        key = self.bucket(num_emitting)
        own = (has_prefill, key, depth if depth is not None else -1)
        if self._has_own(own):
            return self._depth_mean[own]
        known = [b for (kind, b), n in self._count.items() if kind == has_prefill and n >= self.MIN_SAMPLES]
        if not known:
            return self.measured(num_emitting, depth=depth) if has_prefill else 0.0
        return self._mean[(has_prefill, min(known, key=lambda b: abs(b - key)))]

    def chunk_extra(self, num_emitting: int, depth: int) -> float:
        """What serving adds to a step with a prompt chunk beyond what it adds to a decode step, at these
        rows and depth: from this depth's own means when it has both kinds, else from every depth's.

        NOTE: from one source. Where a depth had its own decode mean and not yet its own chunk mean, the
        difference of `measured`'s two figures took the chunk steps of every depth less the decode steps
        of this one: this depth's own correction entered the prompts' share with the opposite sign to the
        one it has in the decode step's price."""
        key = self.bucket(num_emitting)
        mixed, decode = (True, key, depth), (False, key, depth)
        if self._has_own(mixed) and self._has_own(decode):
            return self._depth_mean[mixed] - self._depth_mean[decode]
        return self.measured(num_emitting, True) - self.measured(num_emitting)


_Key = TypeVar("_Key", tuple[bool, int], tuple[bool, int, int])


def _update(means: dict[_Key, float], counts: dict[_Key, int], key: _Key, value: float, weight: float) -> None:
    """A running mean that starts as a plain mean and then follows its last ~1/weight samples."""
    count = counts[key] = counts.get(key, 0) + 1
    mean = means.get(key, value)
    means[key] = mean + max(1.0 / count, weight) * (value - mean)
