"""Which KV memory a rank exposes to PD reads, and the descriptors that copy blocks between two ranks.

Pure: no paddle import at module level (tensors arrive as arguments) and no Mooncake, so the HTTP
process may use `check_compatible` to refuse a foreign layout with a 400.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Sequence

import numpy as np

from mtpserve.ipc import request_channel as rc

if TYPE_CHECKING:
    import paddle

    from mtpserve.model.kv_cache import KVCache


class ReadDescriptors(NamedTuple):
    """One entry per contiguous copy; plain int lists, the form the transfer engine takes."""

    local_addrs: list[int]
    remote_addrs: list[int]
    lengths: list[int]  # bytes


def kv_buffers(main: KVCache, depths: Sequence[KVCache]) -> list[paddle.Tensor]:
    """The unique KV tensors in docs/pd.md order: layer 0 K, layer 0 V, ..., then depth 0 K, V, ...

    NOTE: a depth cache lists one K/V pair L times (model_runner._depth_cache); it is exposed once. A
    cache whose K tensor is also its V (MLA's latent cache, docs/models.md) exposes it once per layer."""
    buffers = [t for k, v in zip(main.k, main.v) for t in _pair(k, v)]
    for i, depth in enumerate(depths):
        buffers += _pair(_only_tensor(depth.k, f"MTP depth {i} K"), _only_tensor(depth.v, f"MTP depth {i} V"))
    return buffers


def _pair(k: paddle.Tensor, v: paddle.Tensor) -> list[paddle.Tensor]:
    return [k] if v is k else [k, v]


def _only_tensor(tensors: Sequence[paddle.Tensor], what: str) -> paddle.Tensor:
    if any(t is not tensors[0] for t in tensors):
        raise ValueError(f"{what}: PD expects one tensor shared by every MTP layer, found several")
    return tensors[0]


def layout_of(buffers: Sequence[paddle.Tensor], block_size: int) -> rc.KVLayout:
    """Where `buffers` live; each is [(num_blocks+1)*block_size, KVH, D], rows are token slots."""
    return rc.KVLayout(block_size=block_size, buffer_addrs=[t.data_ptr() for t in buffers],
                       block_bytes=[block_size * _row_bytes(t) for t in buffers])


def regions_of(buffers: Sequence[paddle.Tensor]) -> list[tuple[int, int]]:
    """(address, bytes) of each whole buffer, scratch block included: what the agent registers."""
    return [(t.data_ptr(), t.shape[0] * _row_bytes(t)) for t in buffers]


def _row_bytes(t: paddle.Tensor) -> int:
    return int(np.prod(t.shape[1:])) * t.element_size()


def check_compatible(local: rc.KVLayout, remote: rc.KVLayout) -> None:
    """Raise ValueError when blocks cannot be copied byte for byte (another model, dtype or block size)."""
    if len(local.buffer_addrs) != len(remote.buffer_addrs):
        raise ValueError(f"KV layouts differ: {len(remote.buffer_addrs)} remote buffers, "
                         f"{len(local.buffer_addrs)} local (another model or MTP depth)")
    if local.block_size != remote.block_size:
        raise ValueError(f"KV layouts differ: remote block_size {remote.block_size}, local {local.block_size}")
    if list(local.block_bytes) != list(remote.block_bytes):
        raise ValueError(f"KV layouts differ: remote block_bytes {remote.block_bytes}, "
                         f"local {local.block_bytes} (another model or KV dtype)")


def read_descriptors(local: rc.KVLayout, local_blocks: Sequence[int], remote: rc.KVLayout,
                     remote_blocks: Sequence[int]) -> ReadDescriptors:
    """Copies that bring remote block remote_blocks[j] into local block local_blocks[j], every buffer.

    A run of n list neighbours whose local AND remote ids both count up by one is one copy of
    n * block_bytes per buffer. Order: buffer-major, then runs in list order."""
    check_compatible(local, remote)
    local_ids, remote_ids = _block_ids(local_blocks, remote_blocks)
    starts, counts = _runs(local_ids, remote_ids)  # [R], [R]
    block_bytes = np.asarray(local.block_bytes, dtype=np.int64)[:, None]  # [B, 1]
    local_addrs = np.asarray(local.buffer_addrs, dtype=np.int64)[:, None] + local_ids[starts] * block_bytes
    remote_addrs = np.asarray(remote.buffer_addrs, dtype=np.int64)[:, None] + remote_ids[starts] * block_bytes
    lengths = np.broadcast_to(counts * block_bytes, local_addrs.shape)  # [B, R]
    return ReadDescriptors(local_addrs.ravel().tolist(), remote_addrs.ravel().tolist(), lengths.ravel().tolist())


def _block_ids(local_blocks: Sequence[int], remote_blocks: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    local_ids = np.asarray(local_blocks, dtype=np.int64).reshape(-1)
    remote_ids = np.asarray(remote_blocks, dtype=np.int64).reshape(-1)
    if local_ids.shape != remote_ids.shape:
        raise ValueError(f"{len(local_ids)} local blocks for {len(remote_ids)} remote blocks")
    if (local_ids < 0).any() or (remote_ids < 0).any():
        raise ValueError("block ids must be >= 0")
    return local_ids, remote_ids


def _runs(local_ids: np.ndarray, remote_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start index and length of each maximal run of both-consecutive neighbours."""
    follows = (np.diff(local_ids) == 1) & (np.diff(remote_ids) == 1)  # [N-1]: j+1 extends j's run
    starts = np.flatnonzero(np.concatenate([[len(local_ids) > 0], ~follows]))
    counts = np.diff(np.append(starts, len(local_ids)))
    return starts, counts
