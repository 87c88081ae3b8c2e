"""The Paddle model runner: one step = target forward over prefill chunks and k+1-token verify
windows, sampling/verification on the target rows, stop checks, then MTP drafts for the next step.

On a CPU host the "device" is a dedicated execution thread (Paddle releases the GIL inside its
kernels) and the slot state lives in numpy arrays that only that thread touches; the host thread only
ever waits on a step's future. A GPU port keeps the same shapes with the slot state in device tensors.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

import numpy as np
import paddle

from mtpserve.config import EngineConfig
from mtpserve.engine import rng
from mtpserve.engine.device_stream import DeviceStream
from mtpserve.engine.mtp_proposer import DraftTokens, MTPProposer, draft_tokens
from mtpserve.engine.sampler import gather_logprobs, processed_logits
from mtpserve.engine.slot_sampling import SlotSampling
from mtpserve.engine.slot_state import SlotState, Window, block_rows
from mtpserve.engine.spec_verify import (HostSampling, VerifyResult, host_sampling_available, sample_and_verify,
                                         sample_and_verify_paddle, verify_greedy_numpy)
from mtpserve.engine.step_plan import LogprobRows, StepPlan, StepResult, StepTiming
from mtpserve.host_tensor import StagedTensors, host_tensor
from mtpserve.model.attention_context import PagedContext
from mtpserve.model.forward_batch import ForwardBatch
from mtpserve.model.kv_cache import KVCache
from mtpserve.model.serving_model import ServingModel, StepForward


@dataclasses.dataclass(frozen=True)
class ModelRunnerConfig:
    max_num_seqs: int = EngineConfig.max_num_seqs  # NOTE: defaults are the configuration's (config/schema.py)
    num_blocks: int = 1024
    block_size: int = EngineConfig.block_size
    num_speculative_tokens: int = 0
    kv_dtype: str = "float32"


class Verified:
    """A step's target decisions per row: tokens [B, k+1] (-1 padded), counts [B] (numpy)."""

    def __init__(self, token_ids: np.ndarray, num_emitted: np.ndarray, num_accepted: np.ndarray):
        self.token_ids, self.num_emitted, self.num_accepted = token_ids, num_emitted, num_accepted


class PaddleModelRunner:
    def __init__(self, model: ServingModel, config: ModelRunnerConfig) -> None:
        mc = model.config
        k = config.num_speculative_tokens
        if k and model.num_mtp_layers == 0:
            raise ValueError("num_speculative_tokens > 0 needs a model with MTP layers")
        self.model, self.config = model, config
        self.vocab_size, self.num_speculative_tokens = mc.vocab_size, k
        kv_args = (config.num_blocks, config.block_size, config.kv_dtype)
        self.kv = model.allocate_kv(mc.num_hidden_layers, *kv_args)
        self.state = SlotState(config.max_num_seqs, k, config.num_blocks, config.block_size)
        self.sampling = SlotSampling(config.max_num_seqs, mc.vocab_size)
        depth_caches = [_one_layer_for_all(model.allocate_kv(1, *kv_args), model.num_mtp_layers) for _ in range(k)]
        # NOTE: a step's index tensors, reused across steps; only the device thread touches them
        self._staged = StagedTensors()
        self.proposer = MTPProposer(model, depth_caches, self._staged) if k else None
        self._stream = DeviceStream("model-device")
        # NOTE: sampled steps draw and verify in one CPU op where it is built (spec_verify.sample_and_verify)
        self._host_sampling = host_sampling_available()

    def launch(self, plan: StepPlan) -> concurrent.futures.Future[StepResult]:
        return self._stream.submit(self._execute, plan)

    def busy_seconds(self) -> float:
        return self._stream.busy_seconds()

    def close(self) -> None:
        self._stream.close()

    # ---- device side ----------------------------------------------------------------------------

    def _execute(self, plan: StepPlan) -> StepResult:
        # NOTE: the split is taken where the step already waits for the device (the verified tokens
        # and each depth's drafts come to the host), so timing it adds no sync
        begin = time.perf_counter()
        with paddle.no_grad():
            self.state.apply_writes(plan)
            self._copy_blocks(plan.block_copies)
            self.sampling.apply_inserts(plan)
            win = self.state.window(plan)
            batch = self._forward_batch(plan, win)
            ctx = PagedContext(batch, self.kv)  # built once, reused by every MTP depth
            plain = self._is_plain_greedy(plan.slots)
            index = win.verify_index(plan.is_prefill, plan.verify_width).reshape(-1)
            rows, spread = self._logit_rows(plan, index, plain)
            drafting = self.proposer is not None and plan.num_depths > 0
            kept = draft_tokens(plan, win, self.state.key_start[plan.slots]) if drafting else None
            out = self._forward(plan, win, batch, ctx, rows, kept)
            logits = out.logits  # [B*W, V], or [N, V] at the distinct rows when spread is not None
            v = self._decide(plan, logits, out.greedy, plain, spread)
            tokens, num_emitted, reason = self.state.finish_rows(plan, win, v.token_ids, v.num_emitted)
            logprobs = self._logprobs(plan, logits, tokens)
            self.sampling.count(plan.slots, tokens)
            drafts = None
            proposing = time.perf_counter()
            if self.proposer is not None and kept is not None:
                drafts = self.proposer.propose(plan, win, batch, ctx, out.mtp_hidden, v, num_emitted,
                                               reason, self.state, kept)
            timing = StepTiming(proposing - begin, time.perf_counter() - proposing)
            return StepResult(plan.step_id, tokens, num_emitted, v.num_accepted, reason, win.is_valid,
                              logprobs, drafts, timing)

    def _copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Prefix hits' private copies of cached blocks, main and MTP KV, before anything writes."""
        if not copies:
            return
        src, dst = block_rows(copies, self.config.block_size)
        src_rows, dst_rows = host_tensor(src), host_tensor(dst)
        for cache in (self.kv, *(self.proposer.kv if self.proposer else ())):
            cache.copy_blocks(src_rows, dst_rows)

    def _logprobs(self, plan: StepPlan, logits: paddle.Tensor, tokens: np.ndarray) -> LogprobRows | None:
        """Raw logprobs of the emitted tokens [B, k+1] (-1 padded) from the raw verify-row logits."""
        wanted = self.sampling.num_logprobs[plan.slots]
        if (wanted < 0).all():
            return None
        shape = tokens.shape
        ids = self._staged.stage("logprob_ids", np.maximum(tokens, 0).reshape(-1))
        chosen, rank, top_ids, top_lp = gather_logprobs(logits, ids, int(wanted.max()))
        n = top_ids.shape[-1]
        return LogprobRows(chosen.numpy().reshape(shape), rank.numpy().reshape(shape),
                           top_ids.numpy().reshape(*shape, n), top_lp.numpy().reshape(*shape, n))

    def _forward_batch(self, plan: StepPlan, win: Window) -> ForwardBatch:
        seq_lens_kv = win.start + plan.num_tokens
        max_blocks = int(-(-seq_lens_kv.max() // self.config.block_size))
        tables = self.state.block_table[plan.slots, :max_blocks]
        stage = self._staged.stage
        # NOTE: positions get a tensor of their own each step: RotaryEmbedding.cos_sin keeps its lookup
        # for the last positions tensor it saw, and a staged one would be the same object every step
        return ForwardBatch(
            input_ids=stage("input_ids", win.token_ids), positions=host_tensor(win.positions),
            slot_mapping=stage("slot_mapping", win.slot_mapping),
            cu_seqlens_q=stage("cu_seqlens_q", win.cu.astype(np.int32)),
            seq_lens_kv=stage("seq_lens_kv", seq_lens_kv.astype(np.int32)),
            block_tables=stage("block_tables", tables.astype(np.int32)),
            max_q_len=int(plan.num_tokens.max()))

    def _forward(self, plan: StepPlan, win: Window, batch: ForwardBatch, ctx: PagedContext,
                 rows: np.ndarray, kept: DraftTokens | None) -> StepForward:
        """The main model with the logits at token rows `rows` (ascending, a row's repeats adjacent), and its
        hidden at the tokens the MTP depths run over (`kept`; None: no depth runs).

        NOTE: nothing else reads the hidden states of rows without logits, so the last block attends and runs
        its MLP for the logit rows and the depths' tokens alone: a prompt chunk needs its last position and the
        positions its depths run over (mtp_window.py). A 256-320 token chunk step of the bundled model took
        ~20% less at depth 0 (one process)."""
        stage = self._staged.stage
        if kept is not None:
            if kept.tokens is None:
                return self.model.forward_step(batch.input_ids, batch.positions, ctx, stage("logit_rows", rows))
            return self.model.forward_step(batch.input_ids, batch.positions, ctx,
                                           stage("logit_rows", np.searchsorted(kept.tokens, rows)),
                                           stage("out_rows", kept.tokens))
        first = run_starts(rows)
        distinct = rows[first]
        if len(distinct) == len(win.token_ids):
            return self.model.forward_step(batch.input_ids, batch.positions, ctx, stage("logit_rows", rows))
        return self.model.forward_step(batch.input_ids, batch.positions, ctx,
                                       stage("logit_rows", np.cumsum(first) - 1), stage("out_rows", distinct))

    def _logit_rows(self, plan: StepPlan, index: np.ndarray, plain: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """The flat token rows to compute logits at, from the verify rows `index` [B*W]; and, when those
        leave a window's padding out, each verify row's place among them [B*W] (else None).

        NOTE: a window shorter than the widest repeats its last position, and a prompt chunk has one
        position in all W. Where only the argmax is read (plain greedy, no logprobs) each position's
        logits are computed once: the LM head is ~50 us a row on a 2-core host, and at 64 rows a step
        with a third of its rows drafting nothing computed ~21 padded rows, ~1 ms of a ~15 ms step, which
        the cost model (profiled at uniform depths) did not know mixing costs."""
        if not plain or (self.sampling.num_logprobs[plan.slots] >= 0).any():
            return index, None
        first = run_starts(index)
        if first.all():
            return index, None
        return index[first], np.cumsum(first) - 1

    def _decide(self, plan: StepPlan, logits: paddle.Tensor, raw_greedy: paddle.Tensor | None, plain: bool,
                spread: np.ndarray | None = None) -> Verified:
        """Penalties and filters on every verify row, then greedy/rejection verification of decode
        rows and a plain draw for prefill rows. logits: [B*(k+1), V], k = the step's widest window;
        raw_greedy: their argmax [B*(k+1)] if the forward made it; plain: `_is_plain_greedy` of its rows.
        With `spread` (_logit_rows), a plain greedy step's logits and argmax are at the distinct rows, and
        spread maps them back.

        NOTE: a row verifying fewer drafts than k has its missing drafts set to -1, which no target
        equals and the sampled verifier rejects, so its window ends with a plain draw where it ends."""
        k = plan.verify_width - 1
        slots, b = plan.slots, plan.num_rows
        has_draft = np.arange(k)[None, :] < plan.num_drafts[:, None]  # [B, k]
        drafts = np.where(has_draft, self.state.drafts[slots, :k], -1)  # [B, k]
        if plain:
            target = (paddle.argmax(logits, axis=-1) if raw_greedy is None else raw_greedy).numpy()
            return self._greedy(plan, (target if spread is None else target[spread]).reshape(b, k + 1), drafts)
        if self._host_sampling:
            return self._sample_on_host(plan, logits, drafts)
        out_index = self.state.out_len[slots][:, None] + np.arange(k + 1)[None, :]  # [B, k+1]
        params = self.sampling.row_params(slots, out_index, self.state)
        counts, mask = self.sampling.penalty_inputs(slots, np.maximum(drafts, 0)) or (None, None)
        logits = processed_logits(logits, counts, mask, params)
        greedy = paddle.argmax(logits, axis=-1).reshape([b, k + 1])
        if not (self.sampling.temperature[slots] > 0).any():
            # NOTE: an all-greedy batch needs neither probabilities nor random numbers.
            return self._greedy(plan, greedy.numpy(), drafts)
        return self._finish_verify(plan, *sample_and_verify_paddle(logits, greedy, params, drafts))

    def _sample_on_host(self, plan: StepPlan, logits: paddle.Tensor, drafts: np.ndarray) -> Verified:
        """`_decide` past plain greedy, on a CPU host: penalties and the min_tokens mask where a row has them,
        then every draw and verification in one op (spec_verify.sample_and_verify). drafts: [B, k], -1 padded."""
        slots, (b, k) = plan.slots, drafts.shape
        sp, st = self.sampling, self.state
        out_index = st.out_len[slots][:, None] + np.arange(k + 1)[None, :]  # [B, k+1]
        counts, mask = sp.penalty_inputs(slots, np.maximum(drafts, 0)) or (None, None)
        if counts is not None or (st.min_tokens[slots] > st.out_len[slots]).any():
            logits = processed_logits(logits, counts, mask, sp.row_params(slots, out_index, st))
        keys = np.broadcast_to(st.keys[slots][:, None], out_index.shape)
        params = HostSampling(sp.temperature[slots], sp.top_p[slots], sp.top_k[slots], sp.min_p[slots])
        tokens, accepted = sample_and_verify(logits, drafts, params, rng.uniforms_host(keys, out_index, rng.Purpose.SAMPLE),
                                             rng.uniforms_host(keys[:, :k], out_index[:, :k], rng.Purpose.ACCEPT),
                                             plan.is_prefill, self._staged.stage)
        return Verified(tokens, accepted + 1, accepted)

    def _is_plain_greedy(self, slots: np.ndarray) -> bool:
        """Greedy, no penalties, no stop token masked by min_tokens: the raw argmax decides."""
        sp, st = self.sampling, self.state
        return not ((sp.temperature[slots] > 0).any() or sp.has_penalty[slots].any()
                    or (st.min_tokens[slots] > st.out_len[slots]).any())

    def _greedy(self, plan: StepPlan, target: np.ndarray, drafts: np.ndarray) -> Verified:
        """target: [B, k+1] argmax per verify row."""
        if target.shape[1] == 1:
            return self._finish_verify(plan, target[:, 0], None)
        tokens, accepted = verify_greedy_numpy(target, drafts)
        pre = plan.is_prefill
        tokens[pre] = -1
        tokens[pre, 0] = target[pre, 0]
        return Verified(tokens, np.where(pre, 1, accepted + 1), np.where(pre, 0, accepted))

    def _finish_verify(self, plan: StepPlan, first: np.ndarray, res: VerifyResult | None) -> Verified:
        """Prefill rows (and every row when k = 0) emit their plain draw `first` [B]."""
        b = plan.num_rows
        if res is None:
            return Verified(first[:, None], np.ones(b, np.int64), np.zeros(b, np.int64))
        tokens, emitted, accepted = res.token_ids.numpy(), res.num_emitted.numpy(), res.num_accepted.numpy()
        pre = plan.is_prefill
        tokens[pre] = -1
        tokens[pre, 0] = first[pre]
        return Verified(tokens, np.where(pre, 1, emitted), np.where(pre, 0, accepted))


def kv_blocks_for_budget(model: ServingModel, block_size: int, num_speculative_tokens: int,
                         budget_mb: int, dtype_bytes: int = 4) -> int:
    """How many KV blocks fit in `budget_mb`: K and V of every main layer plus one layer per MTP depth."""
    mc = model.config
    layers = mc.num_hidden_layers + num_speculative_tokens
    per_block = layers * block_size * model.kv_elements_per_token_layer() * dtype_bytes
    return max(1, (budget_mb << 20) // per_block - 1)  # NOTE: -1: KVCache adds a scratch block


def _depth_cache(num_mtp_layers: int, kv_args: tuple) -> KVCache:
    """One layer of KV storage that every MTP layer index maps to: depth i runs layer i % L, and
    only that one writes this depth's cache, so the other L-1 layers need no memory of their own."""
    return _one_layer_for_all(KVCache.allocate(1, *kv_args), num_mtp_layers)


def _one_layer_for_all(one: KVCache, num_mtp_layers: int) -> KVCache:
    return dataclasses.replace(one, k=one.k * num_mtp_layers, v=one.v * num_mtp_layers)


def run_starts(rows: np.ndarray) -> np.ndarray:
    """Where each run of equal rows starts (rows ascending, a row's repeats adjacent): [len(rows)] bool."""
    first = np.ones(rows.shape, bool)
    first[1:] = rows[1:] != rows[:-1]
    return first
