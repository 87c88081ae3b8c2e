"""`mtpserve bench engine --model DIR --model-adaptive`: the speculation policy against fixed k, in one
process, round by round.

One engine core per fixed k in `--model-k`, and one adaptive core (K = the largest k, the start-up
profile run as a served rank runs it), all on one loaded model. Each round gives every core the same
`batch` prompts in turn, in an order that reverses every round, and times its decode; the report is
each core's median over rounds and the adaptive core's ratio to the best fixed k, by medians and as
the median of per-round ratios.

NOTE: why in one process. Served instances on this 2-core host drift by ±15% within minutes, and
where a process's memory lands moves a whole instance by a few %; `bench serve --launch` needs many
relaunched rounds to see a 5% gap through that. Here every core shares the process, the model and the
moment, so what differs between them is the policy and what its choices cost: rounds of ~0.1-1 s
interleaved put the same host under each.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

from mtpserve.bench.engine_model import decode_window, heldout_prompts
from mtpserve.config import SpeculativeConfig
from mtpserve.engine.engine_core import CoreConfig, EngineCore
from mtpserve.engine.model_runner import ModelRunnerConfig, PaddleModelRunner
from mtpserve.engine.rank_setup import profile_steps
from mtpserve.engine.request import EngineRequest, SamplingParams
from mtpserve.engine.scheduler import SchedulerConfig
from mtpserve.model.serving_model import ServingModel

ADAPTIVE = "adaptive"
NUM_BLOCKS = 4096
MAX_NUM_SEQS = 64


def run_adaptive_bench(model_dir: Path, batches: list[int], ks: list[int], prompt_len: int, max_tokens: int,
                       rounds: int, temperature: float) -> list[dict]:
    from mtpserve.model.loader import load_serving_model

    model = load_serving_model(model_dir, draft_weight_dtype=SpeculativeConfig().draft_weight_dtype)
    cores = {f"k{k}": _core(model, k, adaptive=False) for k in ks}
    cores[ADAPTIVE] = _core(model, max(ks), adaptive=True)
    results = []
    for batch in batches:
        result = _compare(cores, _prompts(model_dir, batch * rounds, prompt_len, model.config.vocab_size),
                          batch, max_tokens, rounds, temperature)
        results.append(result)
        print(format_result(result), flush=True)
    for core in cores.values():
        core.close()
    return results


def _core(model: ServingModel, k: int, adaptive: bool) -> EngineCore:
    sched = SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=2048, max_prefill_chunk=512,
                            num_speculative_tokens=k, num_blocks=NUM_BLOCKS, block_size=16)
    runner = PaddleModelRunner(model, ModelRunnerConfig(max_num_seqs=MAX_NUM_SEQS, num_blocks=NUM_BLOCKS,
                                                        block_size=16, num_speculative_tokens=k))
    core = EngineCore(CoreConfig(sched, overlap=True, adaptive_speculation=adaptive), runner)
    if adaptive:
        profile_steps(core)
    return core


def _prompts(model_dir: Path, count: int, prompt_len: int, vocab_size: int) -> list[tuple[int, ...]]:
    """`count` prompts from the held-out windows, reused rotated when there are fewer (the prefix cache
    is off in these cores, so a reused window costs its whole prefill again)."""
    pool = heldout_prompts(model_dir, count, prompt_len, vocab_size)
    return [pool[i % len(pool)][i // len(pool):] + pool[(i + 1) % len(pool)][:i // len(pool)]
            for i in range(count)]


def _compare(cores: dict[str, EngineCore], prompts: list[tuple[int, ...]], batch: int, max_tokens: int,
             rounds: int, temperature: float) -> dict:
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    adaptive = cores[ADAPTIVE].speculation
    before = adaptive.rows_by_drafts.copy()
    rates: dict[str, list[float]] = {name: [] for name in cores}
    for r in range(rounds):
        order = list(cores) if r % 2 == 0 else list(reversed(cores))
        for name in order:
            for i, prompt in enumerate(prompts[r * batch:(r + 1) * batch]):
                cores[name].add_request(EngineRequest(f"{r}-{i}", prompt, params))
            seconds, tokens = decode_window(cores[name], batch)
            rates[name].append(tokens / seconds)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    fixed = [name for name in cores if name != ADAPTIVE]
    best = max(fixed, key=medians.__getitem__)
    per_round = [a / max(rates[name][r] for name in fixed) for r, a in enumerate(rates[ADAPTIVE])]
    rows = adaptive.rows_by_drafts - before
    return {"batch": batch, "temperature": temperature, "rounds": rounds, "decode_tokens_per_s": medians,
            "best_fixed": best, "adaptive_over_best": medians[ADAPTIVE] / medians[best],
            "adaptive_over_best_per_round": statistics.median(per_round),
            "adaptive_over_k0": medians[ADAPTIVE] / medians["k0"] if "k0" in medians else None,
            "adaptive_rows_by_drafts": (rows / max(int(rows.sum()), 1)).round(3).tolist(),
            "per_round": rates}


def format_result(r: dict) -> str:
    figures = "  ".join(f"{name} {value:7.1f}" for name, value in r["decode_tokens_per_s"].items())
    shares = " ".join(f"{share:.0%}" for share in np.asarray(r["adaptive_rows_by_drafts"]))
    return (f"adaptive batch {r['batch']:3d}  {figures} decode tok/s  adaptive / {r['best_fixed']} "
            f"{r['adaptive_over_best']:.3f} (per round {r['adaptive_over_best_per_round']:.3f})  "
            f"rows by drafts {shares}")
