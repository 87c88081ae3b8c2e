"""Greedy equality of MTP decoding, measured on a real model (part of `mtpserve bench engine --model`).

For each k: outputs at batch 1 must equal plain greedy decoding (k = 0, batch 1) token for token; at
batch 16 the match rate is reported, and every divergence is checked to start where the target's top-2
logprobs are within 1e-3 (a dense recompute of the sequence decides), since batched kernels may round
differently.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import paddle

from mtpserve.bench.engine_model import heldout_prompts
from mtpserve.engine.engine_core import CoreConfig, EngineCore
from mtpserve.engine.model_runner import ModelRunnerConfig, PaddleModelRunner
from mtpserve.engine.request import EngineRequest, SamplingParams
from mtpserve.engine.scheduler import SchedulerConfig
from mtpserve.model.attention_context import DenseCausalContext

NEAR_TIE = 1e-3


def decode_all(model, prompts: list[tuple[int, ...]], k: int, batch: int, max_tokens: int) -> dict:
    blocks = batch * ((max(map(len, prompts)) + max_tokens) // 16 + 4) + 16
    sched = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=2048, max_prefill_chunk=512,
                            num_speculative_tokens=k, num_blocks=blocks, block_size=16)
    runner = PaddleModelRunner(model, ModelRunnerConfig(max_num_seqs=batch, num_blocks=blocks, block_size=16,
                                                        num_speculative_tokens=k))
    core = EngineCore(CoreConfig(sched, overlap=True), runner)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    pending = [EngineRequest(i, p, params) for i, p in enumerate(prompts)]
    outs: dict[int | str, list[int]] = {}
    while pending or core.has_unfinished_requests():
        while pending and core.scheduler.num_unfinished < batch:
            core.add_request(pending.pop(0))
        out = core.step()
        for i, rid in enumerate(out.request_ids):
            outs.setdefault(rid, []).extend(out.tokens_of(i).tolist())
    core.close()
    return outs


def top2_gap(model, tokens: list[int]) -> float:
    with paddle.no_grad():
        ids = paddle.to_tensor(np.asarray(tokens, np.int64))
        out = model.run(ids, paddle.arange(len(tokens), dtype="int64"), DenseCausalContext(1, len(tokens)))
        logits = model.compute_logits(out.hidden_states[-1:]).numpy()[0].astype(np.float64)
    logprobs = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    top = np.sort(logprobs)[-2:]
    return float(top[1] - top[0])


def equality_report(model, model_dir: Path, ks: list[int], num_prompts: int, max_tokens: int) -> list[dict]:
    prompts = heldout_prompts(model_dir, num_prompts, 32, model.config.vocab_size)
    ref = decode_all(model, prompts, 0, 1, max_tokens)
    rows = []
    for k in ks:
        single = decode_all(model, prompts, k, 1, max_tokens) if k else ref
        batched = decode_all(model, prompts, k, 16, max_tokens)
        diverged = [rid for rid in ref if batched[rid] != ref[rid]]
        unexplained = [rid for rid in diverged
                       if top2_gap(model, _prefix(prompts, ref, batched, rid)) >= NEAR_TIE]
        rows.append({"k": k, "prompts": len(prompts), "max_tokens": max_tokens,
                     "batch1_identical": sum(single[r] == ref[r] for r in ref),
                     "batch16_match_rate": 1 - len(diverged) / len(ref),
                     "batch16_divergences_not_near_tie": len(unexplained)})
        r = rows[-1]
        print(f"greedy k={k}: batch 1 identical {r['batch1_identical']}/{len(ref)}, batch 16 match "
              f"{100 * r['batch16_match_rate']:.1f}%, divergences without a near-tie: {len(unexplained)}",
              flush=True)
    return rows


def _prefix(prompts, ref, got, rid) -> list[int]:
    first = next(i for i, (a, b) in enumerate(zip(got[rid], ref[rid])) if a != b)
    return list(prompts[rid]) + ref[rid][:first]
