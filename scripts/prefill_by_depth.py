"""What a prompt costs to prefill by the MTP depths run over it, in one process, rounds interleaved.

    .venv/bin/python scripts/prefill_by_depth.py [--prompt-len 256] [--prompts 4] [--rounds 25] [--json OUT]

Each round prefills `--prompts` prompts of `--prompt-len` random tokens (max_tokens 1, greedy) on a k = 0 engine
core and on a K = 3 core pinned to each depth 0-3, as `mtpserve serve` builds them (engine_factory.py, the default
`[engine]` section). Prints each core's median over the rounds after the first three, a prompt token's share of
it, and its ratio to k = 0. A prompt chunk runs every MTP depth of its step over all its positions (each depth
writes its own KV, mtp_proposer.py), so this is the price the speculation policy's prompts' share follows
(docs/speculation.md, the step's depth).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from mtpserve.bench.engine_adaptive import pinned_name
from mtpserve.config import EngineConfig, SpeculativeConfig
from mtpserve.engine.engine_core import EngineCore
from mtpserve.engine.engine_factory import build_model_engine
from mtpserve.engine.request import EngineRequest, SamplingParams
from mtpserve.model.loader import load_serving_model

MODEL_DIR = Path(__file__).resolve().parent.parent / "daemon" / "default_model"
MAX_DEPTH = 3
SKIPPED_ROUNDS = 3  # NOTE: a core's first prefills are its first calls (allocations), not its steady cost


def cores(model_dir: Path) -> dict[str, EngineCore]:
    """k = 0, and the K = 3 core pinned to each depth (`Speculation.forced`)."""
    model = load_serving_model(model_dir, draft_weight_dtype=SpeculativeConfig().draft_weight_dtype)
    built = {"k0": build_model_engine(model, EngineConfig(),
                                      SpeculativeConfig(num_speculative_tokens=0, adaptive=False))}
    for depth in range(MAX_DEPTH + 1):
        core = build_model_engine(model, EngineConfig(),
                                  SpeculativeConfig(num_speculative_tokens=MAX_DEPTH, adaptive=False))
        core.speculation.forced = depth
        built[pinned_name(MAX_DEPTH, depth)] = core  # NOTE: named as `bench engine --model-pin` names them
    return built


def prefill_seconds(core: EngineCore, prompts: list[tuple[int, ...]], tag: str) -> float:
    """Seconds to prefill these prompts together and emit each one's first token."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(EngineRequest(f"{tag}-{i}", prompt, params))
    begin = time.perf_counter()
    while core.has_unfinished_requests():
        core.step()
    return time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser(description="What a prompt costs to prefill by the MTP depths run over it.")
    parser.add_argument("--model", type=Path, default=MODEL_DIR)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=4, help="prompts prefilled together each round")
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    built = cores(args.model)
    vocab = next(iter(built.values())).runner.vocab_size
    rng = np.random.default_rng(0)
    seconds: dict[str, list[float]] = {name: [] for name in built}
    for r in range(args.rounds):
        # NOTE: each core its own prompts: a prompt a core had prefilled before would hit its prefix cache
        for name in (built if r % 2 == 0 else reversed(list(built))):
            prompts = [tuple(int(t) for t in rng.integers(1, vocab, args.prompt_len)) for _ in range(args.prompts)]
            seconds[name].append(prefill_seconds(built[name], prompts, f"{r}"))
    tokens = args.prompt_len * args.prompts
    medians = {name: statistics.median(values[SKIPPED_ROUNDS:]) for name, values in seconds.items()}
    for name, median in medians.items():
        print(f"{name:6s} {median * 1e3:8.2f} ms  {median * 1e3 / tokens:.4f} ms a prompt token  "
              f"x{median / medians['k0']:.3f} of k0")
    if args.json:
        args.json.write_text(json.dumps({"prompt_len": args.prompt_len, "prompts": args.prompts,
                                         "rounds": args.rounds, "median_seconds": medians,
                                         "seconds": seconds}, indent=1))
    for core in built.values():
        core.close()


if __name__ == "__main__":
    main()
