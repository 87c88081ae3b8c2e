"""The attention arithmetic shared by training and serving: masked softmax(QK^T)V over padded buffers."""

from __future__ import annotations

import math

import paddle

# NOTE: a large finite negative instead of -inf keeps fully masked rows (padding) finite rather than NaN.
MASKED = -1e30


def masked_attention(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor,
                     bias: paddle.Tensor) -> paddle.Tensor:
    """Grouped-query attention over padded buffers.

    q: [B, Q, H, D]; k, v: [B, K, KVH, D]; bias: [B, Q, K] additive (0 or MASKED), or the same already
    shaped [B, 1, 1, Q, K] by a caller that reuses it across layers -> [B, Q, H, D].
    Query head h reads KV head h // (H // KVH), as Hugging Face's repeat_kv does.
    """
    b, nq, heads, dim = q.shape
    nkv, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    qg = q.reshape([b, nq, kv_heads, group, dim]).transpose([0, 2, 3, 1, 4])  # [B, KVH, G, Q, D]
    qg = qg.reshape([b, kv_heads, group * nq, dim])
    kt = k.transpose([0, 2, 1, 3])  # [B, KVH, K, D]
    vt = v.transpose([0, 2, 1, 3])  # [B, KVH, K, D]
    scores = paddle.matmul(qg, kt, transpose_y=True) * (1.0 / math.sqrt(dim))  # [B, KVH, G*Q, K]
    scores = scores.reshape([b, kv_heads, group, nq, nkv]) + (bias if bias.ndim == 5 else bias.unsqueeze([1, 2]))
    if scores.dtype == paddle.float32:  # NOTE: skip two no-op casts: each is a dispatched op
        probs = paddle.nn.functional.softmax(scores, axis=-1)
    else:
        probs = paddle.nn.functional.softmax(scores.astype("float32"), axis=-1).astype(v.dtype)
    out = paddle.matmul(probs.reshape([b, kv_heads, group * nq, nkv]), vt)  # [B, KVH, G*Q, D]
    out = out.reshape([b, kv_heads, group, nq, dim]).transpose([0, 3, 1, 2, 4])  # [B, Q, KVH, G, D]
    return out.reshape([b, nq, heads, dim])


def mask_to_bias(allowed: paddle.Tensor) -> paddle.Tensor:
    """allowed: bool [B, Q, K] -> additive float32 bias."""
    return paddle.where(allowed, paddle.zeros([1], "float32"), paddle.full([1], MASKED, "float32"))
