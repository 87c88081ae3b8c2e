"""Summarise step traces (MTP_STEP_TRACE, daemon/engine/step_trace.py).

    python scripts/step_trace.py /tmp/trace                       # every /tmp/trace.<pid>, per load and depth
    python scripts/step_trace.py /tmp/trace --schedule 0x60,1x10  # per position in MTP_DEPTH_SCHEDULE's blocks

Per load: for each rank's trace and each spell of steps (split at idle gaps over 5 s: a benchmark's
visits), per band of emitting rows, the time, the tokens emitted per second and the share of steps at
each depth; per depth, its decode steps' mean period, device time, quiet and priced times, and tokens per
second. Per schedule: the decode steps of the last spell at `--min-rows` emitting rows or more, by block
and position in the block: the period, the period over the quiet time, and tokens per second (a step's
tokens are the window its previous step drafted for, so a block's first step is the previous depth's)."""

from __future__ import annotations

import argparse
import collections
import glob

import numpy as np

from mtpserve.engine.step_trace import COLUMNS, DepthSchedule

BANDS = (("1-2 rows", 1, 2), ("3-6", 3, 6), ("7-24", 7, 24), ("25-48", 25, 48), ("49+", 49, 10**6))
POSITIONS = ((0, 1), (1, 2), (2, 4), (4, 10), (10, 20), (20, 40), (40, 10**6))


def load(path: str) -> dict[str, np.ndarray] | None:
    a = np.loadtxt(path, ndmin=2)
    if a.size == 0:
        return None
    return {c: a[:, i] for i, c in enumerate(COLUMNS)}


def spells(t: np.ndarray, gap: float) -> list[np.ndarray]:
    cuts = np.flatnonzero(np.diff(t) > gap) + 1
    return [s for s in np.split(np.arange(len(t)), cuts) if len(s) > 50]


def per_load(path: str, d: dict[str, np.ndarray], gap: float) -> None:
    for n, idx in enumerate(spells(d["time"], gap)):
        span = d["time"][idx[-1]] - d["time"][idx[0]]
        print(f"== {path} spell {n}: {len(idx)} steps in {span:.1f} s, "
              f"{d['emitted'][idx].sum() / max(span, 1e-9):.0f} tok/s")
        for name, lo, hi in BANDS:
            s = idx[(d["emitting"][idx] >= lo) & (d["emitting"][idx] <= hi)]
            if len(s) < 20:
                continue
            seconds = d["period_ms"][s].sum() / 1e3
            depths = collections.Counter(d["depth"][s].astype(int).tolist())
            share = " ".join(f"{k}:{100 * v / len(s):.0f}%" for k, v in sorted(depths.items()))
            print(f"  {name:9s} {seconds:6.1f} s {d['emitted'][s].sum() / seconds:7.0f} tok/s  "
                  f"{len(s):6d} steps  prefill {d['prefill'][s].mean():.2f}  depths {share}")
            for k in sorted(depths):
                m = s[(d["depth"][s] == k) & (d["prefill"][s] == 0)]
                if len(m) < 10:
                    continue
                col = {c: d[c][m].mean() for c in COLUMNS}
                print(f"    depth {k}: period {col['period_ms']:6.2f} device {col['target_ms'] + col['draft_ms']:6.2f}"
                      f" quiet {col['quiet_ms']:6.2f} priced {col['predicted_ms']:6.2f} rows {col['emitting']:5.1f}"
                      f" tok/step {col['emitted']:5.1f} tok/s {d['emitted'][m].sum() / d['period_ms'][m].sum() * 1e3:6.0f}")


def per_schedule(path: str, d: dict[str, np.ndarray], schedule: DepthSchedule, gap: float, min_rows: int) -> None:
    found = spells(d["time"], gap)
    if not found:
        return
    idx = found[-1]
    labels = np.array([(b, depth, i) for b, (depth, steps) in enumerate(schedule.blocks) for i in range(steps)])
    depth = d["depth"][idx].astype(int)
    # NOTE: the schedule counts launched steps from the first one served; align by the depths that ran
    offset = max(range(len(labels)),
                 key=lambda o: (labels[(o + np.arange(len(idx))) % len(labels), 1] == depth).mean())
    label = labels[(offset + np.arange(len(idx))) % len(labels)]
    print(f"== {path}: {len(idx)} steps, {(label[:, 1] == depth).mean():.0%} at the schedule's depth")
    ok = (d["emitting"][idx] >= min_rows) & (d["prefill"][idx] == 0) & (label[:, 1] == depth)
    for b, (block_depth, steps) in enumerate(schedule.blocks):
        for lo, hi in POSITIONS:
            m = idx[ok & (label[:, 0] == b) & (label[:, 2] >= lo) & (label[:, 2] < hi)]
            if lo >= steps or len(m) < 3:
                continue
            ratio = np.exp(np.mean(np.log(d["period_ms"][m] / d["quiet_ms"][m])))
            print(f"  block {b} depth {block_depth} steps {lo:3d}-{min(hi, steps):3d}: {len(m):4d} steps, period "
                  f"{d['period_ms'][m].mean():6.2f} ms, period/quiet {ratio:.3f}, tok/step {d['emitted'][m].mean():6.1f}, "
                  f"tok/s {d['emitted'][m].sum() / d['period_ms'][m].sum() * 1e3:6.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description="Summarise step traces per load and depth.")
    parser.add_argument("prefix")
    parser.add_argument("--gap", type=float, default=5.0, help="idle seconds that split spells")
    parser.add_argument("--schedule", help="the MTP_DEPTH_SCHEDULE the traced run used")
    parser.add_argument("--min-rows", type=int, default=1, help="with --schedule: fewest emitting rows counted")
    args = parser.parse_args()
    # NOTE: a trace is <prefix>.<pid>; a benchmark's JSON or plot beside it is not one
    for path in sorted(p for p in glob.glob(f"{args.prefix}.*") if p.rsplit(".", 1)[1].isdigit()):
        d = load(path)
        if d is None:
            continue
        if args.schedule:
            per_schedule(path, d, DepthSchedule.parse(args.schedule), args.gap, args.min_rows)
        else:
            per_load(path, d, args.gap)


if __name__ == "__main__":
    main()
