"""`mtpserve bench engine`: the engine core on the synthetic device (fixed step time, k drafts, a set
acceptance rate), device busy fraction with overlap on and off, at several batch sizes; with
`--model DIR`, also decode tokens/s of that model for each k (see engine_model.py).

The engine runs closed-loop: `batch` requests are kept in flight, a finished one is replaced at once.
Busy fraction = device time spent executing steps / wall time, over a window after warm-up, on the
synthetic device's own timeline (a step starts at launch or when the previous one ends). The stricter
"nominal" figure counts only completed steps x step time / wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from mtpserve.engine.engine_core import CoreConfig, EngineCore
from mtpserve.engine.request import EngineRequest, SamplingParams
from mtpserve.engine.scheduler import SchedulerConfig
from mtpserve.engine.synthetic_runner import SyntheticConfig, SyntheticRunner
from mtpserve.host_memory import keep_freed_memory


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    overlap: bool
    k: int
    step_ms: float
    acceptance_rate: float
    prompt_len: int
    max_tokens: int
    warmup_steps: int
    measure_steps: int


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("engine", help="engine core on the synthetic device: busy fraction, "
                              "overlap on vs off")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128],
                   help="requests kept in flight (closed loop), one run each with overlap off and on")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--step-ms", type=float, default=10.0, help="synthetic device step time")
    p.add_argument("--acceptance-rate", type=float, default=0.7,
                   help="probability that each synthetic draft is right")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--measure-steps", type=int, default=200)
    p.add_argument("--model", type=Path, default=None,
                   help="also benchmark this model directory (config.json, safetensors, tokenizer.json)")
    p.add_argument("--model-batch", type=int, nargs="+", default=[1, 16], help="model: batch sizes")
    p.add_argument("--model-k", type=int, nargs="+", default=[0, 1, 2, 3],
                   help="model: num_speculative_tokens values (0 = MTP off, the baseline)")
    p.add_argument("--model-prompt-len", type=int, default=64)
    p.add_argument("--model-max-tokens", type=int, default=64)
    p.add_argument("--model-rounds", type=int, default=2, help="batches of prompts per (batch, k)")
    p.add_argument("--model-repeat", type=int, default=1,
                   help="model: run the whole batch x k sweep this many times (each k=2 run is compared "
                        "with the k=0 run just before it, so a noisy host shifts both); reports the medians")
    p.add_argument("--model-equality-prompts", type=int, default=50,
                   help="prompts for the greedy MTP on/off equality check (0 = skip)")
    p.add_argument("--model-adaptive", action="store_true",
                   help="model: instead of one run per k, the speculation policy (K = the largest --model-k) "
                        "against every k, in one process, rounds interleaved (engine_adaptive.py)")
    p.add_argument("--model-temperature", type=float, default=0.0,
                   help="model, with --model-adaptive: sampling temperature (0 = greedy)")
    p.add_argument("--model-closed-loop", action="store_true",
                   help="model, with --model-adaptive: keep --model-batch streams busy (3 x batch requests a "
                        "round, a new one as each finishes) and time prefill and decode together, as served")
    p.add_argument("--model-pin", type=int, nargs="*", default=[], metavar="DEPTH",
                   help="model, with --model-adaptive: add the adaptive core's runner with every row's drafts "
                        "pinned to each DEPTH (k<K>@<DEPTH>), which splits the K runner's cost from the policy's")
    p.add_argument("--model-trace", type=Path, default=None, metavar="PATH",
                   help="model, with --model-adaptive: append the adaptive core's step trace to PATH (the columns "
                        "MTP_STEP_TRACE writes; the fixed cores are not traced)")
    p.add_argument("--skip-synthetic", action="store_true")
    p.add_argument("--out", type=Path, default=Path("engine-bench.json"), help="JSON results file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.model_adaptive and args.model is None:
        raise SystemExit("--model-adaptive compares engines on a real model: give --model DIR")
    # NOTE: refused, not ignored: a run without the option it was asked for reports figures of another run
    needs_adaptive = [name for name, given in (("--model-pin", args.model_pin),
                                               ("--model-closed-loop", args.model_closed_loop),
                                               ("--model-temperature", args.model_temperature),
                                               ("--model-trace", args.model_trace)) if given]
    if needs_adaptive and not args.model_adaptive:
        raise SystemExit(f"{', '.join(needs_adaptive)}: only with --model-adaptive")
    if any(not 0 <= depth <= max(args.model_k) for depth in args.model_pin):
        raise SystemExit(f"--model-pin: a depth from 0 to the largest --model-k ({max(args.model_k)})")
    keep_freed_memory()  # NOTE: as a rank process does, so the in-process figures are the served engine's
    report: dict = {"benchmark": "engine", "synthetic": [], "model": []}
    for batch in [] if args.skip_synthetic else args.batch:
        for overlap in (False, True):
            case = Case(batch, overlap, args.k, args.step_ms, args.acceptance_rate, args.prompt_len,
                        args.max_tokens, args.warmup_steps, args.measure_steps)
            report["synthetic"].append(measure(case))
            print(format_row(report["synthetic"][-1]), flush=True)
    if args.model is not None and args.model_adaptive:
        from mtpserve.bench.engine_adaptive import run_adaptive_bench

        report["model_dir"] = str(args.model)
        report["adaptive"] = run_adaptive_bench(args.model, args.model_batch, args.model_k, args.model_prompt_len,
                                                args.model_max_tokens, args.model_rounds, args.model_temperature,
                                                args.model_closed_loop, args.model_pin, args.model_trace)
    elif args.model is not None:
        from mtpserve.bench.engine_model import run_model_bench

        report["model_dir"] = str(args.model)
        runs = [run_model_bench(args.model, args.model_batch, args.model_k, args.model_prompt_len,
                                args.model_max_tokens, args.model_rounds) for _ in range(args.model_repeat)]
        report["model"] = runs[0] if len(runs) == 1 else median_rows(runs)
        if len(runs) > 1:
            report["model_runs"] = runs
            for r in report["model"]:
                print(format_median(r), flush=True)
        if args.model_equality_prompts:
            from mtpserve.bench.engine_equality import equality_report
            from mtpserve.model.loader import load_serving_model

            report["greedy_equality"] = equality_report(load_serving_model(args.model), args.model,
                                                        [k for k in args.model_k if k],
                                                        args.model_equality_prompts, 32)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


def make_core(case: Case) -> EngineCore:
    num_blocks = case.batch * ((case.prompt_len + case.max_tokens) // 16 + 4) + 64
    budget = max(2048, case.batch * (case.k + 1))
    sched = SchedulerConfig(max_num_seqs=case.batch, max_num_batched_tokens=budget,
                            max_prefill_chunk=512, num_speculative_tokens=case.k,
                            num_blocks=num_blocks, block_size=16)
    runner = SyntheticRunner(SyntheticConfig(
        step_time_s=case.step_ms / 1e3, acceptance_rate=case.acceptance_rate, vocab_size=32000,
        num_speculative_tokens=case.k, max_num_seqs=case.batch, num_blocks=num_blocks, block_size=16))
    # NOTE: a fixed k, so busy fractions compare the overlap alone
    return EngineCore(CoreConfig(sched, overlap=case.overlap, adaptive_speculation=False), runner)


def measure(case: Case) -> dict:
    core = make_core(case)
    gen = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=case.max_tokens, ignore_eos=True)
    counter = 0
    host_s = tokens = 0.0
    wall0, accepted0, wait0 = time.perf_counter(), _acceptance(core), core.wait_seconds  # reset below
    for step in range(case.warmup_steps + case.measure_steps):
        if step == case.warmup_steps:
            wall0, accepted0 = time.perf_counter(), _acceptance(core)
            wait0 = core.wait_seconds
            host_s = tokens = 0.0
        while core.scheduler.num_unfinished < case.batch:
            prompt = tuple(int(t) for t in gen.integers(1, 32000, case.prompt_len))
            core.add_request(EngineRequest(f"b{counter}", prompt, params))
            counter += 1
        begin = time.perf_counter()
        out = core.step()
        host_s += time.perf_counter() - begin
        tokens += int(out.num_tokens.sum())
    wall1 = time.perf_counter()
    wall = wall1 - wall0
    core.close()  # NOTE: lets the last launched step end, so busy_between sees every step that overlaps
    busy = core.runner.busy_between(wall0, wall1)
    steps, drafted = _acceptance(core)[0] - accepted0[0], _acceptance(core)[1] - accepted0[1]
    return {**dataclasses.asdict(case), "busy_fraction": busy / wall, "wall_s": wall,
            # NOTE: the stricter figure: only the nominal step time counts as busy, not the device
            # thread's own bookkeeping nor its late wake-ups.
            "nominal_busy_fraction": case.measure_steps * case.step_ms / 1e3 / wall,
            "steps_per_s": case.measure_steps / wall, "tokens_per_s": tokens / wall,
            "mean_acceptance_length": 1 + drafted / max(steps, 1),
            "host_work_ms_per_step": 1e3 * (host_s - (core.wait_seconds - wait0)) / case.measure_steps}


def _acceptance(core: EngineCore) -> tuple[int, int]:
    return core.acceptance.num_draft_steps, core.acceptance.num_accepted_tokens


def format_row(r: dict) -> str:
    return (f"batch {r['batch']:4d}  overlap {'on ' if r['overlap'] else 'off'}  k={r['k']}  "
            f"busy {100 * r['busy_fraction']:5.1f}% (nominal {100 * r['nominal_busy_fraction']:5.1f}%)  "
            f"{r['steps_per_s']:6.1f} steps/s  "
            f"{r['tokens_per_s']:8.1f} tok/s  accept len {r['mean_acceptance_length']:.2f}  "
            f"host {r['host_work_ms_per_step']:.2f} ms/step")


def median_rows(runs: list[list[dict]]) -> list[dict]:
    """Per (batch, k): the median of each run's tokens/s and speedup (speedups are per run, not a
    ratio of medians); acceptance is deterministic for greedy decoding, so it is the first run's."""
    rows = []
    for i, first in enumerate(runs[0]):
        same = [run[i] for run in runs]
        speedups = [r["speedup_vs_k0"] for r in same if r["speedup_vs_k0"] is not None]
        rows.append({**first, "repeats": len(runs),
                     "decode_tokens_per_s": float(np.median([r["decode_tokens_per_s"] for r in same])),
                     "speedup_vs_k0": float(np.median(speedups)) if speedups else None,
                     "speedups_vs_k0": speedups})
    return rows


def format_median(r: dict) -> str:
    speedup = f"  x{r['speedup_vs_k0']:.2f} vs k=0 (runs: " + \
        ", ".join(f"{x:.2f}" for x in r["speedups_vs_k0"]) + ")" if r["speedup_vs_k0"] else ""
    return (f"median of {r['repeats']}  batch {r['batch']:3d}  k={r['k']}  {r['decode_tokens_per_s']:8.1f} "
            f"decode tok/s  accept len {r['mean_acceptance_length']:.2f}{speedup}")
