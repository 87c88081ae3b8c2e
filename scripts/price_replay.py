"""How well what serving adds (spec_extra.ServingExtra) prices the depth not in use: a replay of a step trace
taken with two depths in turn, where what serving added to both depths is known at every moment.

    MTP_DEPTH_SCHEDULE=0x100,1x100 MTP_STEP_TRACE=/tmp/alt mtpserve serve --num-speculative-tokens 3 &
    mtpserve bench serve --concurrency 64 --num-prompts 1920 --input-len 256 --output-len 128
    .venv/bin/python scripts/price_replay.py /tmp/alt.<pid> --rows 56 64 [--extra OLD.py ...] [--json OUT]

The decode steps at `--rows` emitting rows, after the start-up profile (its steps end at the trace's first
pause of a second or more). The truth for a depth at a step: the mean of what serving added to that depth's
steps within TRUTH_STEPS either side. Each scenario is replayed into a fresh ServingExtra, which is asked at
every third step for the price of the depth not in use less the price of the depth in use; its error is
that less the truth's difference, as a share of the step's period:
- `in turn`: every step is fed, the depths alternating as the schedule ran them;
- `left early, D`: depth D's first LEFT_STEPS steps are fed (a depth run only in the first, slow steps of
  serving), then only the other depth's;
- `sought, D`: depth D's ServingExtra.MIN_SAMPLES steps after the SEEK_AT-th are fed (`Speculation` seeks a
  deeper depth that way), then only the other depth's;
- `left at a burst, D`: every step up to depth D's BURST_AT-th, the last BURST_STEPS of D's before it taking
  BURST of their period more (a burst of host load, which had the policy leave D), then only the other depth's.
Prints the mean error and the mean absolute error per scenario for the ServingExtra of this tree and of
each `--extra` file (a module defining one, e.g. `git show REV:daemon/engine/spec_extra.py > OLD.py`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np

from mtpserve.engine.spec_extra import ServingExtra
from mtpserve.engine.step_trace import COLUMNS

TRUTH_STEPS = 100
LEFT_STEPS = 20
SEEK_AT = 50
# NOTE: at 64 streams on code, the decode steps of the depth in use took ~3.5 ms (~18% of a step) more for
# ~20-30 steps while a wave of new requests arrived; the policy left that depth on that price
BURST_AT, BURST_STEPS, BURST = 500, 25, 0.18
EVERY = 3
PROFILE_PAUSE = 1.0  # seconds: the start-up profile ends at the first pause this long


class Extra(Protocol):
    def observe(self, num_emitting: int, seconds: float, device: float, has_prefill: bool = False,
                depth: int = 0) -> None: ...

    def seconds(self, num_emitting: int, has_prefill: bool = False, depth: int | None = None) -> float: ...


class Steps:
    """The decode steps replayed: emitting rows, depth, period and quiet time (seconds), in order."""

    def __init__(self, path: Path, rows: tuple[int, int]) -> None:
        a = np.loadtxt(path, ndmin=2)
        col = {c: a[:, i] for i, c in enumerate(COLUMNS)}
        pauses = np.flatnonzero(np.diff(col["time"]) >= PROFILE_PAUSE)
        serving = np.arange(len(a)) > (pauses[0] if pauses.size else -1)
        keep = serving & (col["prefill"] == 0) & (col["emitting"] >= rows[0]) & (col["emitting"] <= rows[1])
        self.emitting = col["emitting"][keep].astype(int)
        self.depth = col["depth"][keep].astype(int)
        self.period = col["period_ms"][keep] * 1e-3
        self.quiet = col["quiet_ms"][keep] * 1e-3
        depths, counts = np.unique(self.depth, return_counts=True)
        self.depths = tuple(int(d) for d in depths[np.argsort(counts)[-2:]])  # the schedule's two
        self.truth = {d: self._truth(d) for d in self.depths}

    def _truth(self, depth: int) -> np.ndarray:
        """[steps] the mean extra of this depth's steps within TRUTH_STEPS either side (nan where none)."""
        mine = (self.depth == depth).astype(float)
        extra = np.where(mine > 0, self.period - self.quiet, 0.0)
        window = np.ones(2 * TRUTH_STEPS + 1)
        total, count = np.convolve(extra, window, "same"), np.convolve(mine, window, "same")
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)

    def other(self, depth: int) -> int:
        return self.depths[0] if depth == self.depths[1] else self.depths[1]


def replay(steps: Steps, make: Callable[[], Extra], fed: np.ndarray, score_from: int,
           added: np.ndarray | None = None) -> tuple[float, float, int]:
    """Feed the steps where `fed` (their periods `added` share longer, if given), and at every EVERY-th of them
    from `score_from` on, score the price of the depth not in use: (mean error, mean absolute error, count)."""
    extra, errors = make(), []
    period = steps.period if added is None else steps.period * (1.0 + added)
    for i in np.flatnonzero(fed):
        depth, em = int(steps.depth[i]), int(steps.emitting[i])
        other = steps.other(depth)
        if i >= score_from and i % EVERY == 0:
            truth = steps.truth[other][i] - steps.truth[depth][i]
            price = extra.seconds(em, depth=other) - extra.seconds(em, depth=depth)
            if not np.isnan(truth):
                errors.append((price - truth) / steps.period[i])
        extra.observe(em, float(period[i]), float(steps.quiet[i]), False, depth)
    e = np.array(errors)
    return (float(e.mean()), float(np.abs(e).mean()), len(e)) if e.size else (float("nan"), float("nan"), 0)


def scenarios(steps: Steps) -> dict[str, tuple[np.ndarray, int, np.ndarray | None]]:
    """Which steps each scenario feeds, the first step it scores, and what share longer each period is."""
    index = np.arange(len(steps.depth))
    out: dict[str, tuple[np.ndarray, int, np.ndarray | None]] = {"in turn": (np.ones(len(index), bool), 0, None)}
    for d in steps.depths:
        mine = np.flatnonzero(steps.depth == d)
        for name, chosen in ((f"left early, {d}", mine[:LEFT_STEPS]),
                             (f"sought, {d}", mine[SEEK_AT:SEEK_AT + ServingExtra.MIN_SAMPLES])):
            # NOTE: scored after the depth's last fed step: every step fed from there is the other depth's
            out[name] = ((steps.depth != d) | np.isin(index, chosen), int(chosen[-1]) + 1, None)
        if mine.size > BURST_AT:
            left = int(mine[BURST_AT])
            added = np.where(np.isin(index, mine[BURST_AT - BURST_STEPS:BURST_AT]), BURST, 0.0)
            out[f"left at a burst, {d}"] = ((steps.depth != d) | (index < left), left, added)
    return out


def load_extra(path: Path) -> Callable[[], Extra]:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ServingExtra


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path)
    p.add_argument("--rows", type=int, nargs=2, default=(1, 10**6), metavar=("LOW", "HIGH"))
    p.add_argument("--extra", type=Path, nargs="*", default=[])
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    steps = Steps(args.trace, tuple(args.rows))
    makers: dict[str, Callable[[], Extra]] = {"this tree": ServingExtra, **{x.name: load_extra(x) for x in args.extra}}
    print(f"{args.trace}: {len(steps.depth)} decode steps at {args.rows[0]}-{args.rows[1]} emitting rows, depths "
          f"{steps.depths}; the other depth's price less the truth, share of the period: mean / mean |.|")
    report: dict[str, dict[str, list[float]]] = {}
    for name, (fed, score_from, added) in scenarios(steps).items():
        row = report[name] = {}
        for label, make in makers.items():
            mean, absolute, count = replay(steps, make, fed, score_from, added)
            row[label] = [mean, absolute, count]
        print(f"  {name:20s}" + "".join(f"  {label}: {m:+.3f} / {a:.3f}" for label, (m, a, _) in row.items()))
    if args.json:
        args.json.write_text(json.dumps({"trace": str(args.trace), "rows": args.rows, "scenarios": report}, indent=2))


if __name__ == "__main__":
    main()
