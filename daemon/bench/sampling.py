"""`mtpserve bench sampling`: a sampled step's draws and verification, from the processed logits to the emitted
tokens, as the CPU op does them (`spec_verify.sample_and_verify`) and as the Paddle path does (the other
devices' way, `spec_verify.sample_and_verify_paddle`), side by side, by requests, window and top-p.

Prints microseconds per step (median of `--repeats`) and the ratio, and writes JSON. Random logits at the
bundled model's vocabulary, every request sampled at `--temperature`; drafts are the target's argmax, so
windows are verified (not only cut at their first row).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("sampling", help="a sampled step's draws and verification: the CPU op against Paddle's")
    p.add_argument("--requests", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--windows", type=int, nargs="+", default=[1, 2, 4], help="verify rows per request (drafts + 1)")
    p.add_argument("--top-p", type=float, nargs="+", default=[1.0, 0.9])
    p.add_argument("--temperature", type=float, default=1.5)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--json", type=Path, default=Path("runs/bench_sampling.json"))
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from mtpserve.engine.spec_verify import host_sampling_available

    if not host_sampling_available():
        print("the CPU op mtp_sample_verify is not built here (or Paddle has CUDA): nothing to compare")
        return 1
    print(f"{'requests':>8} {'window':>6} {'top-p':>6} {'paddle us':>10} {'op us':>8} {'ratio':>6}")
    rows = []
    for top_p in args.top_p:
        for requests in args.requests:
            for window in args.windows:
                paddle_us, op_us = time_case(requests, window, top_p, args.temperature, args.vocab, args.repeats)
                rows.append({"requests": requests, "window": window, "top_p": top_p, "paddle_us": round(paddle_us, 1),
                             "op_us": round(op_us, 1), "speedup": round(paddle_us / op_us, 2)})
                print(f"{requests:>8} {window:>6} {top_p:>6} {paddle_us:>10.0f} {op_us:>8.0f} {paddle_us / op_us:>6.1f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"temperature": args.temperature, "vocab": args.vocab, "cases": rows}, indent=1))
    print(f"wrote {args.json}")
    return 0


def time_case(requests: int, window: int, top_p: float, temperature: float, vocab: int,
              repeats: int) -> tuple[float, float]:
    """Median microseconds of the Paddle path and of the op for one step of this shape."""
    import paddle

    from mtpserve.engine import rng
    from mtpserve.engine.sampler import processed_logits
    from mtpserve.engine.spec_verify import HostSampling, sample_and_verify, sample_and_verify_paddle
    from mtpserve.host_tensor import StagedTensors

    gen = np.random.default_rng(requests * 100 + window)
    logits = paddle.to_tensor((gen.standard_normal((requests * window, vocab)) * 3).astype(np.float32))
    drafts = logits.numpy().reshape(requests, window, vocab).argmax(-1)[:, :window - 1]
    hs = HostSampling(np.full(requests, temperature, np.float32), np.full(requests, top_p, np.float32),
                      np.zeros(requests, np.int64), np.zeros(requests, np.float32))
    keys = rng.seed_to_key(np.arange(requests))
    out_index = np.broadcast_to(np.arange(window)[None, :] + 7, (requests, window))
    staged = StagedTensors()

    def with_paddle() -> None:
        # NOTE: the runner's Paddle branch from its parameters on (ModelRunner._decide)
        params = hs.row_params(keys, out_index)
        processed = processed_logits(logits, None, None, params)
        first, res = sample_and_verify_paddle(processed, paddle.argmax(processed, axis=-1).reshape([requests, window]),
                                              params, drafts)
        if res is not None:
            res.token_ids.numpy()

    def with_op() -> None:
        # NOTE: the runner's CPU branch (ModelRunner._sample_on_host), its uniforms included
        key_grid = np.broadcast_to(keys[:, None], out_index.shape)
        sample_and_verify(logits, drafts, hs, rng.uniforms_host(key_grid, out_index, rng.Purpose.SAMPLE),
                          rng.uniforms_host(key_grid, out_index, rng.Purpose.ACCEPT)[:, :window - 1],
                          np.zeros(requests, bool), staged.stage)

    with paddle.no_grad():
        return _median_us(with_paddle, repeats), _median_us(with_op, repeats)


def _median_us(fn: Callable[[], None], repeats: int) -> float:
    for _ in range(3):
        fn()  # NOTE: warm-up (the op's worker threads, first-call dispatch)
    samples = []
    for _ in range(repeats):
        begin = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - begin) * 1e6)
    return statistics.median(samples)
