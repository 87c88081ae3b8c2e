"""Per-slot sampling parameters and penalty state, device-resident on a CPU device (numpy), and the
per-row `RowParams` the sampler reads for a step's verify rows."""

from __future__ import annotations

import numpy as np
import paddle

from mtpserve.engine.sampler import RowParams
from mtpserve.engine.slot_state import SlotState
from mtpserve.engine.step_plan import StepPlan
from mtpserve.host_tensor import host_tensor


class SlotSampling:
    def __init__(self, num_slots: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        f32 = lambda fill: np.full(num_slots, fill, np.float32)  # noqa: E731
        self.temperature, self.top_p, self.min_p = f32(1.0), f32(1.0), f32(0.0)
        self.presence, self.frequency, self.repetition = f32(0.0), f32(0.0), f32(1.0)
        self.top_k = np.zeros(num_slots, np.int64)
        self.num_logprobs = np.full(num_slots, -1, np.int64)
        self.has_penalty = np.zeros(num_slots, bool)
        self.counts = np.zeros((num_slots, vocab_size), np.float32)  # [S, V] output-token counts
        self.prompt_mask = np.zeros((num_slots, vocab_size), bool)  # [S, V]

    def apply_inserts(self, plan: StepPlan) -> None:
        for ins in plan.inserts:
            s = ins.slot
            self.temperature[s], self.top_p[s], self.min_p[s] = ins.temperature, ins.top_p, ins.min_p
            self.presence[s], self.frequency[s] = ins.presence, ins.frequency
            self.repetition[s], self.top_k[s] = ins.repetition, ins.top_k
            self.num_logprobs[s] = ins.num_logprobs
            self.has_penalty[s] = ins.presence != 0 or ins.frequency != 0 or ins.repetition != 1
            self.counts[s] = np.bincount(ins.output_ids, minlength=self.vocab_size)[:self.vocab_size]
            self.prompt_mask[s] = False
            self.prompt_mask[s, ins.prompt_ids] = True

    def count(self, slots: np.ndarray, token_ids: np.ndarray) -> None:
        """token_ids: [B, k+1], -1 padded: add this step's emitted tokens to the counts."""
        rows, cols = np.nonzero(token_ids >= 0)
        np.add.at(self.counts, (slots[rows], token_ids[rows, cols]), 1.0)

    def row_params(self, slots: np.ndarray, out_index: np.ndarray, state: SlotState) -> RowParams:
        """slots: [B]; out_index: [B, W] output position of each verify row -> RowParams of B*W rows."""
        width = out_index.shape[1]
        per_row = lambda a: host_tensor(np.repeat(a[slots], width, axis=0))  # noqa: E731
        return RowParams(
            temperature=per_row(self.temperature), top_p=per_row(self.top_p),
            top_k=per_row(self.top_k), min_p=per_row(self.min_p), presence=per_row(self.presence),
            frequency=per_row(self.frequency), repetition=per_row(self.repetition),
            min_tokens=per_row(state.min_tokens), out_index=host_tensor(out_index.reshape(-1)),
            keys=per_row(state.keys), stop_ids=per_row(state.stop_ids),
            needs_sort=bool(((self.top_k[slots] > 0) | (self.top_p[slots] < 1)).any()))

    def penalty_inputs(self, slots: np.ndarray, drafts: np.ndarray
                       ) -> tuple[paddle.Tensor, paddle.Tensor] | None:
        """Counts and prompt mask per verify row, or None when no row has a penalty.

        NOTE: verify row j sees the outputs plus drafts d_1..d_j, the tokens it would follow if they
        are accepted. drafts: [B, k] -> counts [B*(k+1), V], mask [B*(k+1), V].
        """
        if not self.has_penalty[slots].any():
            return None
        b, k = drafts.shape
        counts = np.repeat(self.counts[slots][:, None, :], k + 1, axis=1)  # [B, k+1, V]
        for j in range(1, k + 1):
            np.add.at(counts[:, j], (np.arange(b)[:, None], drafts[:, :j]), 1.0)
        mask = np.repeat(self.prompt_mask[slots], k + 1, axis=0)
        return host_tensor(counts.reshape(b * (k + 1), -1)), host_tensor(mask)
