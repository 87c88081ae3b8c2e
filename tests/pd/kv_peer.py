"""A prefill rank's KV, in its own process, for the KV transfer tests.

Allocates the KV like PaddleModelRunner (main layers + one shared-layer cache per MTP depth),
registers it with a KVTransferAgent, THEN fills blocks through the real write path
(KVCache.write, an in-place scatter), prints one JSON line {"session", "layout"} and serves reads
until stdin closes. A block's content is `block_values(seed, buffer, block, ...)`, so the reader can
recompute what it should have received.

    python kv_peer.py '{"layers": 2, "depths": 2, "num_blocks": 24, "block_size": 4, "kv_heads": 2,
                        "head_dim": 8, "fill_blocks": [1, 2, 5], "seed": 7}'
"""

from __future__ import annotations

import dataclasses
import sys

import msgspec
import numpy as np


@dataclasses.dataclass(frozen=True)
class PeerSpec:
    layers: int
    depths: int
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    fill_blocks: list[int]
    seed: int


def allocate(spec: PeerSpec):
    """(main KVCache, depth KVCaches), shaped as the model runner shapes them (2 MTP layers)."""
    from mtpserve.engine.model_runner import _depth_cache
    from mtpserve.model.kv_cache import KVCache

    kv_args = (spec.num_blocks, spec.block_size, spec.kv_heads, spec.head_dim)
    return KVCache.allocate(spec.layers, *kv_args), [_depth_cache(2, kv_args) for _ in range(spec.depths)]


def block_values(seed: int, buffer: int, block: int, block_size: int, kv_heads: int, head_dim: int) -> np.ndarray:
    """[block_size, KVH, D] float32: what block `block` of buffer `buffer` holds on the peer."""
    rng = np.random.default_rng([seed, buffer, block])
    return rng.standard_normal((block_size, kv_heads, head_dim), dtype=np.float32)


def fill(spec: PeerSpec, main, depths) -> None:
    """Write every fill block of every buffer with KVCache.write (the engine's KV write path)."""
    import paddle

    bs = spec.block_size
    slots = paddle.to_tensor(np.concatenate([np.arange(b * bs, (b + 1) * bs) for b in spec.fill_blocks]))
    caches = [(main, layer) for layer in range(spec.layers)] + [(d, 0) for d in depths]
    for i, (cache, layer) in enumerate(caches):
        k, v = (paddle.to_tensor(np.concatenate([block_values(spec.seed, 2 * i + kv, b, bs, spec.kv_heads,
                                                              spec.head_dim) for b in spec.fill_blocks]))
                for kv in (0, 1))
        cache.write(layer, slots, k, v)


def main(spec: PeerSpec) -> None:
    from mtpserve.pd.kv_layout import kv_buffers, layout_of, regions_of
    from mtpserve.pd.kv_transfer import KVTransferAgent

    main_kv, depths = allocate(spec)
    buffers = kv_buffers(main_kv, depths)
    agent = KVTransferAgent.start("127.0.0.1", "tcp", regions_of(buffers))
    layout = layout_of(buffers, spec.block_size)
    fill(spec, main_kv, depths)
    print(msgspec.json.encode({"session": agent.session, "layout": layout}).decode(), flush=True)
    sys.stdin.read()
    agent.close()


if __name__ == "__main__":
    main(msgspec.json.decode(sys.argv[1], type=PeerSpec))
