"""One Qwen2 decoder block: pre-norm attention and a SwiGLU MLP, each with a residual."""

from __future__ import annotations

import paddle
from paddle import nn

from mtpserve.model.attention_context import AttentionContext
from mtpserve.model.config import ModelConfig
from mtpserve.model.norm import RMSNorm
from mtpserve.model.parallel import SINGLE, ColumnParallelLinear, RowParallelLinear, TensorParallel
from mtpserve.model.rotary import RotaryEmbedding


class Attention(nn.Layer):
    """Grouped-query self-attention with q/k/v bias; heads are split across tensor-parallel ranks."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        hidden, dim = config.hidden_size, config.head_dim
        self.num_heads = tp.split(config.num_attention_heads)
        self.num_kv_heads = tp.split(config.num_key_value_heads)
        self.head_dim = dim
        bias = config.attention_bias
        self.q_proj = ColumnParallelLinear(hidden, config.num_attention_heads * dim, bias, tp)
        self.k_proj = ColumnParallelLinear(hidden, config.num_key_value_heads * dim, bias, tp)
        self.v_proj = ColumnParallelLinear(hidden, config.num_key_value_heads * dim, bias, tp)
        self.o_proj = RowParallelLinear(config.num_attention_heads * dim, hidden, False, tp)

    def forward(self, x: paddle.Tensor, cos_sin: tuple[paddle.Tensor, paddle.Tensor],
                ctx: AttentionContext, layer: int) -> paddle.Tensor:
        """x: [T, H] -> [T, H]."""
        q = self.q_proj(x).reshape([-1, self.num_heads, self.head_dim])  # [T, heads, D]
        k = self.k_proj(x).reshape([-1, self.num_kv_heads, self.head_dim])  # [T, kv_heads, D]
        v = self.v_proj(x).reshape([-1, self.num_kv_heads, self.head_dim])  # [T, kv_heads, D]
        q, k = RotaryEmbedding.apply(q, *cos_sin), RotaryEmbedding.apply(k, *cos_sin)
        out = ctx.attend(layer, q, k, v)  # [T, heads, D]
        return self.o_proj(out.reshape([-1, self.num_heads * self.head_dim]))


class MLP(nn.Layer):
    """down(silu(gate(x)) * up(x)); gate/up are column-split, down is row-split."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = ColumnParallelLinear(hidden, inner, False, tp)
        self.up_proj = ColumnParallelLinear(hidden, inner, False, tp)
        self.down_proj = RowParallelLinear(inner, hidden, False, tp)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Layer):
    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    def forward(self, x: paddle.Tensor, cos_sin: tuple[paddle.Tensor, paddle.Tensor],
                ctx: AttentionContext, layer: int) -> paddle.Tensor:
        """x: [T, H] -> [T, H]."""
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, ctx, layer)
        return x + self.mlp(self.post_attention_layernorm(x))
