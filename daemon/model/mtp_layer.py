"""One MTP layer in the MiMo checkpoint layout (`model.mtp_layers.{i}`).

It predicts one token further ahead: at position t it combines the previous depth's hidden state at t
(the main model's pre-final-norm hidden for the first layer) with the embedding of token t+1, runs one
decoder block, and its `final_layernorm` output goes to the shared LM head to predict token t+2.
"""

from __future__ import annotations

import paddle
from paddle import nn

from mtpserve.model.attention_context import AttentionContext
from mtpserve.model.config import ModelConfig
from mtpserve.model.decoder_layer import MLP, Attention
from mtpserve.model.norm import RMSNorm
from mtpserve.model.parallel import SINGLE, ReplicatedLinear, TensorParallel


class MTPLayer(nn.Layer):
    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.token_layernorm = RMSNorm(hidden, eps)
        self.hidden_layernorm = RMSNorm(hidden, eps)
        # NOTE: replicated, not split: it is small, and its input is the full concatenated width.
        self.input_proj = ReplicatedLinear(2 * hidden, hidden)  # weight [H, 2H]
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(config, tp)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(config, tp)
        self.final_layernorm = RMSNorm(hidden, eps)

    def forward(self, token_embeds: paddle.Tensor, prev_hidden: paddle.Tensor,
                cos_sin: tuple[paddle.Tensor, paddle.Tensor], ctx: AttentionContext,
                layer: int, out_rows: paddle.Tensor | None = None) -> paddle.Tensor:
        """token_embeds, prev_hidden: [T, H] -> this depth's hidden [T, H] (before final_layernorm).

        out_rows: [N] if only those rows' outputs are wanted -> [N, H]; every row's KV is still written,
        but the MLP runs on the N rows only.
        """
        joined = paddle.concat([self.hidden_layernorm(prev_hidden), self.token_layernorm(token_embeds)],
                               axis=-1)  # [T, 2H]
        x = self.input_proj(joined)  # [T, H]
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, ctx, layer)
        if out_rows is not None:
            x = paddle.gather(x, out_rows)  # [N, H]
        return x + self.mlp(self.post_attention_layernorm(x))
