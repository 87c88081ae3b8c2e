"""What one engine step hands to the output path: flat arrays, ready to be packed by an op."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class StepOutput(NamedTuple):
    step_id: int  # the device step whose results these are; -1 when none was collected
    request_ids: tuple[str, ...]  # [R] requests with new tokens or a finish
    num_tokens: np.ndarray  # [R] int32, new tokens per request (0 for e.g. an abort)
    token_ids: np.ndarray  # [sum(num_tokens)] int64, bounds-checked against the vocabulary
    finish_reasons: np.ndarray  # [R] uint8, request.FinishReason (0 = still running)

    @classmethod
    def empty(cls, step_id: int = -1) -> StepOutput:
        return cls(step_id, (), np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.uint8))

    def tokens_of(self, index: int) -> np.ndarray:
        start = int(self.num_tokens[:index].sum())
        return self.token_ids[start:start + int(self.num_tokens[index])]
