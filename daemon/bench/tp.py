"""`mtpserve bench tp`: decode tokens/s of the model at tensor-parallel size 1 vs N, and what one
step's communication costs.

For each size, the ranks are started as the launcher starts them (tp_env environment, gloo on a CPU
host); rank 0 runs the engine closed-loop (greedy, MTP k drafts) on held-out prompts, exactly as
`bench engine --model`, and reports:
  - decode tokens/s and mean step time;
  - plan broadcast time per step (rank 0, the two broadcasts that carry the step plan);
  - the model's own collectives per step, timed on rank 0 (count and total, waiting included), and
    the latency of one isolated all-reduce of a [batch*(k+1), hidden] tensor.
On 2 shared cores TP=2 is not expected to be faster: the figure documents the communication cost.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from mtpserve.config import EngineConfig, ParallelConfig, SpeculativeConfig
from mtpserve.engine.tp_env import rank_environment
from mtpserve.model.parallel import TensorParallel


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("tp", help="tensor parallelism: tokens/s at TP=1 vs TP=N, communication per step")
    p.add_argument("--model", type=Path, required=True, help="model directory")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes to compare")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="requests in flight")
    p.add_argument("--k", type=int, default=2, help="num_speculative_tokens")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("tp-bench.json"), help="JSON results file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    results = []
    for batch in args.batch:
        for size in args.tp:
            r = measure(args, size, batch)
            results.append(r)
            print(f"tp={size}  batch {batch:3d}  k={args.k}  {r['decode_tokens_per_s']:8.1f} decode tok/s  "
                  f"step {r['step_ms']:6.2f} ms  plan bcast {r['plan_broadcast_ms']:5.2f} ms/step  "
                  f"collectives {r['collective_ms_per_step']:5.2f} ms/step ({r['collectives_per_step']:.0f} calls, "
                  f"one all_reduce {r['all_reduce_ms']:5.3f} ms)",
                  flush=True)
    args.out.write_text(json.dumps({"benchmark": "tp", "model": str(args.model), "results": results}, indent=2))
    print(f"wrote {args.out}")
    return 0


def measure(args: argparse.Namespace, size: int, batch: int) -> dict:
    """Start `size` ranks of this module as workers; rank 0's JSON line is the result."""
    parallel = ParallelConfig(tensor_parallel_size=size, master_port=_free_port())
    spec = json.dumps({"model": str(args.model), "batch": batch, "k": args.k, "prompt_len": args.prompt_len,
                       "max_tokens": args.max_tokens, "rounds": args.rounds})
    procs = [subprocess.Popen([sys.executable, "-m", "mtpserve.bench.tp", spec, str(r)],
                              env={**os.environ, **(rank_environment(parallel, r) if size > 1 else {})},
                              stdout=subprocess.PIPE, text=True) for r in range(size)]
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"tp={size} batch={batch}: a rank failed")
    return {"tp": size, **json.loads(outputs[0].strip().splitlines()[-1])}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- a rank -----------------------------------------------------------------------------------

def worker(spec: dict, rank: int, size: int) -> dict | None:
    from mtpserve.engine.tp_group import join_group
    from mtpserve.model.loader import load_serving_model

    tp = TimedTP.of(join_group(rank, size))
    model = load_serving_model(spec["model"], tp)
    if rank > 0:
        return _follow(model, tp, spec)
    return _lead(model, tp, spec)


def _engine_sections(spec: dict) -> tuple[EngineConfig, SpeculativeConfig]:
    batch = spec["batch"]
    blocks = batch * ((spec["prompt_len"] + spec["max_tokens"]) // 16 + 4) + 16
    engine = EngineConfig(max_num_seqs=batch, num_kv_blocks=blocks, block_size=16,
                          max_num_batched_tokens=max(1024, batch * spec["prompt_len"]))
    return engine, SpeculativeConfig(num_speculative_tokens=spec["k"])


def _lead(model, tp, spec: dict) -> dict:
    from mtpserve.bench.engine_model import heldout_prompts
    from mtpserve.engine.engine_factory import build_model_engine
    from mtpserve.engine.request import EngineRequest, SamplingParams
    from mtpserve.engine.tp_factory import build_leader_engine
    from mtpserve.engine.tp_plan_channel import PlanChannel

    batch, channel = spec["batch"], PlanChannel(tp)
    core = (build_model_engine(model, *_engine_sections(spec)) if tp.size == 1
            else build_leader_engine(model, channel, *_engine_sections(spec)))
    prompts = heldout_prompts(Path(spec["model"]), batch * spec["rounds"], spec["prompt_len"], core.runner.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    seconds = tokens = steps = 0
    for r in range(spec["rounds"]):
        for i, prompt in enumerate(prompts[r * batch:(r + 1) * batch]):
            core.add_request(EngineRequest(f"{r}-{i}", prompt, params))
        s, t, n = _decode_window(core, batch)
        seconds, tokens, steps = seconds + s, tokens + t, steps + n
    core.close()
    rows = batch * (spec["k"] + 1)
    return {"batch": batch, "k": spec["k"], "decode_tokens_per_s": tokens / seconds,
            "decode_tokens": tokens, "decode_steps": steps, "step_ms": 1e3 * seconds / max(steps, 1),
            "plan_broadcast_ms": 1e3 * channel.comm_seconds / max(channel.num_plans, 1),
            "plan_bytes_per_step": channel.num_bytes / max(channel.num_plans, 1),
            "collective_ms_per_step": 1e3 * tp.clock.seconds / max(channel.num_plans, 1),
            "collectives_per_step": tp.clock.calls / max(channel.num_plans, 1),
            "all_reduce_ms": _all_reduce_ms(tp, rows, model.config.hidden_size)}


def _decode_window(core, batch: int) -> tuple[float, int, int]:
    """Step until all finish; seconds, tokens and steps from when every request has its first token."""
    started: set[int | str] = set()
    begin: float | None = None
    tokens = steps = 0
    while core.has_unfinished_requests():
        out = core.step()
        if begin is not None:
            tokens, steps = tokens + int(out.num_tokens.sum()), steps + 1
        started.update(rid for rid, n in zip(out.request_ids, out.num_tokens) if n)
        if begin is None and len(started) == batch:
            begin = time.perf_counter()
    assert begin is not None, "some request never produced its first token"
    return time.perf_counter() - begin, tokens, steps


def _follow(model, tp, spec: dict) -> None:
    from mtpserve.engine.tp_factory import build_follower_runner
    from mtpserve.engine.tp_plan_channel import PlanChannel

    runner = build_follower_runner(model, PlanChannel(tp), *_engine_sections(spec))
    runner.follow().result()
    runner.close()
    _all_reduce_ms(tp, spec["batch"] * (spec["k"] + 1), model.config.hidden_size)
    return None


def _all_reduce_ms(tp, rows: int, hidden: int, n: int = 200) -> float:
    """Latency of one all-reduce of a [rows, hidden] float32 tensor (every rank calls this)."""
    if tp.size == 1:
        return 0.0
    import paddle

    x = paddle.ones([rows, hidden], dtype="float32")
    tp.all_reduce(x)
    start = time.perf_counter()
    for _ in range(n):
        tp.all_reduce(x)
    return 1e3 * (time.perf_counter() - start) / n


class Clock:
    """Mutable totals shared by a frozen TimedTP."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0


@dataclasses.dataclass(frozen=True)
class TimedTP(TensorParallel):
    """The model's collectives, timed: every all-reduce and all-gather of every forward (rank 0's
    figure includes waiting for the slower rank, which is part of the cost)."""

    clock: Clock = dataclasses.field(default_factory=Clock)

    @classmethod
    def of(cls, tp: TensorParallel) -> TimedTP:
        return cls(rank=tp.rank, size=tp.size, group=tp.group)

    def all_reduce(self, x):
        return self._timed(super().all_reduce, x)

    def all_gather_last(self, x):
        return self._timed(super().all_gather_last, x)

    def _timed(self, fn, x):
        if self.size == 1:
            return fn(x)
        start = time.perf_counter()
        out = fn(x)
        self.clock.seconds += time.perf_counter() - start
        self.clock.calls += 1
        return out


if __name__ == "__main__":
    spec_arg, rank_arg = json.loads(sys.argv[1]), int(sys.argv[2])
    result = worker(spec_arg, rank_arg, int(os.environ.get("PADDLE_TRAINERS_NUM", "1")))
    if result is not None:
        print(json.dumps(result), flush=True)
