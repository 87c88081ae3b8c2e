"""`mtpserve bench attention`: the paged attention of one layer, as a step calls it, by shape.

Times `PagedContext.attend` (the CPU op `mtp_paged_attention` reading the cache in place) for decode
windows of a batch, and for a prefill chunk over a long context, at the bundled model's head shape and
at a 7B-class one, for each KV cache dtype (`--kv-dtypes`, side by side). Prints microseconds per call
(median of `--repeats`) and writes JSON. Run it before and after a kernel change on the same idle host:
the op is the largest part of a long-context step.

`--layouts` also times 64 decode rows over blocks that are consecutive in the pool against blocks
scattered over it (what a pool the prefix cache has cycled hands out), for each of `--block-sizes`: the
figures behind `[engine] block_size` (docs/architecture.md, "Host memory").
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
LAYOUTS = ("consecutive", "scattered")
# NOTE: a pool of the default 512 MiB's size at K = 3 (4,680 blocks of 16), and 4 layers of it read in turn:
# 64 rows x 350 keys is then ~90 MiB of KV per pass, read from memory as a step reads it, not from the L3
LAYOUT_POOL_TOKENS = 4680 * 16
LAYOUT_LAYERS = 4


class Case(NamedTuple):
    heads: str
    kind: str  # "decode" (rows x window) or "prefill" (one chunk)
    rows: int
    queries: int  # per row
    context: int  # keys each row sees at its last query


class LayoutCase(NamedTuple):
    block_size: int
    layout: str  # "consecutive": row after row in block order; "scattered": a random permutation of the pool
    rows: int
    context: int


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
    from mtpserve.model.kv_cache import KVCache

    h, kvh, d = HEADS[case.heads]
    blocks_per_row = -(-case.context // BLOCK)
    kv = KVCache.allocate(1, case.rows * blocks_per_row, BLOCK, kvh, d, kv_dtype)
    _fill(kv, kv_dtype)
    tables = np.arange(case.rows * blocks_per_row, dtype=np.int32).reshape(case.rows, blocks_per_row)
    return _time_layers(kv, tables, case.queries, case.context, h, repeats, layers=1)


def time_layout(case: LayoutCase, repeats: int, pool_tokens: int = LAYOUT_POOL_TOKENS) -> float:
    """Median microseconds of one layer's attend call at the bundled heads, the layers called in turn."""
    from mtpserve.model.kv_cache import KVCache

    h, kvh, d = HEADS["bundled"]
    num_blocks = pool_tokens // case.block_size
    blocks_per_row = -(-case.context // case.block_size)
    if case.rows * blocks_per_row > num_blocks:
        raise ValueError(f"{case.rows} rows of {case.context} keys do not fit a pool of {pool_tokens} tokens")
    kv = KVCache.allocate(LAYOUT_LAYERS, num_blocks, case.block_size, kvh, d)
    _fill(kv, "float32")
    gen = np.random.default_rng(0)
    order = np.arange(num_blocks) if case.layout == "consecutive" else gen.permutation(num_blocks)
    tables = order[:case.rows * blocks_per_row].astype(np.int32).reshape(case.rows, blocks_per_row)
    return _time_layers(kv, tables, 1, case.context, h, repeats, layers=LAYOUT_LAYERS)


def _fill(kv, kv_dtype: str) -> None:
    import paddle

    gen = np.random.default_rng(0)
    for t in (*kv.k, *kv.v):
        t.set_value(paddle.to_tensor(gen.standard_normal(t.shape).astype(kv_dtype)))


def _time_layers(kv, tables: np.ndarray, queries: int, context: int, heads: int, repeats: int,
                 layers: int) -> float:
    """Median microseconds of one attend call of `tables` [rows, blocks] int32, each row's `queries` last
    positions of `context` keys, over layers 0 .. layers-1 in turn."""
    import paddle

    from mtpserve.host_tensor import host_tensor
    from mtpserve.model.attention_context import PagedContext
    from mtpserve.model.forward_batch import ForwardBatch

    rows, bs = tables.shape[0], kv.block_size
    kvh, d = kv.k[0].shape[1], kv.k[0].shape[2]
    positions = np.concatenate([np.arange(context - queries, context)] * rows)
    slots = tables[np.repeat(np.arange(rows), queries), positions // bs] * bs + positions % bs
    batch = ForwardBatch(
        input_ids=host_tensor(np.zeros(rows * queries, np.int64)),
        positions=host_tensor(positions.astype(np.int64)), slot_mapping=host_tensor(slots.astype(np.int64)),
        cu_seqlens_q=host_tensor(np.arange(rows + 1, dtype=np.int32) * queries),
        seq_lens_kv=host_tensor(np.full(rows, context, np.int32)),
        block_tables=host_tensor(tables), max_q_len=queries)
    ctx = PagedContext(batch, kv)
    gen = np.random.default_rng(1)
    q = host_tensor(gen.standard_normal((rows * queries, heads, d)).astype(np.float32))
    k = host_tensor(gen.standard_normal((rows * queries, kvh, d)).astype(np.float32))
    with paddle.no_grad():
        for layer in range(layers):
            ctx.attend(layer, q, k, k)  # NOTE: warm-up (pool threads, page faults)
        samples = []
        for _ in range(repeats):
            begin = time.perf_counter()
            for layer in range(layers):
                ctx.attend(layer, q, k, k)
            samples.append((time.perf_counter() - begin) * 1e6 / layers)
    return statistics.median(samples)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("attention", help="paged attention per layer call, by shape (CPU op)")
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--kv-dtypes", nargs="+", default=["float32", "float16"], choices=["float32", "float16"])
    p.add_argument("--layouts", action="store_true",
                   help="also time 64 decode rows over consecutive and scattered blocks, by block size")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--layout-contexts", type=int, nargs="+", default=[350, 1024])
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
    report: dict = {"cases": rows}
    if args.layouts:
        report["layouts"] = run_layouts(args.block_sizes, args.layout_contexts, args.repeats)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")
    return 0


def run_layouts(block_sizes: list[int], contexts: list[int], repeats: int, rows: int = 64,
                pool_tokens: int = LAYOUT_POOL_TOKENS) -> list[dict]:
    """Consecutive against scattered blocks, side by side per block size; returns the JSON rows."""
    print(f"\n{rows} decode rows, bundled heads, {LAYOUT_LAYERS} layers in turn, a pool of {pool_tokens} "
          "tokens: us per layer call")
    print(f"{'block':>6} {'context':>8} {'consecutive':>12} {'scattered':>10} {'ratio':>6}")
    out = []
    for context in contexts:
        for block_size in block_sizes:
            us = {layout: time_layout(LayoutCase(block_size, layout, rows, context), repeats, pool_tokens)
                  for layout in LAYOUTS}
            ratio = us["scattered"] / us["consecutive"]
            out.append({"block_size": block_size, "context": context, "rows": rows,
                        "us_per_call": {k: round(v, 1) for k, v in us.items()}, "scattered_over_consecutive": round(ratio, 3)})
            print(f"{block_size:>6} {context:>8} {us['consecutive']:>12.1f} {us['scattered']:>10.1f} {ratio:>6.2f}")
    return out
