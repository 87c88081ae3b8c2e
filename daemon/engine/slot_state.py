"""Device-resident per-slot state of a CPU device (numpy), owned by the execution thread.

It is what lets the host plan step N+1 before step N finished: decode windows are assembled here
from the last sampled token and the drafts of each slot, slots that stopped are skipped, and the stop
checks (EOS and stop ids after min_tokens, max_tokens) run here, not on the host.
"""

from __future__ import annotations

import numpy as np

from mtpserve.engine.request import FinishReason
from mtpserve.engine.step_plan import SlotInsert, StepPlan


class Window:
    """The flattened tokens of one step. T = total tokens, B = rows."""

    def __init__(self, token_ids, positions, slot_mapping, row_of, cu, start, is_valid):
        self.token_ids = token_ids  # [T] int64
        self.positions = positions  # [T] int64
        self.slot_mapping = slot_mapping  # [T] int64, -1 = invalid (no KV write)
        self.row_of = row_of  # [T] int64
        self.cu = cu  # [B+1] int64
        self.start = start  # [B] int64, position of each row's first token
        self.is_valid = is_valid  # [B] bool

    def verify_index(self, is_prefill: np.ndarray, width: int) -> np.ndarray:
        """Flat token index of each verify row -> [B, width]: a decode window's positions (its last
        repeated past its end, for rows drafting less than the widest); a prefill chunk's last position."""
        last = self.cu[1:, None] - 1
        decode = np.minimum(self.cu[:-1, None] + np.arange(width)[None, :], last)
        return np.where(is_prefill[:, None], last, decode)


class SlotState:
    def __init__(self, num_slots: int, num_speculative_tokens: int, max_blocks_per_seq: int,
                 block_size: int) -> None:
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.seq_len = np.zeros(num_slots, np.int64)  # tokens with KV
        self.key_start = np.zeros(num_slots, np.int64)  # the first position whose MTP KV its drafts read
        self.last_token = np.zeros(num_slots, np.int64)  # next window's first token
        self.drafts = np.zeros((num_slots, self.k), np.int64)  # [S, k]
        self.out_len = np.zeros(num_slots, np.int64)
        self.max_tokens = np.zeros(num_slots, np.int64)
        self.min_tokens = np.zeros(num_slots, np.int64)
        self.keys = np.zeros(num_slots, np.int64)
        self.stopped = np.ones(num_slots, bool)
        self.stop_ids = np.full((num_slots, 1), -1, np.int64)  # [S, max stops], -1 = padding
        self.block_table = np.full((num_slots, max_blocks_per_seq), -1, np.int64)

    # ---- staged host writes, applied in stream order -------------------------------------------

    def apply_writes(self, plan: StepPlan) -> None:
        for ins in plan.inserts:
            self._insert(ins)
        for w in plan.block_writes:
            self.block_table[w.slot, w.first_col:w.first_col + len(w.block_ids)] = w.block_ids

    def _insert(self, ins: SlotInsert) -> None:
        s = ins.slot
        self.seq_len[s] = ins.seq_len
        self.key_start[s] = ins.key_start
        if ins.drafts is not None:
            self.last_token[s] = ins.last_token
            self.drafts[s] = _fit(ins.drafts, self.k)
        self.out_len[s] = ins.output_ids.shape[0]
        self.max_tokens[s], self.min_tokens[s], self.keys[s] = ins.max_tokens, ins.min_tokens, ins.key
        self.stopped[s] = False
        self.block_table[s] = -1
        if len(ins.stop_ids) > self.stop_ids.shape[1]:
            pad = np.full((self.stop_ids.shape[0], len(ins.stop_ids) - self.stop_ids.shape[1]), -1)
            self.stop_ids = np.concatenate([self.stop_ids, pad], axis=1)
        self.stop_ids[s] = -1
        self.stop_ids[s, :len(ins.stop_ids)] = ins.stop_ids

    # ---- step inputs ----------------------------------------------------------------------------

    def window(self, plan: StepPlan) -> Window:
        slots, is_prefill, counts = plan.slots, plan.is_prefill, plan.num_tokens
        is_valid = is_prefill | ~self.stopped[slots]
        cu = np.concatenate([[0], np.cumsum(counts)])
        row_of = np.repeat(np.arange(plan.num_rows), counts)
        offset = np.arange(cu[-1]) - cu[row_of]
        start = np.where(is_prefill, plan.start_pos, self.seq_len[slots])
        positions = start[row_of] + offset
        decode = np.concatenate([self.last_token[slots, None], self.drafts[slots]], axis=1)
        from_prefill = is_prefill[row_of]
        token_ids = np.empty(cu[-1], np.int64)
        token_ids[from_prefill] = plan.prefill_ids
        token_ids[~from_prefill] = decode[row_of[~from_prefill], offset[~from_prefill]]
        slot_mapping = np.where(is_valid[row_of], self.slot_of(slots[row_of], positions), -1)
        return Window(token_ids, positions, slot_mapping, row_of, cu, start, is_valid)

    def slot_of(self, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Flat KV slot of (device slot, position); raises if the host did not reserve the block."""
        blocks = self.block_table[slots, positions // self.block_size]
        if (blocks < 0).any():
            raise RuntimeError("KV position outside the reserved blocks")
        return blocks * self.block_size + positions % self.block_size

    # ---- step outputs ---------------------------------------------------------------------------

    def finish_rows(self, plan: StepPlan, win: Window, token_ids: np.ndarray,
                    num_emitted: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Apply stop rules to the verified tokens, then advance each slot.

        token_ids: [B, k+1]; num_emitted: [B] -> (token_ids, num_emitted, finish_reason), truncated
        at the first stop.
        """
        slots = plan.slots
        num_emitted = np.where(plan.emits & win.is_valid, num_emitted, 0)
        col = np.arange(token_ids.shape[1])[None, :]
        pos = self.out_len[slots][:, None] + col  # output index of each column
        live = col < num_emitted[:, None]
        hit = (token_ids[:, :, None] == self.stop_ids[slots][:, None, :]).any(-1)
        is_stop = hit & live & (pos >= self.min_tokens[slots][:, None])
        ends = is_stop | (live & (pos + 1 >= self.max_tokens[slots][:, None]))
        has_end = ends.any(axis=1)
        first = ends.argmax(axis=1)
        num_emitted = np.where(has_end, first + 1, num_emitted)
        stop_first = is_stop[np.arange(len(slots)), first]
        reason = np.where(has_end, np.where(stop_first, FinishReason.STOP, FinishReason.LENGTH),
                          FinishReason.NONE).astype(np.uint8)
        token_ids = np.where(col < num_emitted[:, None], token_ids, -1)
        self._advance(plan, win, token_ids, num_emitted, has_end)
        return token_ids, num_emitted, reason

    def _advance(self, plan, win, token_ids, num_emitted, has_end) -> None:
        slots, valid = plan.slots, win.is_valid
        self.seq_len[slots] = np.where(plan.is_prefill, plan.start_pos + plan.num_tokens,
                                       np.where(valid, self.seq_len[slots] + num_emitted,
                                                self.seq_len[slots]))
        emitted = num_emitted > 0
        last = token_ids[np.arange(len(slots)), np.maximum(num_emitted - 1, 0)]
        self.last_token[slots] = np.where(emitted, last, self.last_token[slots])
        self.out_len[slots] += num_emitted
        self.stopped[slots] |= has_end


def block_rows(copies: tuple[tuple[int, int], ...], block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(source, destination) blocks -> their token rows in a flat KV tensor, [N * block_size] each."""
    pairs = np.asarray(copies, np.int64).reshape(-1, 2)
    offsets = np.arange(block_size, dtype=np.int64)
    return ((pairs[:, :1] * block_size + offsets).reshape(-1), (pairs[:, 1:] * block_size + offsets).reshape(-1))


def _fit(drafts: np.ndarray, k: int) -> np.ndarray:
    """Another instance's drafts cut or padded (with a valid id) to this engine's k: drafts are
    only guesses, so this can lower acceptance but never change the output."""
    out = np.zeros(k, np.int64)
    n = min(k, drafts.shape[0])
    out[:n] = drafts[:n]
    return out
