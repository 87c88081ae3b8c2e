"""Rank 0 -> ranks >= 1: each step's plan, broadcast on the device thread just before its forward.

Every collective of a step (this broadcast, then the model's all-reduces and all-gathers) is issued by
the device thread of each rank in launch order, so the ranks' collectives always pair up. Two
broadcasts per step: a fixed-size length header, then the msgpack payload. Synchronisation is the
collective runtime's own (CPU-side on a CPU host); there is no device barrier.
"""

from __future__ import annotations

import time

import numpy as np
import paddle
import paddle.distributed as dist

from mtpserve.engine.step_plan import StepPlan
from mtpserve.engine.tp_plan_codec import decode_plan, encode_plan
from mtpserve.model.parallel import TensorParallel

STOP = -1  # header value: no more steps, the followers return


class PlanChannel:
    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp
        self.comm_seconds = 0.0  # time spent in plan broadcasts (includes waiting for the peers)
        self.num_plans = 0
        self.num_bytes = 0

    def send(self, plan: StepPlan | None) -> None:
        """Rank 0: broadcast `plan` (None: the stop plan)."""
        payload = b"" if plan is None else encode_plan(plan)
        start = time.perf_counter()
        self._broadcast(paddle.to_tensor(np.array([len(payload) if plan else STOP], np.int64)))
        if payload:
            self._broadcast(paddle.to_tensor(np.frombuffer(payload, np.uint8)))
        self._count(start, len(payload))

    def recv(self) -> StepPlan | None:
        """Ranks >= 1: the next plan, or None after the stop plan."""
        start = time.perf_counter()
        header = paddle.zeros([1], dtype="int64")
        self._broadcast(header)
        n = int(header.numpy()[0])  # NOTE: host read of the size; this rank needs it to allocate
        if n == STOP:
            return None
        payload = paddle.zeros([n], dtype="uint8")
        self._broadcast(payload)
        self._count(start, n)
        return decode_plan(payload.numpy().tobytes())

    def _broadcast(self, x: paddle.Tensor) -> None:
        dist.broadcast(x, src=0, group=self.tp.group)

    def _count(self, start: float, n: int) -> None:
        self.comm_seconds += time.perf_counter() - start
        self.num_plans += 1
        self.num_bytes += n
