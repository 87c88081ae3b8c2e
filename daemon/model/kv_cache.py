"""Paged KV cache: one K and one V tensor per layer, addressed by flat slot number."""

from __future__ import annotations

import dataclasses
import math

import paddle

from mtpserve.host_memory import advise_huge_pages


@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer K/V storage of `num_blocks` blocks of `block_size` token slots.

    NOTE: each tensor is stored flat as `[(num_blocks + 1) * block_size, num_kv_heads, head_dim]`; slot
    `block_id * block_size + offset` is row `block_id * block_size + offset`. The extra last block is a
    scratch sink: writes to slot -1 land there, so invalid tokens never need a branch or a host sync.
    The MTP layers get their own KVCache with the same `num_blocks`/`block_size`, addressed by the same
    block tables, so one block allocator serves both.
    """

    k: list[paddle.Tensor]  # each [(num_blocks+1)*block_size, KVH, D]
    v: list[paddle.Tensor]  # each [(num_blocks+1)*block_size, KVH, D]
    num_blocks: int
    block_size: int

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: str = "float32", shared_kv: bool = False) -> KVCache:
        """shared_kv: one tensor per layer serves as both K and V (MLA's latent cache: the values are
        the keys' first kv_lora_rank columns, model/mla.py)."""
        shape = [(num_blocks + 1) * block_size, num_kv_heads, head_dim]
        kind = getattr(paddle, dtype)  # "float32" -> paddle.float32
        k = [_zeros(shape, kind) for _ in range(num_layers)]
        v = list(k) if shared_kv else [_zeros(shape, kind) for _ in range(num_layers)]
        return cls(k=k, v=v, num_blocks=num_blocks, block_size=block_size)

    @property
    def scratch_slot(self) -> int:
        return self.num_blocks * self.block_size

    def write(self, layer: int, slots: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor) -> None:
        """Store this step's K/V. slots: [T] int64, already mapped so -1 became the scratch slot."""
        _scatter_rows(self.k[layer], slots, as_dtype(k, self.k[layer].dtype))
        if self.v[layer] is not self.k[layer]:  # NOTE: a shared (MLA latent) cache is written once
            _scatter_rows(self.v[layer], slots, as_dtype(v, self.v[layer].dtype))

    def copy_blocks(self, src_rows: paddle.Tensor, dst_rows: paddle.Tensor) -> None:
        """Copy the token rows `src_rows` [N] int64 onto `dst_rows` [N] in every layer; all reads happen
        before any write (a destination may be another copy's source)."""
        unique = {id(t): t for t in (*self.k, *self.v)}  # NOTE: MTP depth caches repeat one tensor
        for t in unique.values():
            _scatter_rows(t, dst_rows, _gather_rows(t, src_rows))

    def gather(self, layer: int, flat_slots: paddle.Tensor,
               key_shape: list[int]) -> tuple[paddle.Tensor, paddle.Tensor]:
        """flat_slots: [B*K] int64, key_shape: [B, K] -> K, V: [B, K, KVH, D].

        The slots come flat (flattened once per step by the caller, not once per layer)."""
        shape = [*key_shape, *self.k[layer].shape[1:]]
        k = _gather_rows(self.k[layer], flat_slots).reshape(shape)
        v = _gather_rows(self.v[layer], flat_slots).reshape(shape)
        return k, v


def _zeros(shape: list[int], dtype: paddle.dtype) -> paddle.Tensor:
    """A zeroed cache tensor; in host memory, in huge pages where the kernel gives them (host_memory.py)."""
    t = paddle.empty(shape, dtype=dtype)
    if t.place.is_cpu_place():
        advise_huge_pages(t.data_ptr(), math.prod(shape) * t.element_size())
    return t.zero_()


def _bits(x: paddle.Tensor) -> paddle.Tensor:
    """A 2-byte float tensor as int32 pairs over the same memory; other dtypes as they are.

    NOTE: Paddle's CPU gather and scatter have no float16 kernels; moving a cache row's bits as int32
    is the same copy, exact, on any host (a row's last dimension, the head size, is even)."""
    return x.view(paddle.int32) if x.dtype in (paddle.float16, paddle.bfloat16) else x


def _scatter_rows(cache: paddle.Tensor, rows: paddle.Tensor, values: paddle.Tensor) -> None:
    paddle.scatter_(_bits(cache), rows, _bits(values), overwrite=True)


def _gather_rows(cache: paddle.Tensor, rows: paddle.Tensor) -> paddle.Tensor:
    out = paddle.gather(_bits(cache), rows)
    return out if out.dtype == cache.dtype else out.view(cache.dtype)


def as_dtype(x: paddle.Tensor, dtype) -> paddle.Tensor:
    """x in `dtype`, without a copy (or an op) when it already is."""
    return x if x.dtype == dtype else x.astype(dtype)
