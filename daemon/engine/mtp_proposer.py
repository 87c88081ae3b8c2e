"""MTP drafting: k draft tokens per running request from the model's MTP layers, chained by depth.

Layout (MiMo/DeepSeek): MTP depth i at position t reads the previous depth's hidden state at t (the
main model's pre-norm hidden for i = 0) and the token at t+i+1, and predicts the token at t+i+2. Depth
i runs layer i % num_mtp_layers, so k larger than the number of layers reuses them cyclically.

Per step, every depth runs over the same packed positions as the target pass (fixed shapes, no host
sync to learn how many drafts were accepted). For a row whose first token is at position s, `ahead[b, j]`
holds the token at s+j+1: the emitted tokens of a decode window (then its new drafts), or the rest of
a prefill chunk, the next chunk's first tokens, and the sampled token. The row's frontier offset o is
its last accepted position; depth i's output there is draft i+1, written to ahead[b, o+i+1]. Offsets
past the frontier are filled with a placeholder; their MTP KV is rewritten before anything reads it.

A prompt chunk's depths run over its positions from the request's key start on (mtp_window.py), its last
position at least (`draft_tokens`), and every draft of the request attends to keys from there on only.

NOTE: each depth has its own KV cache even when layers are reused, so depth i never overwrites the
context keys of depth i-L. In a decode window, depth i >= 1 keys at the few positions before the
frontier were computed from draft tokens and are not recomputed; that can only lower acceptance, never
change output. A prefill chunk's are exact: the next chunk's first tokens are known (unless the prompt
ends within k-1 tokens of the chunk, where they read placeholders for the tokens still to be sampled).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import NamedTuple

import numpy as np
import paddle

from mtpserve.engine.slot_state import SlotState, Window
from mtpserve.engine.step_plan import StepPlan
from mtpserve.host_tensor import StagedTensors, host_tensor
from mtpserve.model.attention_context import PagedContext
from mtpserve.model.forward_batch import ForwardBatch
from mtpserve.model.kv_cache import KVCache
from mtpserve.model.serving_model import ServingModel


class DraftTokens(NamedTuple):
    """The tokens of a step the MTP depths run over: every decode window's, and each prompt chunk's from its
    request's key start on (its last position at least, where the draft after a last chunk is made)."""

    tokens: np.ndarray | None  # [T'] the kept tokens' flat indices, ascending; None: every token
    first: np.ndarray  # [B] each row's first kept offset
    cu: np.ndarray  # [B+1] each row's kept tokens in `tokens`
    row_of: np.ndarray  # [T']
    key_starts: np.ndarray | None  # [B] int32, None where every row's is 0


def draft_tokens(plan: StepPlan, win: Window, key_start: np.ndarray) -> DraftTokens:
    """`DraftTokens` of a step whose rows' key starts are `key_start` [B]."""
    first = np.where(plan.is_prefill, np.clip(key_start - win.start, 0, plan.num_tokens - 1), 0)
    starts = key_start.astype(np.int32) if key_start.any() else None
    if not first.any():
        return DraftTokens(None, first, win.cu, win.row_of, starts)
    counts = plan.num_tokens - first
    cu = np.concatenate([[0], np.cumsum(counts)])
    row_of = np.repeat(np.arange(plan.num_rows), counts)
    index = win.cu[row_of] + first[row_of] + np.arange(cu[-1]) - cu[row_of]
    return DraftTokens(index, first, cu, row_of, starts)


class MTPProposer:
    def __init__(self, model: ServingModel, kv_per_depth: list[KVCache], staged: StagedTensors | None = None) -> None:
        self.model, self.kv, self.k = model, kv_per_depth, len(kv_per_depth)
        self._staged = staged or StagedTensors()  # NOTE: the runner's: one step's index tensors

    def propose(self, plan: StepPlan, win: Window, batch: ForwardBatch, ctx: PagedContext,
                main_hidden: paddle.Tensor, verified, num_emitted: np.ndarray, reason: np.ndarray,
                state: SlotState, kept: DraftTokens) -> np.ndarray:
        """Run the depths the plan asks for (`plan.num_depths` <= k) over the `kept` tokens (`main_hidden`: the
        target's hidden at them), store the drafts of rows that keep generating into `state.drafts`, and return
        every row's drafts [B, k] (a PD prefill hands those of its finished rows on; past the depths run they
        are placeholders, which only lower acceptance)."""
        frontier = np.where(plan.is_prefill, plan.num_tokens - 1, verified.num_accepted)  # [B]
        ahead, known = self._ahead(plan, win, verified.token_ids)  # [B, W] each
        offset = np.arange(kept.cu[-1]) - kept.cu[kept.row_of] + kept.first[kept.row_of]  # [T'] within the row
        at_frontier = self._staged.stage("frontier", kept.cu[:-1] + frontier - kept.first)  # [B]
        rows = np.arange(plan.num_rows)
        hidden = main_hidden
        depths = plan.num_depths
        kept_batch = self._kept_batch(batch, win, kept)
        kept_ctx = PagedContext(kept_batch, ctx.kv) if kept_batch is not batch else ctx
        for depth in range(depths):
            shifted = self._staged.stage("shifted", ahead[kept.row_of, offset + depth])  # [T']
            last = depth == depths - 1
            # NOTE: the last depth's hidden feeds no further depth: only its frontier rows are needed.
            out = self.model.draft_depth(depth, shifted, hidden, kept_batch.positions, self._context(kept_ctx, depth),
                                         out_rows=at_frontier if last else None,
                                         draft_rows=None if last else at_frontier)
            col = frontier + depth + 1
            draft = out.draft_ids.numpy()  # [B]
            ahead[rows, col] = np.where(known[rows, col], ahead[rows, col], draft)
            hidden = out.mtp_hidden
        live = (num_emitted > 0) & (reason == 0)
        drafts = ahead[rows[:, None], frontier[:, None] + 1 + np.arange(self.k)[None, :]]  # [B, k]
        state.drafts[plan.slots[live], :depths] = drafts[live, :depths]
        return drafts

    def _kept_batch(self, batch: ForwardBatch, win: Window, kept: DraftTokens) -> ForwardBatch:
        """The target's batch as the depths run it: the kept tokens alone, and the rows' key starts."""
        if kept.key_starts is None and kept.tokens is None:
            return batch
        stage = self._staged.stage
        starts = None if kept.key_starts is None else stage("key_starts", kept.key_starts)
        if kept.tokens is None:
            return dataclasses.replace(batch, key_starts=starts)
        index = kept.tokens
        # NOTE: positions a tensor of their own, as the runner's (RotaryEmbedding.cos_sin keeps its last lookup)
        return dataclasses.replace(
            batch, input_ids=stage("kept_input_ids", win.token_ids[index]), positions=host_tensor(win.positions[index]),
            slot_mapping=stage("kept_slot_mapping", win.slot_mapping[index]),
            cu_seqlens_q=stage("kept_cu_seqlens_q", kept.cu.astype(np.int32)),
            max_q_len=int(np.diff(kept.cu).max()), key_starts=starts)

    def _context(self, ctx: PagedContext, depth: int) -> PagedContext:
        """The target pass's attention indices (same positions, slots, masks) over this depth's KV."""
        depth_ctx = copy.copy(ctx)
        depth_ctx.kv = self.kv[depth]
        return depth_ctx

    def _ahead(self, plan: StepPlan, win: Window, token_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[B, W] with W = longest row + k + 1: the token after each position, as far as known; and
        [B, W] True past a non-emitting chunk's frontier where that token is a prompt token.

        NOTE: a draft must not overwrite those: deeper depths at the chunk's last positions read them,
        and their MTP KV is never computed again (a prefix-cache hit must find what a miss computes)."""
        width = int(plan.num_tokens.max()) + self.k + 1
        ahead = np.zeros((plan.num_rows, width), np.int64)  # 0 = placeholder, a valid id
        known = np.zeros((plan.num_rows, width), bool)
        decode = ~plan.is_prefill
        emitted = np.where(token_ids >= 0, token_ids, 0)
        ahead[decode, :emitted.shape[1]] = emitted[decode]
        for b in np.nonzero(plan.is_prefill)[0]:
            n = int(plan.num_tokens[b])
            chunk = win.token_ids[win.cu[b]:win.cu[b + 1]]
            tail = np.where(plan.emits[b], token_ids[b, :1], plan.prefill_next_ids[b, :1])
            ahead[b, :n - 1] = chunk[1:]
            ahead[b, n - 1] = max(int(tail[0]), 0) if tail.size else 0
            if not plan.emits[b] and self.k > 1:
                nxt = plan.prefill_next_ids[b, 1:]
                ahead[b, n:n + nxt.shape[0]] = np.maximum(nxt, 0)
                known[b, n:n + nxt.shape[0]] = nxt >= 0
        return ahead, known
