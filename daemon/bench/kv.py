"""`mtpserve bench kv`: how long a decode rank takes to pull one prompt's KV from a prefill rank.

A holder process (this module with `--holder`) plays the prefill rank: KV shaped as the model's rank
allocates it (every layer, plus one K/V pair per MTP depth), registered with a KVTransferAgent and
filled with known data. This process plays the decode rank: its own KV and agent, and for each
prompt length it reads that many tokens' blocks (read_descriptors + KVTransferAgent.read, as the
decode rank does), `--repeats` times, for two block patterns:
  contiguous  prefill blocks 0..n-1 into local blocks 0..n-1: one descriptor per buffer
  scattered   random block ids on both sides, never both consecutive: one descriptor per buffer per
              block (the worst case for a fragmented block pool)
Per case: median and p90 wall ms of the read, GB/s at the median, bytes, descriptors, and the
calling thread's CPU ms (Mooncake busy-polls for completion). Every case's bytes are checked once.
The first read pays the P2P handshake with the peer; it is reported apart (`first_read_ms`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import msgspec
import numpy as np

from mtpserve.ipc import request_channel as rc
from mtpserve.pd.kv_transfer import mooncake_environment

BUNDLED_MODEL = Path(__file__).resolve().parent.parent / "default_model"
PATTERNS = ("contiguous", "scattered")


@dataclasses.dataclass(frozen=True)
class KVShape:
    layers: int
    depths: int  # MTP depths (num_speculative_tokens): one K/V pair each
    kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: str = "float32"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("kv", help="PD: time to read a prompt's KV blocks from another process (Mooncake)")
    _arguments(p)
    p.set_defaults(func=run)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m mtpserve.bench.kv [options]`, the same as `mtpserve bench kv [options]`."""
    p = argparse.ArgumentParser(prog="mtpserve bench kv", description=(__doc__ or "").split("\n")[0])
    _arguments(p)
    return run(p.parse_args(argv))


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=BUNDLED_MODEL, help="model directory (its config.json)")
    p.add_argument("--k", type=int, default=2, help="MTP depths whose KV moves too")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048], help="prompt tokens")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--protocol", default="tcp", choices=["tcp", "rdma"])
    p.add_argument("--hostname", default="127.0.0.1", help="address the holder's agent is reached at")
    p.add_argument("--out", type=Path, default=Path("kv-bench.json"), help="JSON results file")


def run(args: argparse.Namespace) -> int:
    for key, value in mooncake_environment().items():  # NOTE: before Mooncake loads; quiet logs
        os.environ.setdefault(key, value)
    shape = _model_shape(args)
    holder = _start_holder(shape, args)
    try:
        report = _measure(shape, args, holder)
    finally:
        holder["proc"].stdin.close()
        holder["proc"].wait(timeout=30)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


def _model_shape(args: argparse.Namespace) -> KVShape:
    cfg = json.loads((args.model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    max_blocks = -(-max(args.lengths) // args.block_size)
    return KVShape(layers=cfg["num_hidden_layers"], depths=args.k, kv_heads=cfg["num_key_value_heads"],
                   head_dim=head_dim, block_size=args.block_size, num_blocks=2 * max_blocks)


# ---- the decode side (this process) -------------------------------------------------------------

def _start_holder(shape: KVShape, args: argparse.Namespace) -> dict:
    spec = json.dumps({"shape": dataclasses.asdict(shape), "protocol": args.protocol, "hostname": args.hostname})
    proc = subprocess.Popen([sys.executable, "-m", "mtpserve.bench.kv", "--holder", spec],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    hello = json.loads(proc.stdout.readline() or "null")
    if hello is None:
        raise RuntimeError(f"KV holder exited with {proc.wait()}")
    return {"proc": proc, "session": hello["session"], "layout": msgspec.convert(hello["layout"], rc.KVLayout)}


def _measure(shape: KVShape, args: argparse.Namespace, holder: dict) -> dict:
    from mtpserve.pd.kv_layout import kv_buffers, layout_of, regions_of
    from mtpserve.pd.kv_transfer import KVTransferAgent

    buffers = kv_buffers(*_allocate(shape))
    agent = KVTransferAgent.start(args.hostname, args.protocol, regions_of(buffers))
    layout = layout_of(buffers, shape.block_size)
    first_ms = _first_read_ms(agent, holder, layout)
    results = [_case(agent, holder, buffers, layout, shape, n, pattern, args.repeats)
               for pattern in PATTERNS for n in args.lengths]
    agent.close()
    return {"benchmark": "kv", "model": str(args.model), "protocol": args.protocol, "repeats": args.repeats,
            "shape": dataclasses.asdict(shape), "num_buffers": len(buffers),
            "block_bytes": layout.block_bytes[0], "first_read_ms": first_ms, "results": results}


def _first_read_ms(agent, holder: dict, layout: rc.KVLayout) -> float:
    from mtpserve.pd.kv_layout import read_descriptors

    start = time.perf_counter()
    agent.read(holder["session"], *read_descriptors(layout, [0], holder["layout"], [0]))
    ms = 1e3 * (time.perf_counter() - start)
    print(f"first read (P2P handshake included): {ms:.2f} ms")
    print(f"{'pattern':<11} {'tokens':>6} {'blocks':>6} {'descs':>6} {'bytes':>10} {'median ms':>10} "
          f"{'p90 ms':>8} {'GB/s':>7} {'cpu ms':>7}")
    return ms


def _case(agent, holder: dict, buffers, layout: rc.KVLayout, shape: KVShape, tokens: int, pattern: str,
          repeats: int) -> dict:
    from mtpserve.pd.kv_layout import read_descriptors

    local_blocks, remote_blocks = _blocks(shape, tokens, pattern)
    desc = read_descriptors(layout, local_blocks, holder["layout"], remote_blocks)
    wall, cpu, nbytes = [], [], 0
    for _ in range(repeats):
        w, c = time.perf_counter(), time.thread_time()
        nbytes = agent.read(holder["session"], *desc)
        wall.append(time.perf_counter() - w)
        cpu.append(time.thread_time() - c)
    _check(buffers, shape, local_blocks, remote_blocks)
    median = float(np.median(wall))
    row = {"pattern": pattern, "tokens": tokens, "blocks": len(local_blocks), "descriptors": len(desc.lengths),
           "bytes": nbytes, "median_ms": 1e3 * median, "p90_ms": 1e3 * float(np.percentile(wall, 90)),
           "gb_per_s": nbytes / median / 1e9, "cpu_ms": 1e3 * float(np.median(cpu))}
    print(f"{pattern:<11} {tokens:>6} {row['blocks']:>6} {row['descriptors']:>6} {nbytes:>10} "
          f"{row['median_ms']:>10.3f} {row['p90_ms']:>8.3f} {row['gb_per_s']:>7.3f} {row['cpu_ms']:>7.3f}",
          flush=True)
    return row


def _blocks(shape: KVShape, tokens: int, pattern: str) -> tuple[list[int], list[int]]:
    n = -(-tokens // shape.block_size)
    if pattern == "contiguous":
        return list(range(n)), list(range(n))
    rng = np.random.default_rng(n)
    local = np.sort(rng.permutation(shape.num_blocks)[:n])[::-1]  # NOTE: descending: no run ever forms
    return local.tolist(), rng.permutation(shape.num_blocks)[:n].tolist()


def _check(buffers, shape: KVShape, local_blocks: list[int], remote_blocks: list[int]) -> None:
    """The local blocks hold the holder's blocks, byte for byte."""
    bs = shape.block_size
    for i, buffer in enumerate(buffers):
        got, want = buffer.numpy(), _contents(shape, i)
        for lb, rb in zip(local_blocks, remote_blocks):
            if not np.array_equal(got[lb * bs:(lb + 1) * bs], want[rb * bs:(rb + 1) * bs]):
                raise AssertionError(f"buffer {i}: local block {lb} != remote block {rb}")


# ---- the prefill side (the holder process) ------------------------------------------------------

def _allocate(shape: KVShape):
    """(main KVCache, [depth KVCache]) as the model runner allocates them."""
    from mtpserve.model.kv_cache import KVCache

    args = (shape.num_blocks, shape.block_size, shape.kv_heads, shape.head_dim, shape.dtype)
    return KVCache.allocate(shape.layers, *args), [KVCache.allocate(1, *args) for _ in range(shape.depths)]


def _contents(shape: KVShape, buffer: int) -> np.ndarray:
    """[(num_blocks+1)*block_size, KVH, D]: what the holder's buffer `buffer` holds."""
    rows = (shape.num_blocks + 1) * shape.block_size
    rng = np.random.default_rng([1234, buffer])
    return rng.standard_normal((rows, shape.kv_heads, shape.head_dim), dtype=np.float32)


def _hold(spec: dict) -> None:
    """Register the KV, fill it through KVCache.write, announce session + layout, serve until stdin closes."""
    import paddle

    from mtpserve.pd.kv_layout import kv_buffers, layout_of, regions_of
    from mtpserve.pd.kv_transfer import KVTransferAgent

    shape = KVShape(**spec["shape"])
    main_kv, depths = _allocate(shape)
    buffers = kv_buffers(main_kv, depths)
    agent = KVTransferAgent.start(spec["hostname"], spec["protocol"], regions_of(buffers))
    slots = paddle.arange((shape.num_blocks + 1) * shape.block_size, dtype="int64")
    caches = [(main_kv, layer) for layer in range(shape.layers)] + [(depth, 0) for depth in depths]
    for i, (cache, layer) in enumerate(caches):  # buffer 2i is this cache's K, 2i+1 its V
        k, v = (paddle.to_tensor(_contents(shape, 2 * i + kv)) for kv in (0, 1))
        cache.write(layer, slots, k, v)
    hello = {"session": agent.session, "layout": layout_of(buffers, shape.block_size)}
    print(msgspec.json.encode(hello).decode(), flush=True)
    sys.stdin.read()
    agent.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--holder"]:
        _hold(json.loads(sys.argv[2]))
    else:
        sys.exit(main(sys.argv[1:]))
