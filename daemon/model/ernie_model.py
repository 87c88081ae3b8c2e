"""ERNIE-4.5 MoE (`Ernie4_5_MoeForCausalLM`) with its MTP block, in the Hugging Face ("-PT") release's names.

    model.embed_tokens, model.norm, lm_head (absent when tie_word_embeddings)
    model.layers.{i}     input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp: dense
                         gate/up/down_proj, or for MoE layers (model/ernie_config.py `is_moe_layer`)
                         mlp.gate.weight [E, H], mlp.moe_statics.e_score_correction_bias [1, E],
                         mlp.experts.{e}.*, mlp.shared_experts.*
    model.mtp_emb_norm.{j}, model.mtp_hidden_norm.{j}, model.mtp_linear_proj.{j} [H, 2H],
    model.mtp_block.{j}.*   MTP module j: one decoder block (dense: it is block 0 of its own stack,
                            below moe_layer_start_index, as FastDeploy builds it)

Attention is grouped-query attention without biases; its rope rotates consecutive pairs. Routing: softmax
over the gate's logits (float32), the top moe_k of (probabilities + correction bias), weighted by
their probabilities divided by max(their sum, moe_norm_min); shared experts are added.

MTP module j at position t (FastDeploy's ernie4_5_mtp): h = mtp_linear_proj([mtp_emb_norm(embed(token
t+j+1)); mtp_hidden_norm(prev_t)]), then the block, then model.norm; the normed h feeds the shared
lm_head and is the next depth's prev. Depth 1's prev is the main model's hidden after model.norm.
"""

from __future__ import annotations

import numpy as np
import paddle
from paddle import nn

from mtpserve.model.attention_context import AttentionContext, PagedContext
from mtpserve.model.decoder_layer import MLP, Attention, ServingModelLayer
from mtpserve.model.ernie_config import ErnieMoeConfig
from mtpserve.model.forward_batch import ForwardBatch
from mtpserve.model.kv_cache import KVCache
from mtpserve.model.mimo_model import ComposedStep, ModelOutput, MTPOutput
from mtpserve.model.moe import routed_sum
from mtpserve.model.norm import RMSNorm
from mtpserve.model.parallel import SINGLE, ParallelLMHead, ReplicatedLinear, TensorParallel, VocabParallelEmbedding, _weight
from mtpserve.model.rotary import RotaryEmbedding


class ErnieRouter(nn.Layer):
    """`mlp.gate`: weight [E, H]."""

    def __init__(self, config: ErnieMoeConfig):
        super().__init__()
        self.weight = _weight(self, [config.moe_num_experts, config.hidden_size])
        self.shard_axes = {"weight": None}


class MoeStatics(nn.Layer):
    """`mlp.moe_statics`: the correction bias [1, E] (it selects experts, never weighs them)."""

    def __init__(self, config: ErnieMoeConfig):
        super().__init__()
        self.e_score_correction_bias = self.create_parameter(
            shape=[1, config.moe_num_experts], dtype="float32", default_initializer=nn.initializer.Constant(0.0))
        self.shard_axes = {"e_score_correction_bias": None}


class ErnieMoE(nn.Layer):
    def __init__(self, config: ErnieMoeConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.config, self.tp = config, tp
        self.gate = ErnieRouter(config)
        self.moe_statics = MoeStatics(config)
        inner = config.moe_intermediate_size
        # NOTE: tensor-parallel inside each expert, one all-reduce per layer (model/moe.py MoE)
        self.experts = nn.LayerList([MLP(config, tp, inner, reduce_output=False) for _ in range(config.moe_num_experts)])
        shared = config.moe_num_shared_experts
        self.shared_experts = MLP(config, tp, inner * shared, reduce_output=False) if shared else None

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        """x: [T, H] -> [T, H]."""
        logits = paddle.matmul(x.astype("float32"), self.gate.weight, transpose_y=True)  # [T, E]
        probs = nn.functional.softmax(logits, axis=-1)
        ids = paddle.topk(probs + self.moe_statics.e_score_correction_bias, self.config.moe_k, axis=-1)[1]  # [T, K]
        weights = paddle.take_along_axis(probs, ids, axis=1)
        weights = weights / paddle.clip(weights.sum(axis=-1, keepdim=True), min=self.config.moe_norm_min)
        routed = routed_sum(self.experts, x, ids, weights)
        return self.tp.all_reduce(routed + self.shared_experts(x) if self.shared_experts is not None else routed)


class ErnieDecoderLayer(nn.Layer):
    def __init__(self, config: ErnieMoeConfig, index: int, tp: TensorParallel = SINGLE):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(config, tp, interleaved_rope=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = ErnieMoE(config, tp) if config.is_moe_layer(index) else MLP(config, tp)

    def forward(self, x: paddle.Tensor, cos_sin: tuple[paddle.Tensor, paddle.Tensor], ctx: AttentionContext,
                layer: int, out_rows: paddle.Tensor | None = None) -> paddle.Tensor:
        """x: [T, H] -> [T, H] (or [N, H]: only `out_rows` go through the MLP; every row's KV is written)."""
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, ctx, layer)
        if out_rows is not None:
            x = paddle.gather(x, out_rows)
        return x + self.mlp(self.post_attention_layernorm(x))


class ErnieBody(nn.Layer):
    def __init__(self, config: ErnieMoeConfig, tp: TensorParallel):
        super().__init__()
        hidden, eps, n = config.hidden_size, config.rms_norm_eps, config.num_nextn_predict_layers
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, tp)
        self.layers = nn.LayerList([ErnieDecoderLayer(config, i, tp) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(hidden, eps)
        self.mtp_emb_norm = nn.LayerList([RMSNorm(hidden, eps) for _ in range(n)])
        self.mtp_hidden_norm = nn.LayerList([RMSNorm(hidden, eps) for _ in range(n)])
        self.mtp_linear_proj = nn.LayerList([ReplicatedLinear(2 * hidden, hidden) for _ in range(n)])  # [H, 2H]
        self.mtp_block = nn.LayerList([ErnieDecoderLayer(config, 0, tp) for _ in range(n)])


class Ernie4_5_MoeForCausalLM(ServingModelLayer, ComposedStep):
    """The serving interface of model/__init__.py, as MiMoForCausalLM; see docs/models.md."""

    def __init__(self, config: ErnieMoeConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = ErnieBody(config, tp)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, tied_to=tied)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.max_position_embeddings)
        self.draft_head = None

    @property
    def num_mtp_layers(self) -> int:
        return self.config.num_nextn_predict_layers




    def allocate_kv(self, num_layers: int, num_blocks: int, block_size: int, dtype: str = "float32") -> KVCache:
        """K and V per layer for this rank's KV heads."""
        return KVCache.allocate(num_layers, num_blocks, block_size, self.tp.split(self.config.num_key_value_heads),
                                self.config.head_dim, dtype)

    def kv_elements_per_token_layer(self) -> int:
        return 2 * self.tp.split(self.config.num_key_value_heads) * self.config.head_dim

    def forward(self, batch: ForwardBatch, kv: KVCache) -> ModelOutput:
        return self.run(batch.input_ids, batch.positions, PagedContext(batch, kv))

    def mtp_forward(self, index: int, batch: ForwardBatch, token_ids_shifted: paddle.Tensor,
                    prev_hidden: paddle.Tensor, mtp_kv: KVCache, kv_layer: int | None = None) -> MTPOutput:
        ctx = PagedContext(batch, mtp_kv)
        return self.run_mtp(index, token_ids_shifted, prev_hidden, batch.positions, ctx, kv_layer)

    def run(self, input_ids: paddle.Tensor, positions: paddle.Tensor, ctx: AttentionContext) -> ModelOutput:
        cos_sin = self.rotary.cos_sin(positions)
        x = self.model.embed_tokens(input_ids)  # [T, H]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos_sin, ctx, i)
        normed = self.model.norm(x)
        return ModelOutput(hidden_states=normed, mtp_hidden=normed if self.config.mtp_hidden_after_norm else x)

    def run_mtp(self, index: int, token_ids: paddle.Tensor, prev_hidden: paddle.Tensor,
                positions: paddle.Tensor, ctx: AttentionContext, kv_layer: int | None = None,
                out_rows: paddle.Tensor | None = None) -> MTPOutput:
        j = index % self.num_mtp_layers
        m = self.model
        emb = m.embed_tokens(token_ids)  # [T, H]
        if self.config.mtp_zero_position_zero:
            emb = emb * (positions != 0).astype(emb.dtype).unsqueeze(-1)
        x = m.mtp_linear_proj[j](paddle.concat([m.mtp_emb_norm[j](emb), m.mtp_hidden_norm[j](prev_hidden)], axis=-1))
        x = m.mtp_block[j](x, self.rotary.cos_sin(positions), ctx, j if kv_layer is None else kv_layer, out_rows)
        normed = m.norm(x)
        return MTPOutput(hidden_states=normed, mtp_hidden=normed if self.config.mtp_hidden_after_norm else x)

    def compute_logits(self, hidden_states: paddle.Tensor) -> paddle.Tensor:
        return self.lm_head(hidden_states).astype("float32")

    def mtp_logits(self, hidden_states: paddle.Tensor, index: int = 0) -> paddle.Tensor:
        """MTP outputs share the main head."""
        return self.compute_logits(hidden_states)

    def draft_token_ids(self, hidden_states: paddle.Tensor, index: int = 0) -> paddle.Tensor:
        return paddle.argmax(self.compute_logits(hidden_states), axis=-1)
