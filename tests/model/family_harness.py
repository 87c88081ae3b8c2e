"""What the model-family equality tests share: prompts, paged prefill logits, an engine on the real model."""

from __future__ import annotations

import numpy as np
from model_fixtures import Window, pack

from mtpserve.engine.engine_core import CoreConfig, EngineCore
from mtpserve.engine.model_runner import ModelRunnerConfig, PaddleModelRunner
from mtpserve.engine.request import EngineRequest, SamplingParams
from mtpserve.engine.scheduler import SchedulerConfig
from mtpserve.model.attention_context import PagedContext
from mtpserve.model.serving_model import ServingModel

BLOCK = 8


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = np.random.default_rng(seed)
    return [gen.integers(0, vocab, int(gen.integers(4, 40))).tolist() for _ in range(n)]


def paged_logits(model: ServingModel, texts: list[list[int]]) -> list[np.ndarray]:
    """Each prompt as two chunks through the paged cache (the second reads the first's rows) -> [S, V] each."""
    kv = model.allocate_kv(model.config.num_hidden_layers, 256, BLOCK)
    blocks = [list(range(8 * i, 8 * i + 8)) for i in range(len(texts))]
    halves = [len(t) // 2 for t in texts]
    out: list[list[np.ndarray]] = [[] for _ in texts]
    for first in (True, False):
        windows = [Window(t[:h] if first else t[h:], 0 if first else h, b) for t, h, b in zip(texts, halves, blocks)]
        batch = pack(windows, BLOCK, 8)
        hidden = model.run(batch.input_ids, batch.positions, PagedContext(batch, kv)).hidden_states
        logits = model.compute_logits(hidden).numpy()
        cu = np.cumsum([0] + [len(w.ids) for w in windows])
        for i in range(len(texts)):
            out[i].append(logits[cu[i]:cu[i + 1]])
    return [np.concatenate(parts) for parts in out]


def make_core(model: ServingModel, k: int, max_num_seqs: int = 8) -> EngineCore:
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256, max_prefill_chunk=16,
                            num_speculative_tokens=k, num_blocks=512, block_size=BLOCK)
    runner = PaddleModelRunner(model, ModelRunnerConfig(max_num_seqs=max_num_seqs, num_blocks=512,
                                                        block_size=BLOCK, num_speculative_tokens=k))
    return EngineCore(CoreConfig(sched, overlap=True), runner)


def generate(core: EngineCore, texts: list[list[int]], max_tokens: int) -> dict[int | str, list[int]]:
    """Greedy continuations, every prompt admitted at once (batched steps)."""
    outs: dict[int | str, list[int]] = {}
    for i, t in enumerate(texts):
        core.add_request(EngineRequest(f"r{i}", tuple(t), SamplingParams(temperature=0.0, max_tokens=max_tokens)))
    while core.has_unfinished_requests():
        step = core.step()
        for i, rid in enumerate(step.request_ids):
            outs.setdefault(rid, []).extend(step.tokens_of(i).tolist())
    core.close()
    return outs


def hf_greedy(hf, torch, tokens: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation (an explicit mask: id 0, the pad id, would be masked out)."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(tokens):].tolist()
