"""A curve of the step-time model (spec_cost.py): one measured figure per cell of its input, read between cells
by interpolation, with what attention adds fitted apart and a settled (frozen) form that can be kept on disk
(spec_profile.py).

No functional form is assumed: on a CPU the cost per token falls as batches grow, which a linear fit got wrong
by 2x.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable

import msgspec
import numpy as np


class CurveState(msgspec.Struct, frozen=True, array_like=True):
    """A settled curve: per cell (quarter octave of x), its mean x, its settled y and how many samples it had."""

    cells: list[tuple[int, float, float, int]]

class Curve:
    """y(x) from samples: an exponentially weighted mean of x and y per cell (x in quarter octaves),
    interpolated linearly between cells; below the lowest cell its value (a small step costs what reading
    the weights costs, not less), above the highest its value per unit of x.

    A sample may come with what the step's attention reads: keys k and (query, key) pairs c (`StepLoad`).
    `attention_slopes()` is what y grows by per key and per pair, from the samples of cells that saw short
    and long contexts, and `settle(per_key, per_pair)` ends the learning: each cell keeps the lower
    quartile of its samples' y less per_key * k + per_pair * c, the cell's cost at no context (the caller
    adds that back)."""

    MIN_SAMPLES = 3
    WEIGHT = 0.05  # of a new sample: a cell follows its last ~20 samples
    QUANTILE = 0.25  # what a settled cell keeps
    KEPT = 256  # samples a cell remembers for it

    def __init__(self, prior: Callable[[float], float]) -> None:
        self.prior = prior
        self._x: dict[int, float] = {}
        self._y: dict[int, float] = {}
        self._count: dict[int, int] = {}
        self._samples: dict[int, deque[tuple[float, float, float]]] | None = {}  # a cell's last (y, c, k), until settled
        self._points: tuple[list[float], list[float]] | None = None  # the known cells, sorted
        self._at: dict[int, int] = {}  # a known cell's place in them

    def observe(self, x: float, y: float, context: float = 0.0, keys: float = 0.0) -> None:
        if self._samples is None:
            return
        key = round(4 * math.log2(max(x, 1.0)))
        count = self._count[key] = self._count.get(key, 0) + 1
        samples = self._samples.get(key)
        if samples is None:
            samples = self._samples[key] = deque(maxlen=self.KEPT)
        samples.append((y, context, keys))
        # NOTE: a plain mean until the weight takes over, so a cell's first (often slow) sample fades
        weight = max(1.0 / count, self.WEIGHT)
        self._x[key] = self._x.get(key, x) + weight * (x - self._x.get(key, x))
        self._y[key] = self._y.get(key, y) + weight * (y - self._y.get(key, y))
        points, at = self._points, self._at.get(key)
        if points is not None and at is not None:
            # NOTE: a known cell moves in place: sorted again, every step's prediction cost ~10 us
            points[0][at], points[1][at] = self._x[key], self._y[key]
        elif count >= self.MIN_SAMPLES:
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

    def attention_slopes(self) -> tuple[float, float]:
        """Seconds per key read and per (query, key) pair: per cell and window (pairs per key), the lower
        quartiles of its long-context and short-context samples (split halfway between its fewest and most
        keys) and the medians of their keys and pairs; then the two slopes that fit those rises best, by
        least squares, neither below 0 ((0, 0) if no cell saw both contexts).

        NOTE: a window's keys are read once and every query dots every key (spec_load.plan_load), so a
        window of w tokens pays the keys' cost once and the pairs' w times. Where the KV outgrows the
        caches, reading a key costs more than a dot product: priced per pair alone, a depth-0 step at 64
        rows of ~360-token contexts took 1.72x its curves' time and a depth-1 step 1.19x (docs/benchmarks.md,
        the fifty-first session), and a depth's price lent to another was wrong by the difference."""
        rises: list[tuple[float, float, float]] = []  # (keys, pairs, seconds) more, long over short
        for samples in (self._samples or {}).values():
            by_window: dict[int, list[tuple[float, float, float]]] = {}
            for y, c, k in samples:
                by_window.setdefault(round(c / k) if k > 0 else 0, []).append((y, c, k))
            for group in by_window.values():
                ys, cs, ks = (np.array(column) for column in zip(*group))
                long = ks > (ks.min() + ks.max()) / 2
                if long.sum() < self.MIN_SAMPLES or (~long).sum() < self.MIN_SAMPLES:
                    continue
                rises.append((float(np.median(ks[long]) - np.median(ks[~long])),
                              float(np.median(cs[long]) - np.median(cs[~long])),
                              float(np.quantile(ys[long], self.QUANTILE) - np.quantile(ys[~long], self.QUANTILE))))
        return _nonnegative_fit(rises)

    def settle(self, per_key: float = 0.0, per_pair: float = 0.0) -> None:
        """Keep each cell at the lower quartile of its samples (less `per_key` * their keys and `per_pair` *
        their pairs), and learn no more.

        NOTE: the start-up profile's samples are the device's time plus whatever else ran on the host
        meanwhile (another process starting, the kernel's own work); that only ever adds time, and on
        this 2-core host one burst moved a cell's mean 20-30% between two profiles of one process, which
        is more than the depths differ by. A low quantile is the device's time on a quiet host."""
        if self._samples is None:
            return
        for key, samples in self._samples.items():
            self._y[key] = float(np.quantile([y - per_key * k - per_pair * c for y, c, k in samples],
                                             self.QUANTILE))
        self._samples = None
        self._points = None

    def state(self) -> CurveState:
        """What the settled curve holds (it must be settled: a learning one holds its samples too)."""
        assert self._samples is None, "only a settled curve is kept"
        return CurveState([(key, self._x[key], self._y[key], count) for key, count in sorted(self._count.items())])

    def restore(self, state: CurveState) -> None:
        """Hold what `state` says, settled (whatever it had learnt is dropped)."""
        self._x = {key: x for key, x, _, _ in state.cells}
        self._y = {key: y for key, _, y, _ in state.cells}
        self._count = {key: count for key, _, _, count in state.cells}
        self._samples = None
        self._points = None

    def _known(self) -> tuple[list[float], list[float]]:
        if self._points is None:
            keys = sorted(k for k, n in self._count.items() if n >= self.MIN_SAMPLES)
            self._points = [self._x[k] for k in keys], [self._y[k] for k in keys]
            self._at = {k: i for i, k in enumerate(keys)}
        return self._points


def low_quantile(values: list[float]) -> float:
    """The lower quartile of `values` (as a settled cell keeps), never below 0; 0 for none."""
    return max(float(np.quantile(values, Curve.QUANTILE)), 0.0) if values else 0.0


def _nonnegative_fit(rises: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(a, b) >= 0 that minimise the squared error of a * keys + b * pairs against seconds over `rises`."""
    if not rises:
        return 0.0, 0.0
    keys, pairs, seconds = (np.array(column) for column in zip(*rises))
    both = np.linalg.lstsq(np.stack([keys, pairs], axis=1), seconds, rcond=None)[0]
    if both.min() >= 0:
        return float(both[0]), float(both[1])
    alone = [max(float(seconds @ x) / max(float(x @ x), 1e-30), 0.0) for x in (keys, pairs)]
    errors = [float(np.square(seconds - alone[0] * keys).sum()), float(np.square(seconds - alone[1] * pairs).sum())]
    return (alone[0], 0.0) if errors[0] <= errors[1] else (0.0, alone[1])
