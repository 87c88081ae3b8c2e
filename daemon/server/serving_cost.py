"""The HTTP process's CPU per streamed token, measured here and sent to the engine (`ServingCost`).

On a CPU device this process computes on the device's cores: each token it streams (detokenized, framed
as an SSE event, written) takes CPU time the step's kernels would have had. The speculation policy
charges each token a step emits this much, so a deeper draft's extra tokens pay for their streaming
(docs/speculation.md). Measured here, where the work is: the engine cannot see this process's CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from mtpserve.ipc.request_channel import ServingCost

INTERVAL_S = 1.0  # one figure a second at most
MIN_TOKENS = 64  # fewer in an interval: too few to divide by (health checks and scrapes dominate)


class ServingCostMeter:
    def __init__(self, cpu_clock: Callable[[], float] = time.process_time,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._cpu_clock, self._clock = cpu_clock, clock
        self._cpu, self._tokens, self._at = cpu_clock(), 0, clock()

    def sample(self, tokens_streamed: int) -> ServingCost | None:
        """`tokens_streamed`: every token streamed since start. A figure once an interval has passed
        with enough tokens in it; either way the interval starts again, so an idle spell's CPU (scrapes,
        health checks) is never divided by the tokens after it."""
        now = self._clock()
        if now - self._at < INTERVAL_S:
            return None
        cpu, tokens = self._cpu_clock(), tokens_streamed - self._tokens
        cost = ServingCost(cpu_seconds_per_token=(cpu - self._cpu) / tokens) if tokens >= MIN_TOKENS else None
        self._cpu, self._tokens, self._at = cpu, tokens_streamed, now
        return cost
