"""A CPU-only synthetic device: a fixed step time and a configurable draft acceptance rate, so the
scheduling and overlap machinery can be measured apart from model speed.

It is still a faithful little language model, so the engine's bookkeeping is checked for real:
  * KV: a paged "cache" of one uint32 per token slot, written through the block tables and slot
    mapping. The value at position t chains the whole context: v_t = v_{t-1} + g(token_t, t) mod 2**32.
  * Target: the greedy next token after position t is h(v_t) mod V. A wrong block table, position,
    window token or lost KV changes every later token.
  * Drafts: for each of the k draft positions the drafter follows the target's chain and is right with
    probability `acceptance_rate` (a counter-based coin), otherwise proposes a wrong token.
Only greedy decoding is modelled (sampling parameters other than the stop rules are ignored).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time

import numpy as np

from mtpserve.config import EngineConfig
from mtpserve.engine.device_stream import DeviceStream
from mtpserve.engine.slot_state import SlotState, Window, block_rows
from mtpserve.engine.step_plan import StepPlan, StepResult

_M32 = np.uint64(0xFFFFFFFF)


def _mix32(x: np.ndarray) -> np.ndarray:
    """MurmurHash3 fmix32 on uint64 arrays holding uint32 values."""
    with np.errstate(over="ignore"):
        x = x & _M32
        x ^= x >> np.uint64(16)
        x = (x * np.uint64(0x85EBCA6B)) & _M32
        x ^= x >> np.uint64(13)
        x = (x * np.uint64(0xC2B2AE35)) & _M32
        return x ^ (x >> np.uint64(16))


def _step_hash(token_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return _mix32(token_ids.astype(np.uint64) * np.uint64(0x9E3779B1) + positions.astype(np.uint64))


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
    step_time_s: float = 0.010
    acceptance_rate: float = 0.7
    vocab_size: int = 32000
    num_speculative_tokens: int = 0
    max_num_seqs: int = EngineConfig.max_num_seqs  # NOTE: defaults are the configuration's (config/schema.py)
    num_blocks: int = 1024
    block_size: int = EngineConfig.block_size


class SyntheticRunner:
    def __init__(self, config: SyntheticConfig) -> None:
        self.config = config
        self.vocab_size = config.vocab_size
        self.num_speculative_tokens = config.num_speculative_tokens
        self.state = SlotState(config.max_num_seqs, config.num_speculative_tokens, config.num_blocks,
                               config.block_size)
        self.kv = np.zeros(config.num_blocks * config.block_size, np.uint64)  # one value per slot
        self._free_at = 0.0  # device timeline: when the last step ended
        self._busy = 0.0
        self._steps: collections.deque[tuple[float, float]] = collections.deque(maxlen=1 << 16)
        self._stream = DeviceStream("synthetic-device")

    def launch(self, plan: StepPlan) -> concurrent.futures.Future[StepResult]:
        return self._stream.submit(self._execute, plan, time.perf_counter())

    def busy_seconds(self) -> float:
        """Device time spent in steps, on the device's own timeline (see `_execute`)."""
        return self._busy

    def busy_between(self, begin: float, end: float) -> float:
        """Device time inside [begin, end] (perf_counter), steps cut at the edges: a step running
        across `begin` counts only from there, so a short window is not over-counted."""
        return sum(max(0.0, min(e, end) - max(s, begin)) for s, e in list(self._steps))

    def close(self) -> None:
        self._stream.close()

    # ---- device side ----------------------------------------------------------------------------

    def _execute(self, plan: StepPlan, launched_at: float) -> StepResult:
        """Run a step on a device timeline, as a stream runs kernels back to back.

        NOTE: the step starts when it was launched or when the previous one ended, whichever is
        later, and ends `step_time` after that (or when its own bookkeeping is done, if longer).
        A late wake-up of this thread (it needs the GIL back after sleeping) delays delivering the
        result to the host, as a late event query would, but not the next queued step. Sleeping
        releases the GIL, as a real kernel would, so the host can plan meanwhile.
        """
        start = max(launched_at, self._free_at)
        result = self._step(plan)
        end = max(start + self.config.step_time_s, time.perf_counter())
        time.sleep(max(0.0, end - time.perf_counter()))
        self._busy += end - start
        self._steps.append((start, end))
        self._free_at = end
        return result

    def _step(self, plan: StepPlan) -> StepResult:
        self.state.apply_writes(plan)
        if plan.block_copies:
            src, dst = block_rows(plan.block_copies, self.config.block_size)
            self.kv[dst] = self.kv[src]
        win = self.state.window(plan)
        values = self._forward(plan.slots, win)  # [T] context values
        targets = (_mix32(values ^ np.uint64(0x5BD1E995)) % np.uint64(self.vocab_size)).astype(np.int64)
        tokens, num_emitted, num_accepted = self._verify(plan, win, targets)
        tokens, num_emitted, reason = self.state.finish_rows(plan, win, tokens, num_emitted)
        self._propose(plan, win, values, num_emitted, reason)
        return StepResult(plan.step_id, tokens, num_emitted, num_accepted, reason, win.is_valid)

    def _forward(self, slots: np.ndarray, win: Window) -> np.ndarray:
        """The attention stand-in: prefix sums of the step hashes on top of the cached context."""
        g = _step_hash(win.token_ids, win.positions)
        first = win.cu[:-1]
        prev = np.zeros(len(first), np.uint64)  # context value at each row's start - 1
        has_prev = (win.start > 0) & win.is_valid
        if has_prev.any():
            prev[has_prev] = self.kv[self.state.slot_of(slots[has_prev], win.start[has_prev] - 1)]
        with np.errstate(over="ignore"):
            running = np.cumsum(g)
            base = np.where(first > 0, running[np.maximum(first - 1, 0)], np.uint64(0))
            values = (running - base[win.row_of] + prev[win.row_of]) & _M32
        written = win.slot_mapping >= 0
        self.kv[win.slot_mapping[written]] = values[written]
        return values

    def _verify(self, plan: StepPlan, win: Window, targets: np.ndarray):
        """Greedy verification of each decode window; a prefill row emits its last target."""
        k = plan.verify_width - 1
        last = win.cu[1:] - 1
        idx = win.verify_index(plan.is_prefill, k + 1)
        window_targets = np.where(plan.is_prefill[:, None], -1, targets[idx])  # [B, k+1]
        drafts = self.state.drafts[plan.slots, :k]  # [B, k]
        match = (drafts == window_targets[:, :k]) & (np.arange(k)[None, :] < plan.num_drafts[:, None])
        num_accepted = np.where(plan.is_prefill, 0, np.cumprod(match, axis=1).sum(axis=1))
        window_targets[:, 0] = np.where(plan.is_prefill, targets[last], window_targets[:, 0])
        return window_targets, num_accepted + 1, num_accepted

    def _propose(self, plan: StepPlan, win: Window, values, num_emitted, reason) -> None:
        """Drafts for the next window, following the target chain with the configured accuracy."""
        k = plan.num_depths
        live = (num_emitted > 0) & (reason == 0)
        if k == 0 or not live.any():
            return
        slots = plan.slots[live]
        used = np.where(plan.is_prefill, plan.num_tokens, num_emitted)  # tokens now in KV per row
        v = values[win.cu[:-1][live] + used[live] - 1]
        x = self.state.last_token[slots]
        pos = self.state.seq_len[slots]
        coin_base = self.state.out_len[slots]
        for i in range(k):
            with np.errstate(over="ignore"):
                v = (v + _step_hash(x, pos + i)) & _M32
            truth = (_mix32(v ^ np.uint64(0x5BD1E995)) % np.uint64(self.vocab_size)).astype(np.int64)
            right = self._coins(slots, coin_base + i) < self.config.acceptance_rate
            x = np.where(right, truth, (truth + 1) % self.vocab_size)
            self.state.drafts[slots, i] = x

    def _coins(self, slots: np.ndarray, index: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            counter = _mix32(index.astype(np.uint64) * np.uint64(4) + np.uint64(2))
            h = _mix32(self.state.keys[slots].astype(np.uint64) ^ counter)
        return h.astype(np.float64) / 2.0**32
