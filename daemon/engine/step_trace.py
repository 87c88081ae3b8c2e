"""Debugging aids for the speculation policy on a real load, off unless their environment variable is set.

- `MTP_STEP_TRACE=<prefix>`: each rank process appends one line per finished step to `<prefix>.<pid>`:
  the time, what the step computed (`StepLoad`), its period, the device thread's times, what the cost
  model made of it, and the tokens it emitted (`COLUMNS`); and a `#d` line per decision of the policy:
  the rows that emit, the depth chosen (or sought), and per depth the expected tokens, the priced period,
  the prompts' share of it, what serving adds to it and what caution adds for the choice (a deeper depth's
  price is taken some standard errors high).
- `MTP_DEPTH_SCHEDULE=<depth>x<steps>,...` (e.g. `0x60,1x10,0x60,1x60`): every step's drafts are capped
  at the schedule's depth, in a cycle, instead of the policy's choice; with the trace, steady runs of each
  depth and short excursions to another can be compared in one process, at one moment of the host.

`scripts/step_trace.py` summarises a trace per load and depth, or per position in a schedule.

NOTE: not `MTPSERVE_*` variables: those are configuration keys, and the configuration rejects unknown
ones. A benchmark's throughput says that a policy lost, not where: the trace found depth 3 underpriced at
one stream, and the schedule that a depth run for a few steps among another's is not its steady cost."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TextIO

from mtpserve.engine.spec_cost import StepLoad
from mtpserve.engine.step_plan import StepTiming

TRACE_ENV = "MTP_STEP_TRACE"
SCHEDULE_ENV = "MTP_DEPTH_SCHEDULE"
COLUMNS = ("time", "tokens", "rows", "emitting", "depth", "prefill", "context", "keys", "prefix", "period_ms",
           "target_ms", "draft_ms", "quiet_ms", "predicted_ms", "emitted")
# NOTE: a decision's figures as functions of the depth: the expected tokens, the priced period, the prompts'
# share of it, what serving adds to it, and what caution adds to it for the choice (spec_seek.doubt_seconds)
Prices = tuple[Callable[[int], float], Callable[[int], float], Callable[[int], float], Callable[[int], float],
               Callable[[int], float]]


class StepTrace:
    def __init__(self, out: TextIO) -> None:
        self._out = out

    @classmethod
    def from_env(cls) -> StepTrace | None:
        prefix = os.environ.get(TRACE_ENV)
        return cls.to_file(f"{prefix}.{os.getpid()}") if prefix else None

    @classmethod
    def to_file(cls, path: str) -> StepTrace:
        """A trace appended to `path`, after a line naming its columns."""
        out = open(path, "a", buffering=1 << 16)  # noqa: SIM115 (lives with the process)
        out.write("# " + " ".join(COLUMNS) + "\n")
        return cls(out)

    def flush(self) -> None:
        self._out.flush()

    def decision(self, num_emitting: int, depth: int, depths: range, prices: Prices) -> None:
        """Per depth: expected tokens / priced period / the prompts' share of it / what serving adds / caution (ms)."""
        tokens, periods, prompts, extras, doubts = ([price(d) for d in depths] for price in prices)
        figures = " ".join(f"{t:.1f}/{p * 1e3:.2f}/{q * 1e3:.2f}/{e * 1e3:.2f}/{c * 1e3:.2f}"
                           for t, p, q, e, c in zip(tokens, periods, prompts, extras, doubts))
        self._out.write(f"#d {time.monotonic():.4f} {num_emitting} {depth} {figures}\n")

    def record(self, load: StepLoad, period: float, timing: StepTiming | None, quiet: float, predicted: float,
               emitted: int) -> None:
        target, draft = (timing.target_seconds, timing.draft_seconds) if timing is not None else (0.0, 0.0)
        self._out.write(f"{time.monotonic():.4f} {load.num_tokens} {load.num_rows} {load.num_emitting} "
                        f"{load.depth} {int(load.has_prefill)} {load.context} {load.keys} {load.prefix} "
                        f"{period * 1e3:.3f} {target * 1e3:.3f} {draft * 1e3:.3f} {quiet * 1e3:.3f} "
                        f"{predicted * 1e3:.3f} {emitted}\n")


class DepthSchedule:
    """Depths for consecutive steps, in a cycle: [(depth, steps), ...]."""

    def __init__(self, blocks: list[tuple[int, int]]) -> None:
        if not blocks or any(depth < 0 or steps < 1 for depth, steps in blocks):
            raise ValueError(f"{SCHEDULE_ENV}: blocks of <depth>x<steps>, depth >= 0, steps >= 1")
        self.blocks = blocks
        self._step = 0

    @classmethod
    def parse(cls, text: str) -> DepthSchedule:
        try:
            blocks = [(int(depth), int(steps)) for depth, steps in
                      (part.split("x") for part in text.split(",") if part.strip())]
        except ValueError:
            raise ValueError(f"{SCHEDULE_ENV}={text!r}: expected <depth>x<steps>,...") from None
        return cls(blocks)

    @classmethod
    def from_env(cls) -> DepthSchedule | None:
        text = os.environ.get(SCHEDULE_ENV)
        return cls.parse(text) if text else None

    def next_depth(self) -> int:
        position = self._step % sum(steps for _, steps in self.blocks)
        self._step += 1
        for depth, steps in self.blocks:
            if position < steps:
                return depth
            position -= steps
        raise AssertionError("unreachable")
