"""`mtpserve bench attention`: the paged attention of one layer, as a step calls it, by shape.

Times `PagedContext.attend` (the CPU op `mtp_paged_attention` reading the cache in place) for decode
windows of a batch, and for a prefill chunk over a long context, at the bundled model's head shape and
at a 7B-class one, for each KV cache dtype (`--kv-dtypes`, side by side). Prints microseconds per call
(median of `--repeats`) and writes JSON. Run it before and after a kernel change on the same idle host:
the op is the largest part of a long-context step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

HEADS = {"bundled": (4, 2, 64), "7b": (32, 8, 128)}  # query heads, KV heads, head dim
BLOCK = 16


class Case(NamedTuple):
    heads: str
    kind: str  # "decode" (rows x window) or "prefill" (one chunk)
    rows: int
    queries: int  # per row
    context: int  # keys each row sees at its last query


def cases(contexts: list[int]) -> list[Case]:
    out = []
    for heads in HEADS:
        for context in contexts:
            out.append(Case(heads, "decode", 16, 3, context))
            if context >= 512:  # NOTE: the chunk's 512 queries are the context's last positions
                out.append(Case(heads, "prefill", 1, 512, context))
    return out


def time_case(case: Case, repeats: int, kv_dtype: str = "float32") -> float:
    """Median microseconds of one attend call."""
    import paddle

    from mtpserve.host_tensor import host_tensor
    from mtpserve.model.attention_context import PagedContext
    from mtpserve.model.forward_batch import ForwardBatch
    from mtpserve.model.kv_cache import KVCache

    h, kvh, d = HEADS[case.heads]
    blocks_per_row = -(-case.context // BLOCK)
    kv = KVCache.allocate(1, case.rows * blocks_per_row, BLOCK, kvh, d, kv_dtype)
    gen = np.random.default_rng(0)
    for t in (kv.k[0], kv.v[0]):
        t.set_value(paddle.to_tensor(gen.standard_normal(t.shape).astype(kv_dtype)))
    tables = np.arange(case.rows * blocks_per_row, dtype=np.int32).reshape(case.rows, blocks_per_row)
    positions = np.concatenate([np.arange(case.context - case.queries, case.context)] * case.rows)
    slots = tables[np.repeat(np.arange(case.rows), case.queries), positions // BLOCK] * BLOCK + positions % BLOCK
    batch = ForwardBatch(
        input_ids=host_tensor(np.zeros(case.rows * case.queries, np.int64)),
        positions=host_tensor(positions.astype(np.int64)), slot_mapping=host_tensor(slots.astype(np.int64)),
        cu_seqlens_q=host_tensor(np.arange(case.rows + 1, dtype=np.int32) * case.queries),
        seq_lens_kv=host_tensor(np.full(case.rows, case.context, np.int32)),
        block_tables=host_tensor(tables), max_q_len=case.queries)
    ctx = PagedContext(batch, kv)
    q = host_tensor(gen.standard_normal((case.rows * case.queries, h, d)).astype(np.float32))
    k = host_tensor(gen.standard_normal((case.rows * case.queries, kvh, d)).astype(np.float32))
    with paddle.no_grad():
        ctx.attend(0, q, k, k)  # NOTE: warm-up (pool threads, page faults)
        samples = []
        for _ in range(repeats):
            begin = time.perf_counter()
            ctx.attend(0, q, k, k)
            samples.append((time.perf_counter() - begin) * 1e6)
    return statistics.median(samples)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("attention", help="paged attention per layer call, by shape (CPU op)")
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--kv-dtypes", nargs="+", default=["float32", "float16"], choices=["float32", "float16"])
    p.add_argument("--json", type=Path, default=Path("runs/bench_attention.json"))
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from mtpserve.model.attention_context import PAGED_OP
    from mtpserve.ops import cpu_op_available

    if not cpu_op_available(PAGED_OP):
        print(f"the CPU op {PAGED_OP} is not built here: nothing to time")
        return 1
    rows = []
    print(f"{'heads':8} {'kind':8} {'rows x q':>9} {'context':>8}" + "".join(f"{'us ' + d:>14}" for d in args.kv_dtypes))
    for case in cases(args.contexts):
        us = {dtype: time_case(case, args.repeats, dtype) for dtype in args.kv_dtypes}
        rows.append({**case._asdict(), "us_per_call": {d: round(t, 1) for d, t in us.items()}})
        print(f"{case.heads:8} {case.kind:8} {f'{case.rows}x{case.queries}':>9} {case.context:>8}"
              + "".join(f"{t:>14.1f}" for t in us.values()))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"cases": rows}, indent=1))
    print(f"wrote {args.json}")
    return 0
