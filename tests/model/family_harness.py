"""What the model-family equality tests share: prompts, paged prefill logits, an engine on the real model."""

from __future__ import annotations

import sys
from pathlib import Path

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


def make_core(model: ServingModel, k: int, max_num_seqs: int = 8, num_blocks: int = 512) -> EngineCore:
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256, max_prefill_chunk=16,
                            num_speculative_tokens=k, num_blocks=num_blocks, block_size=BLOCK)
    runner = PaddleModelRunner(model, ModelRunnerConfig(max_num_seqs=max_num_seqs, num_blocks=num_blocks,
                                                        block_size=BLOCK, num_speculative_tokens=k))
    return EngineCore(CoreConfig(sched, overlap=True, adaptive_speculation=False), runner)  # NOTE: k drafts every step


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


def drafty(tensors: dict[str, np.ndarray], *, vocab: int, hidden: int, damped_prefixes: tuple[str, ...],
           heads: tuple[str, ...], embeddings: tuple[str, ...], projections: tuple[str, ...],
           seed: int = 0, damping: float = 0.3) -> dict[str, np.ndarray]:
    """A copy whose MTP drafts are mostly accepted, so speculation's accept path runs, not only rejection:
    the decoder blocks are damped (the residual stream stays near the current token's embedding), every
    head maps token x's embedding to a fixed permutation pi(x), and the MTP input projections pass the
    next token's embedding through (the embedding half is the identity, the hidden half zero)."""
    gen = np.random.default_rng(seed)
    out = dict(tensors)
    for name in out:
        if name.startswith(damped_prefixes) and not name.endswith("norm.weight") and "_norm." not in name:
            out[name] = (out[name] * damping).astype(np.float32)
    embed = gen.standard_normal((vocab, hidden)).astype(np.float32)  # rows of norm ~sqrt(H): they dominate
    for name in embeddings:
        out[name] = embed
    # NOTE: logit of pi(x) ~2, of the others ~+-0.25: a clear favourite that sampling still leaves sometimes
    permuted = embed[np.argsort(gen.permutation(vocab))] * (2.0 / hidden)
    for name in heads:
        out[name] = permuted.astype(np.float32)
    passthrough = np.zeros((hidden, 2 * hidden), np.float32)
    passthrough[:, :hidden] = np.eye(hidden)
    for name in projections:
        out[name] = passthrough
    return out


def sampled_tokens(model: ServingModel, k: int, prompt: list[int], n: int) -> tuple[np.ndarray, list[float]]:
    """n seeded samples of 4 tokens (temperature 0.3, top-k 50), batched 64 at a time -> ([n, 4] ids,
    acceptance per draft position)."""
    core = make_core(model, k, max_num_seqs=64, num_blocks=1024)
    outs: dict[int | str, list[int]] = {}
    pending = [EngineRequest(i, tuple(prompt), SamplingParams(temperature=0.3, top_k=50, seed=i, max_tokens=4))
               for i in range(n)]
    while pending or core.has_unfinished_requests():
        while pending and core.scheduler.num_unfinished < 64:
            core.add_request(pending.pop(0))
        step = core.step()
        for i, rid in enumerate(step.request_ids):
            outs.setdefault(rid, []).extend(step.tokens_of(i).tolist())
    rates = core.acceptance.per_position_rate()
    core.close()
    return np.array([outs[i] for i in range(n)]), rates


def two_sample_chi2_pvalue(a: np.ndarray, b: np.ndarray, vocab: int) -> float:
    """Homogeneity of two samples of token ids; categories with fewer than 10 draws are pooled."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    from chi_square import chi2_sf

    ca, cb = np.bincount(a, minlength=vocab), np.bincount(b, minlength=vocab)
    keep = (ca + cb) >= 10
    ca, cb = np.append(ca[keep], ca[~keep].sum()), np.append(cb[keep], cb[~keep].sum())
    total = ca + cb
    nz = total > 0
    ca, cb, total = ca[nz], cb[nz], total[nz]
    ea, eb = total * ca.sum() / total.sum(), total * cb.sum() / total.sum()
    stat = float(((ca - ea) ** 2 / ea).sum() + ((cb - eb) ** 2 / eb).sum())
    return chi2_sf(stat, len(total) - 1)
