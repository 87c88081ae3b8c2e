"""One Qwen2 decoder block: pre-norm attention and a SwiGLU MLP, each with a residual.

The checkpoint keeps q/k/v and gate/up as separate tensors (the MiMo/HF layout, split per rank by the
loader). A forward runs each group as one matmul over their concatenation: at serving sizes on CPU the
per-op dispatch, not the arithmetic, is the cost. In eval mode the concatenation is built once by
`fuse()` (from this rank's shards, so under tensor parallelism it is the concat of this rank's q, k and
v slices); in training it is rebuilt every forward so gradients reach the separate parameters.
"""

from __future__ import annotations

from typing import Self

import paddle
from paddle import nn

from mtpserve.model.attention_context import AttentionContext
from mtpserve.model.config import ModelConfig
from mtpserve.model.deepseek_config import DeepseekV3Config
from mtpserve.model.ernie_config import ErnieMoeConfig
from mtpserve.model.norm import RMSNorm
from mtpserve.model.parallel import (SINGLE, ColumnParallelLinear, RowParallelLinear, ServingWeight,
                                     TensorParallel)
from mtpserve.model.rotary import RotaryEmbedding


class FusedColumns:
    """The row-concatenation of column-parallel linears' weights (and biases): one matmul for all."""

    def __init__(self, parts: list[ColumnParallelLinear]):
        self.parts = parts
        self.serving = ServingWeight()
        self.bias: paddle.Tensor | None = None

    def freeze(self) -> None:
        """Build the concatenation once ([in, sum(out)]); call again whenever the weights change."""
        with paddle.no_grad():
            weight, self.bias = self._concat()
        self.serving.freeze(weight)

    def thaw(self) -> None:
        self.serving.thaw()
        self.bias = None

    def __call__(self, x: paddle.Tensor) -> paddle.Tensor:
        if self.serving.t is not None:
            weight, bias = None, self.bias
        else:
            weight, bias = self._concat()
        return self.serving.matmul(x, weight, bias)  # [T, sum(out)]

    def _concat(self) -> tuple[paddle.Tensor, paddle.Tensor | None]:
        weight = paddle.concat([p.weight for p in self.parts], axis=0)  # [sum(out), in]
        biases = [p.bias for p in self.parts]
        if any(b is None for b in biases):  # NOTE: the parts of one group all have a bias, or none does
            return weight, None
        return weight, paddle.concat([b for b in biases if b is not None], axis=0)


class Attention(nn.Layer):
    """Grouped-query self-attention with q/k/v bias; heads are split across tensor-parallel ranks."""

    def __init__(self, config: ModelConfig | ErnieMoeConfig, tp: TensorParallel = SINGLE,
                 interleaved_rope: bool = False, o_bias: bool = False):
        """interleaved_rope: rope rotates pairs (x0, x1), (x2, x3), ... (ERNIE) instead of halves (Qwen2)."""
        super().__init__()
        hidden, dim = config.hidden_size, config.head_dim
        self.interleaved_rope = interleaved_rope
        self.num_heads = tp.split(config.num_attention_heads)
        self.num_kv_heads = tp.split(config.num_key_value_heads)
        self.head_dim = dim
        bias = config.attention_bias
        self.q_proj = ColumnParallelLinear(hidden, config.num_attention_heads * dim, bias, tp)
        self.k_proj = ColumnParallelLinear(hidden, config.num_key_value_heads * dim, bias, tp)
        self.v_proj = ColumnParallelLinear(hidden, config.num_key_value_heads * dim, bias, tp)
        self.o_proj = RowParallelLinear(config.num_attention_heads * dim, hidden, o_bias, tp)
        self.qkv = FusedColumns([self.q_proj, self.k_proj, self.v_proj])

    def forward(self, x: paddle.Tensor, cos_sin: tuple[paddle.Tensor, paddle.Tensor],
                ctx: AttentionContext, layer: int) -> paddle.Tensor:
        """x: [T, H] -> [T, H]."""
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv(x).reshape([-1, heads + 2 * kv_heads, self.head_dim])  # [T, heads+2*kv, D]
        qk, v = paddle.split(qkv, [heads + kv_heads, kv_heads], axis=1)
        if self.interleaved_rope:
            # NOTE: evens then odds makes the pairwise rotation a "rotate half" one; q and k are permuted
            # alike, so their dot products are unchanged (the cache keeps the permuted keys).
            qk = qk.reshape([-1, heads + kv_heads, self.head_dim // 2, 2]).transpose([0, 1, 3, 2]).reshape(
                [-1, heads + kv_heads, self.head_dim])
        # NOTE: q and k are rotated together: one RoPE over heads+kv_heads instead of two.
        q, k = paddle.split(RotaryEmbedding.apply(qk, *cos_sin), [heads, kv_heads], axis=1)
        out = ctx.attend(layer, q, k, v)  # [T, heads, D]
        return self.o_proj(out.reshape([-1, heads * self.head_dim]))


class MLP(nn.Layer):
    """down(silu(gate(x)) * up(x)); gate/up are column-split, down is row-split."""

    def __init__(self, config: ModelConfig | DeepseekV3Config | ErnieMoeConfig, tp: TensorParallel = SINGLE,
                 intermediate_size: int | None = None, reduce_output: bool = True):
        """reduce_output=False: under tensor parallelism each rank returns its partial sum (MoE experts)."""
        super().__init__()
        hidden, inner = config.hidden_size, intermediate_size or config.intermediate_size
        self.gate_proj = ColumnParallelLinear(hidden, inner, False, tp)
        self.up_proj = ColumnParallelLinear(hidden, inner, False, tp)
        self.down_proj = RowParallelLinear(inner, hidden, False, tp, reduce=reduce_output)
        self.gate_up = FusedColumns([self.gate_proj, self.up_proj])

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        # swiglu splits its input in half: silu(first half) * second half.
        return self.down_proj(nn.functional.swiglu(self.gate_up(x)))  # [T, 2I] -> [T, I] -> [T, H]


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


def serving_weights(layer: nn.Layer) -> list:
    """Everything under `layer` that keeps an eval-mode copy of its weights (`freeze()`/`thaw()`):
    the fused groups and the row-parallel, replicated and head projections."""
    found = []
    for sub in layer.sublayers(include_self=True):
        if isinstance(sub, Attention):
            found.append(sub.qkv)
        elif isinstance(sub, MLP):
            found.append(sub.gate_up)
        elif hasattr(sub, "freeze"):
            found.append(sub)
    return found


class ServingModelLayer(nn.Layer):
    """A model class whose eval mode serves from weight copies built when it enters it (fused q/k/v and
    gate/up, every projection transposed to [in, out]): call `eval()` again (or `train()`) after changing
    any weight. The families' model classes share it."""

    def eval(self) -> Self:
        super().eval()
        for group in self._serving_weights():
            group.freeze()
        return self

    def train(self, mode: bool = True) -> Self:
        if not mode:
            return self.eval()
        super().train()
        for group in self._serving_weights():
            group.thaw()
        return self

    def set_draft_vocab(self, token_ids) -> None:
        """A restricted draft vocabulary; only families that support one override this."""
        if token_ids is not None:
            raise ValueError(f"draft_vocab.json is not supported for {type(self).__name__}")

    def set_draft_weight_dtype(self, dtype: str) -> None:
        """The dtype of the packed panels of the weights that only draft (the MTP layers and the draft
        head), re-packed now in eval mode. float16 halves what a draft depth reads; verification by the
        main model decides every emitted token, so it can change acceptance, never the output. Families
        that do not list their draft weights keep float32."""
        for weight in self._draft_weights():
            weight.panel_dtype = dtype
        if not self.training:
            self.eval()

    def _draft_weights(self) -> list[ServingWeight]:
        return []

    def _serving_weights(self) -> list:
        return serving_weights(self)
