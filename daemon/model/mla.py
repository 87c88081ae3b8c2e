"""DeepSeek-V3's multi-head latent attention (MLA) over a latent paged cache, with the weights absorbed.

The cache holds one row per token: the compressed KV `c = kv_a_layernorm(kv_a_proj(x)[:r])` (r =
kv_lora_rank) beside the rotated rope key `k_pe` (qk_rope_head_dim), [r + rope] wide, as a single KV
"head" that every query head reads (model/kv_cache.py `shared_kv`: one tensor is both K and V).
The expanded per-head keys and values are never built. Instead kv_b_proj [H*(nope+v), r] is split
per head into W_UK [H, nope, r] and W_UV [H, v, r] and absorbed:

    score(t, j) = q_nope_t . (W_UK c_j) + q_pe_t . k_pe_j = (W_UK^T q_nope_t) . c_j + q_pe_t . k_pe_j
    out_t       = W_UV (sum_j p_tj c_j)

so a query becomes [W_UK^T q_nope, q_pe] (r + rope wide) against the cached rows, and the attention
output's first r columns are the weighted latent, which W_UV maps to the head's value. The attention
kernels scale scores by 1/sqrt(r + rope); the query is pre-scaled so the product is MLA's own
softmax scale (qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2).

Rope: DeepSeek's rope dimensions are interleaved pairs (x0, x1), (x2, x3), ...; with
`rope_interleave` they are first laid out as (x0, x2, ..., x1, x3, ...), which turns the pairwise
rotation into the "rotate half" form the rotary tables serve. Queries and cached keys are in that
same order, so the dot products are unchanged.
"""

from __future__ import annotations

import math

import paddle
from paddle import nn

from mtpserve.model.attention_context import AttentionContext
from mtpserve.model.decoder_layer import FusedColumns
from mtpserve.model.deepseek_config import DeepseekV3Config
from mtpserve.model.norm import RMSNorm
from mtpserve.model.parallel import (SINGLE, ColumnParallelLinear, ReplicatedLinear, RowParallelLinear,
                                     TensorParallel)
from mtpserve.model.rotary import RotaryEmbedding

# NOTE: the low-rank norms take RMSNorm's default eps in DeepSeek's reference and in transformers,
# not config.rms_norm_eps (the same 1e-6 in the released configs).
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Layer):
    def __init__(self, config: DeepseekV3Config, tp: TensorParallel = SINGLE):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.num_heads = tp.split(heads)
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.rank = config.kv_lora_rank
        self.interleaved = config.rope_interleave
        # NOTE: the kernels scale by 1/sqrt(cache width); this restores MLA's softmax scale.
        self.q_scale = config.softmax_scale * math.sqrt(self.rank + self.rope)
        qk = config.qk_head_dim
        if config.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk, False, tp)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, config.q_lora_rank)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, heads * qk, False, tp)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.rank + self.rope)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.rank, heads * (self.nope + self.v_dim), False, tp)
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, False, tp)
        # NOTE: the query up-projection's serving copy ([in, out], and CPU panels), like q/k/v's in Qwen2
        self.q_up = FusedColumns([self.q_proj if config.q_lora_rank is None else self.q_b_proj])
        self.absorbed: tuple[paddle.Tensor, paddle.Tensor] | None = None

    def freeze(self) -> None:
        """Eval mode: keep W_UK [h, nope, r] and W_UV^T [h, r, v] for this rank's heads, and the query
        up-projection's serving copy."""
        with paddle.no_grad():
            self.absorbed = self._absorbed()
        self.q_up.freeze()

    def thaw(self) -> None:
        self.absorbed = None
        self.q_up.thaw()

    def _absorbed(self) -> tuple[paddle.Tensor, paddle.Tensor]:
        w = self.kv_b_proj.weight.reshape([self.num_heads, self.nope + self.v_dim, self.rank])
        w_uk, w_uv = paddle.split(w, [self.nope, self.v_dim], axis=1)  # [h, nope, r], [h, v, r]
        return w_uk, w_uv.transpose([0, 2, 1])

    def forward(self, x: paddle.Tensor, cos_sin: tuple[paddle.Tensor, paddle.Tensor],
                ctx: AttentionContext, layer: int) -> paddle.Tensor:
        """x: [T, H] -> [T, H]; writes this layer's latent row of every token."""
        w_uk, w_uv_t = self.absorbed or self._absorbed()
        q = self._queries(x).reshape([-1, self.num_heads, self.nope + self.rope])  # [T, h, nope+rope]
        q_nope, q_pe = paddle.split(q, [self.nope, self.rope], axis=-1)
        latent, k_pe = paddle.split(self.kv_a_proj_with_mqa(x), [self.rank, self.rope], axis=-1)
        q_pe = RotaryEmbedding.apply(self._pairs_to_halves(q_pe), *cos_sin)  # [T, h, rope]
        k_pe = RotaryEmbedding.apply(self._pairs_to_halves(k_pe.unsqueeze(1)), *cos_sin)  # [T, 1, rope]
        q_lat = paddle.matmul(q_nope.transpose([1, 0, 2]), w_uk).transpose([1, 0, 2])  # [T, h, r]
        query = paddle.concat([q_lat, q_pe], axis=-1) * self.q_scale  # [T, h, r+rope]
        row = paddle.concat([self.kv_a_layernorm(latent).unsqueeze(1), k_pe], axis=-1)  # [T, 1, r+rope]
        out = ctx.attend(layer, query, row, row)  # [T, h, r+rope]
        o_lat = out[:, :, :self.rank].transpose([1, 0, 2])  # [h, T, r]
        o = paddle.matmul(o_lat, w_uv_t).transpose([1, 0, 2])  # [T, h, v]
        return self.o_proj(o.reshape([-1, self.num_heads * self.v_dim]))

    def _queries(self, x: paddle.Tensor) -> paddle.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_up(x)
        return self.q_up(self.q_a_layernorm(self.q_a_proj(x)))

    def _pairs_to_halves(self, x: paddle.Tensor) -> paddle.Tensor:
        """[T, n, rope] interleaved pairs -> evens then odds (a no-op without rope_interleave)."""
        if not self.interleaved:
            return x
        t, n, d = x.shape
        return x.reshape([t, n, d // 2, 2]).transpose([0, 1, 3, 2]).reshape([t, n, d])
