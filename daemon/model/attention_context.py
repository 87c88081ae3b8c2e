"""Where attention reads its keys from: a dense causal window (training) or the paged KV cache (serving).

Both implement `attend(layer, q, k, v) -> out` on flat tokens (q: [T, H, D], k/v: [T, KVH, D]), so the
decoder layers are the same modules and parameter names in training and in serving.
"""

from __future__ import annotations

import functools
from typing import Protocol

import paddle
from paddle import _C_ops

from mtpserve.model.attention_core import mask_to_bias, masked_attention
from mtpserve.model.forward_batch import ForwardBatch
from mtpserve.model.kv_cache import KVCache, as_dtype
from mtpserve.ops import cpu_op_available


PAGED_OP = "mtp_paged_attention"


def paged_op_serves(kv: KVCache) -> bool:
    """The in-place CPU kernel is built, Paddle runs on the CPU, and the cache is float32 or float16."""
    return kv.k[0].dtype in (paddle.float32, paddle.float16) and cpu_op_available(PAGED_OP) if kv.k else False


class AttentionContext(Protocol):
    def attend(self, layer: int, q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor) -> paddle.Tensor:
        ...


class DenseCausalContext:
    """B sequences of S tokens each, flattened to T = B*S; token i attends to tokens 0..i of its row."""

    def __init__(self, batch_size: int, seq_len: int):
        self.shape = [batch_size, seq_len]
        allowed = paddle.tril(paddle.ones([seq_len, seq_len], dtype="bool"))  # [S, S]
        self.bias = mask_to_bias(allowed).unsqueeze(0)  # [1, S, S]

    def attend(self, layer: int, q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor) -> paddle.Tensor:
        b, s = self.shape
        out = masked_attention(q.reshape([b, s, *q.shape[1:]]), k.reshape([b, s, *k.shape[1:]]),
                               v.reshape([b, s, *v.shape[1:]]), self.bias.expand([b, s, s]))
        return out.reshape(q.shape)


class PagedContext:
    """Attention of each request's new tokens over its cached prefix plus themselves, through the KV cache.

    Built once per forward; every layer reuses the index tensors:
      1. `token_rows` [T]: where each flat token sits in the padded [B * max_q] query buffer;
      2. `kv_slots` [B*K] (flat; `key_shape` is [B, K]): the cache row of every key position 0..K-1 of every request
         (K = max_blocks_per_seq * block_size; unused table entries point at the scratch block);
      3. `bias` [B, 1, 1, max_q, K] (shaped for the grouped scores once, not per layer): key j is visible to a query at position p iff j <= p and j < seq_len_kv
         (and j >= its request's key start, where the batch has them).
    """

    def __init__(self, batch: ForwardBatch, kv: KVCache):
        self.kv = kv
        self.batch = batch
        # NOTE: CPU hosts read the cache in place (ops_ext/paged_attention.cc); nothing below is needed.
        self.in_place = paged_op_serves(kv)
        if self.in_place:
            return
        self.num_seqs, self.max_q = batch.num_seqs, batch.max_q_len
        # NOTE: host ints: when every request has max_q tokens (uniform decode/verify windows), the
        # padded query buffer is the flat token order itself and padding/unpadding can be skipped.
        self.dense = batch.num_tokens == self.num_seqs * self.max_q
        self.token_rows = None if self.dense else _token_rows(batch.cu_seqlens_q.astype("int64"),
                                                              batch.num_tokens, self.max_q)
        kv_slots = _kv_slots(batch.block_tables.astype("int64"), kv.block_size, kv.scratch_slot)
        self.key_shape = kv_slots.shape  # [B, K]
        self.kv_slots = kv_slots.flatten()  # [B*K]
        positions = self._pad_queries(batch.positions).reshape([self.num_seqs, self.max_q])  # [B, max_q]
        self.bias = _paged_bias(positions, batch.seq_lens_kv, kv_slots.shape[1], batch.key_starts).unsqueeze([1, 2])

    @functools.cached_property
    def write_slots(self) -> paddle.Tensor:
        """[T] the cache row of each token's K/V, -1 mapped to the scratch slot. Built on first use: a
        CPU host's fused blocks (model/fused_layer.py) skip -1 themselves and never need it."""
        return _safe_slots(self.batch.slot_mapping.astype("int64"), self.kv.scratch_slot)

    def attend(self, layer: int, q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor) -> paddle.Tensor:
        self.kv.write(layer, self.write_slots, k, v)
        if self.in_place:
            b = self.batch
            out = _C_ops._run_custom_op(  # pyright: ignore[reportAttributeAccessIssue]
                PAGED_OP, as_dtype(q, paddle.float32), self.kv.k[layer], self.kv.v[layer], b.block_tables,
                b.cu_seqlens_q, b.seq_lens_kv, b.positions, b.key_starts, self.kv.block_size)
            return as_dtype(out[0], q.dtype)  # [T, H, D]
        k_all, v_all = self.kv.gather(layer, self.kv_slots, self.key_shape)  # [B, K, KVH, D]
        q_pad = self._pad_queries(q).reshape([self.num_seqs, self.max_q, *q.shape[1:]])
        out = masked_attention(q_pad, as_dtype(k_all, q.dtype), as_dtype(v_all, q.dtype), self.bias)
        out = out.reshape([-1, *q.shape[1:]])  # [B * max_q, H, D]
        if self.token_rows is None:  # dense: every request has max_q queries
            return out
        return paddle.gather(out, self.token_rows)  # [T, H, D]

    def _pad_queries(self, x: paddle.Tensor) -> paddle.Tensor:
        """x: [T, ...] -> [B * max_q, ...], zeros where a request has fewer tokens than max_q."""
        if self.token_rows is None:
            return x
        buf = paddle.zeros([self.num_seqs * self.max_q, *x.shape[1:]], dtype=x.dtype)
        return paddle.scatter(buf, self.token_rows, x, overwrite=True)


def _safe_slots(slots: paddle.Tensor, scratch: int) -> paddle.Tensor:
    return paddle.where(slots < 0, paddle.full_like(slots, scratch), slots)


def _token_rows(cu_seqlens_q: paddle.Tensor, num_tokens: int, max_q: int) -> paddle.Tensor:
    token = paddle.arange(num_tokens, dtype="int64")  # [T]
    seq = paddle.searchsorted(cu_seqlens_q[1:], token, right=True)  # [T]
    return seq * max_q + (token - paddle.gather(cu_seqlens_q, seq))


def _kv_slots(block_tables: paddle.Tensor, block_size: int, scratch: int) -> paddle.Tensor:
    blocks = _safe_slots(block_tables, scratch // block_size)  # [B, M]
    offsets = paddle.arange(block_size, dtype="int64")  # [bs]
    slots = blocks.unsqueeze(-1) * block_size + offsets  # [B, M, bs]
    return slots.reshape([block_tables.shape[0], -1])  # [B, M*bs]


def _paged_bias(positions: paddle.Tensor, seq_lens_kv: paddle.Tensor, num_keys: int,
                key_starts: paddle.Tensor | None = None) -> paddle.Tensor:
    keys = paddle.arange(num_keys, dtype="int64").reshape([1, 1, -1])  # [1, 1, K]
    causal = keys <= positions.unsqueeze(-1)  # [B, max_q, K]
    cached = keys < seq_lens_kv.astype("int64").reshape([-1, 1, 1])  # [B, 1, K]
    if key_starts is not None:
        cached = cached & (keys >= key_starts.astype("int64").reshape([-1, 1, 1]))
    return mask_to_bias(causal & cached)
