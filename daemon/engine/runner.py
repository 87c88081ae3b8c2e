"""The contract between the engine core and whatever executes steps (synthetic device or model)."""

from __future__ import annotations

import concurrent.futures
from typing import Protocol

from mtpserve.engine.step_plan import StepPlan, StepResult


class ModelRunner(Protocol):
    """Executes steps in launch order on a device (a CUDA stream, or a dedicated thread on CPU).

    1. `launch(plan)` enqueues the step and returns at once; it never waits for earlier steps.
    2. On the device, a step first applies the plan's slot inserts and block-table writes, then runs
       the rows: decode windows read their last token and drafts from device state, rows of slots
       that already stopped are marked invalid and write no KV, verification and stop checks run
       on the device, and the next drafts are proposed into device state.
    3. The returned future completes with the step's emitted tokens as host arrays; waiting on it
       is the one host synchronisation per step (the rank loop awaits it, `EngineCore.step` blocks).
    """

    vocab_size: int
    num_speculative_tokens: int

    def launch(self, plan: StepPlan) -> concurrent.futures.Future[StepResult]: ...

    def busy_seconds(self) -> float:
        """Device time spent executing steps since start."""
        ...

    def close(self) -> None: ...
