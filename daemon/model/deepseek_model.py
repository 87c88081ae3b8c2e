"""DeepSeek-V3 (`DeepseekV3ForCausalLM`) with its MTP module, in the released checkpoint's names.

    model.embed_tokens, model.norm, lm_head
    model.layers.{i}        i < num_hidden_layers: input_layernorm, self_attn (MLA: q_a_proj,
                            q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
                            o_proj), post_attention_layernorm, mlp (dense gate/up/down_proj for
                            i < first_k_dense_replace, else MoE: gate.weight, gate.e_score_correction_bias,
                            experts.{e}.*, shared_experts.*)
    model.layers.{N + j}    MTP module j (N = num_hidden_layers): embed_tokens, enorm, hnorm, eh_proj,
                            the same decoder block names, shared_head.norm, shared_head.head

MTP module j at position t: h = eh_proj([enorm(embed(token t+j+1)); hnorm(prev_hidden_t)]) (embedding
first, as eh_proj's columns are laid out), then one decoder block; its logits are
shared_head.head(shared_head.norm(h)), and h (before that norm) is the next depth's prev_hidden.
Depth 1's prev_hidden is the main model's final hidden, after model.norm by default
(`mtp_hidden_after_norm`). k > num_nextn_predict_layers applies the modules cyclically (k > 1 with
DeepSeek-V3's one module applies it repeatedly).
"""

from __future__ import annotations

import numpy as np
import paddle
from paddle import nn

from mtpserve.model.attention_context import AttentionContext, PagedContext
from mtpserve.model.decoder_layer import MLP, ServingModelLayer
from mtpserve.model.deepseek_config import DeepseekV3Config
from mtpserve.model.forward_batch import ForwardBatch
from mtpserve.model.kv_cache import KVCache
from mtpserve.model.mimo_model import ComposedStep, ModelOutput, MTPOutput
from mtpserve.model.mla import MLAttention
from mtpserve.model.moe import MoE
from mtpserve.model.norm import RMSNorm
from mtpserve.model.parallel import SINGLE, ParallelLMHead, ReplicatedLinear, TensorParallel, VocabParallelEmbedding
from mtpserve.model.rotary import RotaryEmbedding


class DeepseekDecoderLayer(nn.Layer):
    def __init__(self, config: DeepseekV3Config, index: int, tp: TensorParallel = SINGLE):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = MLAttention(config, tp)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MoE(config, tp) if config.is_moe_layer(index) else MLP(config, tp)

    def forward(self, x: paddle.Tensor, cos_sin: tuple[paddle.Tensor, paddle.Tensor], ctx: AttentionContext,
                layer: int, out_rows: paddle.Tensor | None = None) -> paddle.Tensor:
        """x: [T, H] -> [T, H] (or [N, H]: only `out_rows` go through the MLP; every row's KV is written)."""
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, ctx, layer)
        if out_rows is not None:
            x = paddle.gather(x, out_rows)
        return x + self.mlp(self.post_attention_layernorm(x))


class SharedHead(nn.Layer):
    def __init__(self, config: DeepseekV3Config, tp: TensorParallel):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)


class DeepseekMTPLayer(DeepseekDecoderLayer):
    """`model.layers.{num_hidden_layers + j}`: the decoder block plus the MTP module's own tensors."""

    def __init__(self, config: DeepseekV3Config, index: int, tp: TensorParallel = SINGLE):
        super().__init__(config, index, tp)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.zero_position_zero = config.mtp_zero_position_zero
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, tp)
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden)  # weight [H, 2H]: embedding columns first
        self.shared_head = SharedHead(config, tp)

    def predict(self, token_ids: paddle.Tensor, prev_hidden: paddle.Tensor, positions: paddle.Tensor,
                cos_sin: tuple[paddle.Tensor, paddle.Tensor], ctx: AttentionContext, layer: int,
                out_rows: paddle.Tensor | None = None) -> paddle.Tensor:
        """token_ids, positions: [T]; prev_hidden: [T, H] -> h [T, H] (or [N, H]) before shared_head.norm."""
        emb = self.embed_tokens(token_ids)  # [T, H]
        if self.zero_position_zero:
            emb = emb * (positions != 0).astype(emb.dtype).unsqueeze(-1)
        x = self.eh_proj(paddle.concat([self.enorm(emb), self.hnorm(prev_hidden)], axis=-1))
        return self(x, cos_sin, ctx, layer, out_rows)


class DeepseekV3Body(nn.Layer):
    def __init__(self, config: DeepseekV3Config, tp: TensorParallel):
        super().__init__()
        n = config.num_hidden_layers
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        main = [DeepseekDecoderLayer(config, i, tp) for i in range(n)]
        mtp = [DeepseekMTPLayer(config, n + j, tp) for j in range(config.num_nextn_predict_layers)]
        self.layers = nn.LayerList(main + mtp)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV3ForCausalLM(ServingModelLayer, ComposedStep):
    """The serving interface of model/__init__.py, as MiMoForCausalLM; see docs/models.md."""

    def __init__(self, config: DeepseekV3Config, tp: TensorParallel = SINGLE):
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = DeepseekV3Body(config, tp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        self.rotary = RotaryEmbedding(config.qk_rope_head_dim, config.rope_theta, config.max_position_embeddings,
                                      config.rope_scaling)
        self.draft_head = None

    @property
    def num_mtp_layers(self) -> int:
        return self.config.num_nextn_predict_layers

    def mtp_layer(self, index: int) -> DeepseekMTPLayer:
        layer = self.model.layers[self.config.num_hidden_layers + index % self.num_mtp_layers]
        assert isinstance(layer, DeepseekMTPLayer)
        return layer




    def allocate_kv(self, num_layers: int, num_blocks: int, block_size: int, dtype: str = "float32") -> KVCache:
        """The latent cache: one [r + rope] row per token and layer, both K and V (model/mla.py). Every
        tensor-parallel rank keeps the whole latent: it is one "head", shared by all query heads."""
        return KVCache.allocate(num_layers, num_blocks, block_size, 1, self.config.head_dim, dtype, shared_kv=True)

    def kv_elements_per_token_layer(self) -> int:
        return self.config.head_dim

    def forward(self, batch: ForwardBatch, kv: KVCache) -> ModelOutput:
        return self.run(batch.input_ids, batch.positions, PagedContext(batch, kv))

    def mtp_forward(self, index: int, batch: ForwardBatch, token_ids_shifted: paddle.Tensor,
                    prev_hidden: paddle.Tensor, mtp_kv: KVCache, kv_layer: int | None = None) -> MTPOutput:
        ctx = PagedContext(batch, mtp_kv)
        return self.run_mtp(index, token_ids_shifted, prev_hidden, batch.positions, ctx, kv_layer)

    def run(self, input_ids: paddle.Tensor, positions: paddle.Tensor, ctx: AttentionContext) -> ModelOutput:
        cos_sin = self.rotary.cos_sin(positions)
        x = self.model.embed_tokens(input_ids)  # [T, H]
        for i in range(self.config.num_hidden_layers):
            x = self.model.layers[i](x, cos_sin, ctx, i)
        normed = self.model.norm(x)
        return ModelOutput(hidden_states=normed, mtp_hidden=normed if self.config.mtp_hidden_after_norm else x)

    def run_mtp(self, index: int, token_ids: paddle.Tensor, prev_hidden: paddle.Tensor,
                positions: paddle.Tensor, ctx: AttentionContext, kv_layer: int | None = None,
                out_rows: paddle.Tensor | None = None) -> MTPOutput:
        layer = self.mtp_layer(index)
        kv_index = index % self.num_mtp_layers if kv_layer is None else kv_layer
        x = layer.predict(token_ids, prev_hidden, positions, self.rotary.cos_sin(positions), ctx, kv_index, out_rows)
        return MTPOutput(hidden_states=layer.shared_head.norm(x), mtp_hidden=x)

    def compute_logits(self, hidden_states: paddle.Tensor) -> paddle.Tensor:
        """[N, H] after model.norm -> fp32 logits [N, V]."""
        return self.lm_head(hidden_states).astype("float32")

    def mtp_logits(self, hidden_states: paddle.Tensor, index: int = 0) -> paddle.Tensor:
        """[N, H] after shared_head.norm of MTP module `index` -> fp32 logits [N, V] (its shared_head.head)."""
        return self.mtp_layer(index).shared_head.head(hidden_states).astype("float32")

    def draft_token_ids(self, hidden_states: paddle.Tensor, index: int = 0) -> paddle.Tensor:
        return paddle.argmax(self.mtp_logits(hidden_states, index), axis=-1)
