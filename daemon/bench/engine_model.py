"""`mtpserve bench engine --model DIR`: decode tokens/s of a real model through the engine core, for
several k (MTP drafts per step) and batch sizes, with the mean acceptance length.

Prompts are windows of held-out Python standard-library files (the split of
scripts/stdlib_corpus.py: sha1(relative path)[0] % 20 == 0), tokenized with the model's tokenizer.
Each run admits `batch` requests at once; decode throughput is counted from the step where every
request has its first token until the last one finishes (greedy, ignore_eos, fixed max_tokens).
"""

from __future__ import annotations

import hashlib
import sysconfig
import time
from pathlib import Path

import numpy as np

from mtpserve.config import SpeculativeConfig
from mtpserve.engine.engine_core import CoreConfig, EngineCore
from mtpserve.engine.model_runner import ModelRunnerConfig, PaddleModelRunner
from mtpserve.engine.request import EngineRequest, SamplingParams
from mtpserve.engine.scheduler import SchedulerConfig
from mtpserve.engine.spec_stats import AcceptanceStats


def heldout_prompts(model_dir: Path, count: int, prompt_len: int, vocab_size: int) -> list[tuple[int, ...]]:
    if not (model_dir / "tokenizer.json").exists():
        gen = np.random.default_rng(0)
        return [tuple(int(t) for t in gen.integers(1, vocab_size, prompt_len)) for _ in range(count)]
    from mtpserve.tokenizer import Tokenizer

    tok = Tokenizer.from_model_dir(model_dir)
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py")
                   if hashlib.sha1(p.relative_to(root).as_posix().encode()).digest()[0] % 20 == 0)
    prompts = []
    for path in files:
        ids = tok.encode(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
        prompts += [tuple(ids[i:i + prompt_len]) for i in range(0, len(ids) - prompt_len, 4 * prompt_len)]
        if len(prompts) >= count:
            break
    return prompts[:count]


def measure_model(model, model_dir: Path, batch: int, k: int, prompt_len: int, max_tokens: int,
                  rounds: int) -> dict:
    blocks = batch * ((prompt_len + max_tokens) // 16 + 4) + 16
    # NOTE: the draft depths over a prompt's last positions, as `mtpserve serve` runs them (config/schema.py)
    sched = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(1024, batch * prompt_len),
                            max_prefill_chunk=512, num_speculative_tokens=k, num_blocks=blocks, block_size=16,
                            prompt_window=SpeculativeConfig().prompt_window if k else 0)
    runner = PaddleModelRunner(model, ModelRunnerConfig(max_num_seqs=batch, num_blocks=blocks, block_size=16,
                                                        num_speculative_tokens=k))
    # NOTE: k is the k measured: every window drafts it (the policy is measured by bench serve --launch)
    core = EngineCore(CoreConfig(sched, overlap=True, adaptive_speculation=False), runner)
    prompts = heldout_prompts(model_dir, batch * rounds, prompt_len, runner.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # NOTE: one untimed round first: a fresh runner's first steps pay for new shapes and allocations,
    # which at batch 1 (a round is well under a second) would otherwise swing the figure by +-20%.
    _run_round(core, prompts[:batch], params, "warmup")
    core.acceptance = AcceptanceStats(k)
    decode_s = decode_tokens = 0.0
    for r in range(rounds):
        seconds, tokens = _run_round(core, prompts[r * batch:(r + 1) * batch], params, str(r))
        decode_s += seconds
        decode_tokens += tokens
    core.close()
    acc = core.acceptance
    return {"batch": batch, "k": k, "prompt_len": prompt_len, "max_tokens": max_tokens, "rounds": rounds,
            "decode_tokens_per_s": decode_tokens / decode_s, "decode_tokens": decode_tokens,
            "mean_acceptance_length": acc.mean_acceptance_length if k else 1.0,
            "per_position_acceptance": acc.per_position_rate()}


def _run_round(core: EngineCore, prompts: list, params: SamplingParams, tag: str) -> tuple[float, int]:
    for i, prompt in enumerate(prompts):
        core.add_request(EngineRequest(f"{tag}-{i}", prompt, params))
    return decode_window(core, len(prompts))


def decode_window(core: EngineCore, batch: int) -> tuple[float, int]:
    """Step until all finish; time and count tokens from when every request has its first token."""
    started: set[int | str] = set()
    begin: float | None = None
    tokens = 0
    while core.has_unfinished_requests():
        out = core.step()
        if begin is not None:
            tokens += int(out.num_tokens.sum())
        started.update(rid for rid, n in zip(out.request_ids, out.num_tokens) if n)
        if begin is None and len(started) == batch:
            begin = time.perf_counter()
    assert begin is not None, "some request never produced its first token"
    return time.perf_counter() - begin, tokens


def run_model_bench(model_dir: Path, batches: list[int], ks: list[int], prompt_len: int,
                    max_tokens: int, rounds: int) -> list[dict]:
    from mtpserve.model.loader import load_serving_model

    # NOTE: the draft weights' dtype a served instance would use (config/schema.py)
    model = load_serving_model(model_dir, draft_weight_dtype=SpeculativeConfig().draft_weight_dtype)
    results = []
    for batch in batches:
        for k in ks:
            r = measure_model(model, model_dir, batch, k, prompt_len, max_tokens, rounds)
            base = next((x for x in results if x["batch"] == batch and x["k"] == 0), None)
            r["speedup_vs_k0"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"] if base else None
            results.append(r)
            print(f"model  batch {batch:3d}  k={k}  {r['decode_tokens_per_s']:8.1f} decode tok/s  "
                  f"accept len {r['mean_acceptance_length']:.2f}"
                  + (f"  x{r['speedup_vs_k0']:.2f} vs k=0" if r["speedup_vs_k0"] else ""), flush=True)
    return results
