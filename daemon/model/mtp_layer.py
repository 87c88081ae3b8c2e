"""One MTP layer in the MiMo checkpoint layout (`model.mtp_layers.{i}`).

It predicts one token further ahead: at position t it combines the previous depth's hidden state at t
(the main model's pre-final-norm hidden for the first layer) with the embedding of token t+1, runs one
decoder block, and its `final_layernorm` output goes to the shared LM head to predict token t+2.

In eval mode the token half of `input_proj` is tabulated: token_layernorm is row-wise, so
token_layernorm(embedding) @ W_token^T is one [V, H] table built by `freeze()`, and a step looks its
rows up instead of normalising, concatenating and projecting them (drafting cost; the table differs
from the step-by-step arithmetic only in float summation order, which can change a draft, never the
verified output).
"""

from __future__ import annotations

import paddle
from paddle import nn

from mtpserve.model.attention_context import AttentionContext
from mtpserve.model.config import ModelConfig
from mtpserve.model.decoder_layer import MLP, Attention
from mtpserve.model.norm import RMSNorm
from mtpserve.model.parallel import (SINGLE, ReplicatedLinear, ServingWeight, TensorParallel,
                                     VocabParallelEmbedding)


class TokenTable:
    """Eval-mode copies: token_layernorm(E) @ W_token^T for this rank's vocabulary rows [V/tp, H], and
    the hidden half of input_proj as a serving weight."""

    def __init__(self) -> None:
        self.table: paddle.Tensor | None = None
        self.hidden = ServingWeight()

    def freeze(self, layer: MTPLayer, embedding: VocabParallelEmbedding) -> None:
        with paddle.no_grad():
            hidden = embedding.weight.shape[1]
            weight = layer.input_proj.weight  # [H, 2H]: columns 0..H-1 read prev_hidden, H..2H-1 the token
            self.hidden.freeze(weight[:, :hidden])
            self.table = paddle.matmul(layer.token_layernorm(embedding.weight), weight[:, hidden:],
                                       transpose_y=True)

    def thaw(self) -> None:
        self.table = None
        self.hidden.thaw()


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
        self.tokens = TokenTable()

    def forward(self, token_ids: paddle.Tensor, embedding: VocabParallelEmbedding, prev_hidden: paddle.Tensor,
                cos_sin: tuple[paddle.Tensor, paddle.Tensor], ctx: AttentionContext,
                layer: int, out_rows: paddle.Tensor | None = None,
                keep_token: paddle.Tensor | None = None) -> paddle.Tensor:
        """token_ids: [T], prev_hidden: [T, H] -> this depth's hidden [T, H] (before final_layernorm).

        out_rows: [N] if only those rows' outputs are wanted -> [N, H]; every row's KV is still written,
        but the MLP runs on the N rows only. keep_token: [T, 1], 0 where the token embedding is zeroed
        (position 0 under `mtp_zero_position_zero`).
        """
        x = self.project_inputs(token_ids, embedding, prev_hidden, keep_token)  # [T, H]
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, ctx, layer)
        if out_rows is not None:
            x = paddle.gather(x, out_rows)  # [N, H]
        return x + self.mlp(self.post_attention_layernorm(x))

    def project_inputs(self, token_ids: paddle.Tensor, embedding: VocabParallelEmbedding,
                        prev_hidden: paddle.Tensor, keep_token: paddle.Tensor | None) -> paddle.Tensor:
        """input_proj(concat[hidden_layernorm(prev_hidden), token_layernorm(embed(token_ids))]) -> [T, H].

        NOTE: a zeroed embedding normalises to zero (RMSNorm of 0 is 0), so zeroing the token half's
        projection is the same as zeroing the embedding."""
        if self.tokens.table is not None:
            token_part = embedding.lookup(token_ids, self.tokens.table)  # [T, H]
            if keep_token is not None:
                token_part = token_part * keep_token
            return self.tokens.hidden.matmul(self.hidden_layernorm(prev_hidden), None) + token_part
        emb = embedding(token_ids)
        if keep_token is not None:
            emb = emb * keep_token
        joined = paddle.concat([self.hidden_layernorm(prev_hidden), self.token_layernorm(emb)],
                               axis=-1)  # [T, 2H]
        return self.input_proj(joined)
