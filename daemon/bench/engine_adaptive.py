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

Every core is built as `mtpserve serve` builds its engine (engine_factory.py, the default `[engine]`
section): its KV pool sized from `kv_cache_mb` for its k, 64-token blocks, the prefix cache on. Two
options bring a round closer to serving:
- `closed_loop`: `batch` streams kept busy, a new prompt as each request finishes (3 x batch requests
  a round, outputs of 0.75-1.25 x max_tokens), timed from the first submission to the last token, so
  steps mix prompt chunks with decode windows and the rows that emit change as they do when served;
- `pinned`: one more core per depth d, the adaptive core's runner (K) with every row's drafts pinned to d
  (`k<K>@<d>`): what k3@0 loses to k0 is the K runner's (its smaller pool, its wider arrays), what adaptive
  loses to the pinned depths it mixes is the policy's (its host work, its switches).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from mtpserve.bench.engine_model import decode_window, heldout_prompts
from mtpserve.config import EngineConfig, SpeculativeConfig
from mtpserve.engine.engine_core import EngineCore
from mtpserve.engine.engine_factory import build_model_engine
from mtpserve.engine.rank_setup import profile_steps
from mtpserve.engine.request import EngineRequest, SamplingParams
from mtpserve.model.serving_model import ServingModel

ADAPTIVE = "adaptive"
REQUESTS_PER_STREAM = 3  # a closed-loop round's requests per stream


def run_adaptive_bench(model_dir: Path, batches: list[int], ks: list[int], prompt_len: int, max_tokens: int,
                       rounds: int, temperature: float, closed_loop: bool = False,
                       pinned: list[int] | None = None, trace: Path | None = None) -> list[dict]:
    from mtpserve.model.loader import load_serving_model

    model = load_serving_model(model_dir, draft_weight_dtype=SpeculativeConfig().draft_weight_dtype)
    cores = {f"k{k}": _core(model, k, adaptive=False) for k in ks}
    cores[ADAPTIVE] = _core(model, max(ks), adaptive=True)
    if trace is not None:  # NOTE: after the start-up profile, as a served rank's trace reads after its profile
        cores[ADAPTIVE].trace_to(str(trace))
    for depth in pinned or []:
        cores[pinned_name(max(ks), depth)] = core = _core(model, max(ks), adaptive=False)
        core.speculation.forced = depth
    results = []
    for batch in batches:
        per_round = batch * (REQUESTS_PER_STREAM if closed_loop else 1)
        result = _compare(cores, _prompts(model_dir, per_round * rounds, prompt_len, model.config.vocab_size),
                          batch, max_tokens, rounds, temperature, closed_loop)
        results.append(result)
        print(format_result(result), flush=True)
    for core in cores.values():
        core.close()
    return results


def pinned_name(k: int, depth: int) -> str:
    return f"k{k}@{depth}"


def _core(model: ServingModel, k: int, adaptive: bool) -> EngineCore:
    """An engine core as `mtpserve serve` builds it for this k (its pool from the default budget)."""
    core = build_model_engine(model, EngineConfig(), SpeculativeConfig(num_speculative_tokens=k, adaptive=adaptive))
    if adaptive:
        profile_steps(core)
    return core


def _prompts(model_dir: Path, count: int, prompt_len: int, vocab_size: int) -> list[tuple[int, ...]]:
    """`count` prompts from the held-out windows, reused rotated when there are fewer (a rotation by one
    token or more shares no block with the window it came from, so the prefix cache finds nothing)."""
    pool = heldout_prompts(model_dir, count, prompt_len, vocab_size)
    return [pool[i % len(pool)][i // len(pool):] + pool[(i + 1) % len(pool)][:i // len(pool)]
            for i in range(count)]


def _compare(cores: dict[str, EngineCore], prompts: list[tuple[int, ...]], batch: int, max_tokens: int,
             rounds: int, temperature: float, closed_loop: bool) -> dict:
    adaptive = cores[ADAPTIVE].speculation
    before = adaptive.rows_by_drafts.copy()
    rates: dict[str, list[float]] = {name: [] for name in cores}
    emitted: dict[str, list[int]] = {name: [] for name in cores}
    round_size = len(prompts) // rounds
    for r in range(rounds):
        order = list(cores) if r % 2 == 0 else list(reversed(cores))
        round_prompts = prompts[r * round_size:(r + 1) * round_size]
        for name in order:
            if closed_loop:
                seconds, tokens = _closed_loop(cores[name], f"{r}", round_prompts, batch, max_tokens, temperature)
            else:
                params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
                for i, prompt in enumerate(round_prompts):
                    cores[name].add_request(EngineRequest(f"{r}-{i}", prompt, params))
                seconds, tokens = decode_window(cores[name], batch)
            rates[name].append(tokens / seconds)
            emitted[name].append(tokens)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    fixed = [name for name in cores if name.startswith("k") and "@" not in name]
    best = max(fixed, key=medians.__getitem__)
    per_round = [a / max(rates[name][r] for name in fixed) for r, a in enumerate(rates[ADAPTIVE])]
    rows = adaptive.rows_by_drafts - before
    return {"batch": batch, "temperature": temperature, "rounds": rounds, "decode_tokens_per_s": medians,
            "best_fixed": best, "adaptive_over_best": medians[ADAPTIVE] / medians[best],
            "adaptive_over_best_per_round": statistics.median(per_round),
            "adaptive_over_k0": medians[ADAPTIVE] / medians["k0"] if "k0" in medians else None,
            "over_k0_per_round": ({name: statistics.median(a / b for a, b in zip(values, rates["k0"]))
                                   for name, values in rates.items()} if "k0" in rates else None),
            "closed_loop": closed_loop,
            "adaptive_rows_by_drafts": (rows / max(int(rows.sum()), 1)).round(3).tolist(),
            "per_round": rates, "tokens_per_round": emitted}


def _closed_loop(core: EngineCore, tag: str, prompts: list[tuple[int, ...]], streams: int, max_tokens: int,
                 temperature: float) -> tuple[float, int]:
    """Every prompt through `core` with at most `streams` in flight, a new one as each finishes; outputs of
    0.75-1.25 x max_tokens (a spread, so requests finish on different steps). Seconds from the first
    submission to the last token, and the tokens emitted."""
    sent = done = tokens = 0
    begin = time.perf_counter()
    while done < len(prompts):
        while sent < len(prompts) and sent - done < streams:
            length = max(1, round(max_tokens * (0.75 + 0.5 * ((sent * 37) % 64) / 64)))
            params = SamplingParams(temperature=temperature, max_tokens=length, ignore_eos=True)
            core.add_request(EngineRequest(f"{tag}-{sent}", prompts[sent], params))
            sent += 1
        out = core.step()
        tokens += int(out.num_tokens.sum())
        done += int((out.finish_reasons != 0).sum())
    seconds = time.perf_counter() - begin
    # NOTE: the step still in flight (launched for rows that finished meanwhile) is finished now, untimed:
    # left for the core's next round, its period spanned the other cores' rounds (~10 s), and the adaptive
    # core learnt that as what serving adds to a one-row step
    while core.has_unfinished_requests():
        core.step()
    return seconds, tokens


def format_result(r: dict) -> str:
    figures = "  ".join(f"{name} {value:7.1f}" for name, value in r["decode_tokens_per_s"].items())
    shares = " ".join(f"{share:.0%}" for share in np.asarray(r["adaptive_rows_by_drafts"]))
    over_k0 = "".join(f"  {name} / k0 {ratio:.3f}" for name, ratio in (r["over_k0_per_round"] or {}).items()
                      if name != "k0")
    unit = "tok/s" if r["closed_loop"] else "decode tok/s"
    return (f"adaptive batch {r['batch']:3d}  {figures} {unit}  adaptive / {r['best_fixed']} "
            f"{r['adaptive_over_best']:.3f} (per round {r['adaptive_over_best_per_round']:.3f})  "
            f"rows by drafts {shares}" + (f"\n  per round, median:{over_k0}" if over_k0 else ""))
